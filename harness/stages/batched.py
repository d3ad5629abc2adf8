"""The `batched` layout of a stage program: the branches decoded as rows of one batch, then
their states composed into the merge stage's packed state (kvfid.stages.program).

Row i is the prompt, branch i's delimiter and its tokens, with positions from 0 (a branch row
restarts after the prompt: positions are `parallel` by nature). After the last branch token is
fed, the composed state is the prompt's keys and values from row 0 followed by each branch's own
keys and values, in branch order: the packed layout's sequence, mask and positions, but built by
rows. The merge stage then runs on it exactly as in the packed layout. Composition needs every
layer to hold full K/V (a window, latent or recurrent layer cannot be concatenated); other
models are refused.
"""

from __future__ import annotations

import torch

from kvfid.states import cache as kv
from kvfid.protocol.constructions import ProtocolError
from kvfid.protocol.decode import Runner, new_cache, resume


def check_batched(program, openers: list[list[int]]) -> None:
    """Refuse before compute what the batched layout cannot do (one line, exit 2)."""
    if program.positions != "parallel":
        raise ProtocolError(f"--program {program.label}: batched branches are rows from the "
                            "prompt, so their positions are parallel; spell it with :parallel")
    if len({len(o) for o in openers[:program.branches]}) != 1:
        raise ProtocolError(f"--program {program.label}: the branch delimiters differ in length, "
                            "so the rows would need padding; use at most 9 branches")


def compose(states: list[kv.BoundaryState], prompt_length: int, tokens: list[int]) -> kv.BoundaryState:
    """One packed state from branch rows: row 0's prompt, then each row's branch, per layer."""
    if any(layer.kind != "full" for state in states for layer in state.layers):
        raise ProtocolError("the batched layout composes full K/V layers only; this model has "
                            "other layer states (use the packed layout)")
    keys, values = [], []
    for index in range(len(states[0].layers)):
        parts = [(s.layers[index].parts["k"], s.layers[index].parts["v"]) for s in states]
        # [1, Hkv, T, D]: the prompt once, then every branch's own positions
        keys.append(torch.cat([parts[0][0][:, :, :prompt_length]]
                              + [k[:, :, prompt_length:] for k, _ in parts], dim=2).clone())
        values.append(torch.cat([parts[0][1][:, :, :prompt_length]]
                                + [v[:, :, prompt_length:] for _, v in parts], dim=2).clone())
    return kv.BoundaryState(tokens, keys, values, logits=None)


def run_branches(module, layout, program, prompt: list[int], openers: list[list[int]], choose,
                 eos_ids):
    """Decode every branch as a row of one batch; extend `layout` with the branches (in order)
    and return (the composed cache, the generated margins, the runner)."""
    runner, n = Runner(module), program.branches
    rows = [prompt + openers[i] for i in range(n)]
    logits, cached = runner.forward(torch.tensor(rows), new_cache(module))  # [N, V]: positions 0..
    branches, margins = [[] for _ in range(n)], []
    for _ in range(program.branch_tokens):
        for i in range(n):
            token, margin = choose(logits[i], eos_ids)
            branches[i].append(token)
            margins.append(margin)
        logits, cached = runner.forward(torch.tensor([[b[-1]] for b in branches]), cached)
    states = [kv.snapshot(cached.cache, rows[i] + branches[i], logits, row=i, config=module.config)
              for i in range(n)]
    del cached
    for i in range(n):
        layout.extend(openers[i] + branches[i], i + 1)
    composed = compose(states, len(prompt), layout.tokens)
    return resume(composed, module), margins, runner
