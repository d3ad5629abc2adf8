"""The faithful form of a recurrent layer's prefill: the state computed by the recurrence that a
decode step uses, one position at a time, in order.

A recurrent layer (Gated DeltaNet, Mamba-2, short convolutions) computes a call of several tokens
with a different algorithm from a one-token decode step: transformers' Qwen3-Next, for example,
runs a chunked gated-delta scan (chunks of 64, a triangular solve) and a full causal conv1d for a
prefill, and the recurrent rule and `causal_conv1d_update` for a step. Their states differ in the
last bits even with every op batch-invariant: the two algorithms round differently.

`faithful_recurrence(model)` makes every call of more than one token to such a layer run the layer
once per token, in order, with the same cache: each token takes exactly the path (and the shapes)
of a decode step. Everything else in the model (projections outside the layer, attention, MLP,
MoE) still runs the whole call at once.

The first token of an empty cache takes the decode step too, from a zero state (the state an empty
cache stands for: the prefill paths start from zeros). The layer's own first-call path (a chunked
scan over one token, a padded full convolution) rounds differently from the step, and a
left-padded row of a batch (`cobatched:N`) reaches its first real token with a state the masked
pads left at zero, through the step: without this its first token, and so layer 0's output there,
differed from the live one's (docs/hazards.md, "A left-padded row's first token under the
faithful recurrence"). The step needs the cache's state tensors, which the layer makes itself on its first
call (their shapes are the model's); so that call runs once, its output is dropped, the state
tensors it added to the cache are zeroed, and the token runs again as a step (`_from_zero`). A
cache that holds its states before the first call (preallocated) is left as it is.

A recurrent layer is found from its attributes, never from a model's name: a module with a
`layer_idx` that owns a depthwise 1-d convolution (`nn.Conv1d` with groups == channels: the
causal short convolution that keeps a conv state), or the innermost module with a `layer_idx`
whose layer type in the config is a recurrent-only one (`linear_attention`, `conv`: a linear
attention without a convolution, e.g. a lightning attention whose prefill runs in blocks and whose
step runs the recurrence) and whose forward takes the cache. A model without one is left as it is.

Cost: a stepped layer runs one call per token of the prefill (docs/hazards.md, "The faithful
recurrence's cost"), and one more, dropped, on an empty cache's first token; everything outside
the stepped layers still runs the call at once.
"""

from __future__ import annotations

import inspect

import torch

CACHE_KEYWORDS = ("cache", "cache_params", "past_key_values", "past_key_value")

# id(layer) -> the token (0-based, within the current call) a stepped layer is computing now; an
# op tracer reads it with `step_of` to align a stepped call's steps with a decode step's call.
_steps: dict[int, int] = {}
# ids of the layers whose forward is stepped now.
_stepped: set[int] = set()


def step_of(layer: torch.nn.Module) -> int | None:
    """The token a stepped layer is computing now, None outside its steps."""
    return _steps.get(id(layer))


def is_stepped(layer: torch.nn.Module) -> bool:
    """Whether `layer` runs a call of several tokens one token at a time now."""
    return id(layer) in _stepped


def _depthwise_conv1d(module: torch.nn.Module) -> bool:
    return (isinstance(module, torch.nn.Conv1d)
            and module.groups == module.in_channels == module.out_channels)


# transformers' layer types whose cache layer holds only a recurrent / conv state
RECURRENT_LAYER_TYPES = ("linear_attention", "conv")


def _recurrent_by_type(model: torch.nn.Module, module: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(config, "layer_types", None) or ()
    index = getattr(module, "layer_idx", None)
    if not isinstance(index, int) or not 0 <= index < len(types) or \
            types[index] not in RECURRENT_LAYER_TYPES:
        return False
    if any(hasattr(m, "layer_idx") for m in module.modules() if m is not module):
        return False   # a block around the mixer: step the mixer only
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(k in params for k in CACHE_KEYWORDS)


def recurrent_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of each recurrent layer: a module with `layer_idx` that owns a depthwise
    1-d convolution as a direct child, or the innermost module of a recurrent-only layer type."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "layer_idx") and (any(_depthwise_conv1d(c) for c in m.children())
                                            or _recurrent_by_type(model, m))]


# `step_of` during a call whose output is dropped (the first call that makes a layer's state)
PRIMING = -1


def _slots(cache, index, counters: bool = False) -> dict[tuple, torch.Tensor]:
    """The state tensors a cache holds for layer `index`, by where they are held: (attribute[, key])
    of its cache layer (a tensor, or a dict or list of them: `conv_states`, `recurrent_states`),
    ("cache", attribute) for entry `index` of the cache's own per-layer lists. `counters`: the
    integer tensors instead, counters beside the states (transformers 5.25's
    `cumulative_length_linear`: the tokens a linear layer has seen, its `get_seq_length`)."""
    out: dict[tuple, torch.Tensor] = {}

    def add(where: tuple, value) -> None:
        items = value.items() if isinstance(value, dict) else enumerate(value) \
            if isinstance(value, (list, tuple)) else [(None, value)]
        for key, tensor in items:
            # an empty tensor holds nothing; a state is floating, a counter an integer
            if isinstance(tensor, torch.Tensor) and tensor.numel() and \
                    tensor.is_floating_point() != counters:
                out[where if key is None else (*where, key)] = tensor

    layers = getattr(cache, "layers", None) or ()
    if isinstance(index, int) and index < len(layers):
        for name, value in vars(layers[index]).items():
            add((name,), value)
    for name, value in vars(cache).items():
        if name != "layers" and isinstance(value, list) and isinstance(index, int) \
                and index < len(value):
            add(("cache", name), value[index])
    return out


def _cache_of(args, kwargs):
    """The cache a layer's call was given (by keyword, or positional: it has `get_seq_length`)."""
    for k in CACHE_KEYWORDS:
        if kwargs.get(k) is not None:
            return kwargs[k]
    return next((a for a in args if hasattr(a, "get_seq_length")), None)


def _from_zero(layer: torch.nn.Module, forward, cache, args, kwargs):
    """forward(*args, **kwargs) of one token; when that call makes the layer's state in `cache`
    (tensors where the cache held none for its `layer_idx` before: a call that replaces a held
    state makes none), its output is dropped, those tensors are zeroed and the token runs again,
    now through the decode step from a zero state."""
    index = getattr(layer, "layer_idx", None)
    if _slots(cache, index):   # the layer's state is there: a decode step, as it is
        return forward(*args, **kwargs)
    counted = {where: c.clone() for where, c in _slots(cache, index, counters=True).items()}
    previous = _steps.get(id(layer))   # the call that makes it: a tracer skips its ops
    _steps[id(layer)] = PRIMING
    try:
        out = forward(*args, **kwargs)
    finally:
        if previous is None:
            del _steps[id(layer)]
        else:
            _steps[id(layer)] = previous
    made = list(_slots(cache, index).values())
    if not made:   # a layer that keeps no state in the cache: its output stands
        return out
    for tensor in made:
        tensor.zero_()
    # The dropped call counted its token: counters go back to what they were, so the token is
    # counted once (a linear layer's count is the cache's length, and so the next positions).
    for where, counter in _slots(cache, index, counters=True).items():
        if where in counted:
            counter.copy_(counted[where])
    return forward(*args, **kwargs)


def _token(value, length: int, t: int):
    """Position t of a per-token argument ([B, T, ...] or a [B, T] mask: any tensor keyword whose
    dim 1 is the call's length, also inside a tuple such as the rotary (cos, sin)); others as
    they are."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
        return value[:, t:t + 1].contiguous()
    if isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(_token(v, length, t) for v in value)
    return value


def _stepwise(layer: torch.nn.Module, forward):
    """forward(hidden_states [B, T, D], ...) run once per token when a cache is given
    (hidden_states positional or by that keyword, as transformers' layers are called)."""
    def step_by_step(*args, **kwargs):
        positional = bool(args)
        hidden_states = args[0] if positional else kwargs.get("hidden_states")
        has_cache = any(kwargs.get(k) is not None for k in CACHE_KEYWORDS) or any(
            hasattr(a, "get_seq_length") for a in args)
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3 or not has_cache:
            return forward(*args, **kwargs)
        cache = _cache_of(args, kwargs)
        length = hidden_states.shape[1]
        if length == 1:
            return _from_zero(layer, forward, cache, args, kwargs)
        outs = []
        for t in range(length):
            _steps[id(layer)] = t
            try:
                step_kwargs = {k: _token(v, length, t) for k, v in kwargs.items()}
                step_args = (hidden_states[:, t:t + 1].contiguous(),
                             *(_token(a, length, t) for a in args[1:])) if positional else args
                outs.append(_from_zero(layer, forward, cache, step_args, step_kwargs) if t == 0
                            else forward(*step_args, **step_kwargs))
            finally:
                del _steps[id(layer)]
        if isinstance(outs[0], torch.Tensor):
            return torch.cat(outs, dim=1)  # [B, T, D]
        # a tuple: every per-token part (a step's [B, 1, ...]: hidden states, or the q, k, v a
        # mixer projects) joined over the steps, the rest as the last step left it
        return tuple(torch.cat(parts, dim=1) if all(isinstance(p, torch.Tensor) and p.dim() >= 2
                                                    and p.shape[1] == 1 for p in parts)
                     else parts[-1] for parts in zip(*outs))
    return step_by_step


class faithful_recurrence:  # noqa: N801  (a state switch, named like set_batch_invariant_mode)
    """Within the block, `model`'s recurrent layers compute a call of several tokens one token at a
    time (the decode step's recurrence, in order). Exit restores each layer's forward as found.
    `enabled=False` is a no-op, so a stack can pass its option straight through."""

    def __init__(self, model: torch.nn.Module, enabled: bool = True):
        self._model, self._enabled = model, enabled
        self._saved: list[list[tuple[torch.nn.Module, object, bool]]] = []

    def __enter__(self) -> "faithful_recurrence":
        saved = []
        if self._enabled:
            for _, layer in recurrent_layers(self._model):
                saved.append((layer, layer.__dict__.get("forward"), id(layer) in _stepped))
                layer.forward = _stepwise(layer, layer.forward)
                _stepped.add(id(layer))
        self._saved.append(saved)
        return self

    def __exit__(self, *exc_info) -> bool:
        for layer, found, was_stepped in reversed(self._saved.pop()):
            if found is None:
                del layer.forward
            else:
                layer.forward = found
            if not was_stepped:
                _stepped.discard(id(layer))
        return False

    @property
    def layers(self) -> list[str]:
        """The paths of the layers this switch changes in its model."""
        return [name for name, _ in recurrent_layers(self._model)]
