"""A model that writes a cache layer more than once per token (a layer run twice in one forward:
a looped model whose configured sections overlap) is refused in one line (exit 3), not an
internal error: its cache holds more positions than the tokens fed."""

from __future__ import annotations

import pytest

from kvfid.errors import EXIT_ENVIRONMENT
from kvfid.inputs import models
from kvfid.stacks.stack import Stack
from kvfid.states.cache import CacheOverwritten
from kvfid.protocol.protocol import ItemPlan, run_item
from protocol_fixtures import PROMPT


def test_a_layer_written_twice_per_token_is_refused_naming_it():
    config = {**models._TINY, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1}
    model = models._random_model("tiny-llama-twice", "llama", config, seed=1)
    layers = model.master.model.layers
    layers[1] = layers[0]                 # layer 0 runs twice, writing cache layer 0 twice
    with pytest.raises(CacheOverwritten, match="cache layer 0 .* more than once per token") as err:
        run_item(model, Stack("sdpa", "fp32"), PROMPT, ItemPlan(4, 1))
    assert err.value.exit_code == EXIT_ENVIRONMENT
