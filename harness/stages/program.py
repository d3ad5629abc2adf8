"""Stage programs (docs/protocol.md, 'Stage programs'): a boundary built by several stages, not
one stream.

`packed:NxL+M` is N branches of L greedy tokens each, from the prompt, then a merge stage of M
greedy tokens that reads them all, every stage opened by its delimiter, in one sequence under the
block visibility mask (a branch sees the prompt and itself, the merge everything). Position ids
either continue through the sequence (`:continuing`, the default) or restart each branch after
the prompt (`:parallel`, the merge continuing the longest branch), as merge schedulers pack them.
The boundary is the merge boundary: the whole packed sequence P. Every forward call carries its
rows of the mask (a 4-D float mask: 0 where a query sees a key, the dtype's minimum elsewhere,
which every attention backend reads alike) and its position ids; which backend serves them is
the stack's business.

Arms: `live` (the prompt prefilled, each stage's delimiter fed, its tokens generated one at a
time and fed back), and rebuilt over the same integer tokens, mask and positions: `prefill` (one
call), `incremental` (the prompt in one call, then one token at a time), `chunked:N`. Inside a
branch or the merge, end-of-turn tokens are masked out of the logits (the structural logits
mask), so a stage runs its full length and its cap is where the next delimiter is forced.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

from kvfid.records.plain import as_plain
from kvfid.states import cache as kv
from kvfid.stages import batched as stages_batched, transplant as stages_transplant
from kvfid.stages.checks import check_program_fits
from kvfid.protocol.constructions import ProtocolError, parse_construction
from kvfid.states.cache import top2
from kvfid.protocol.decode import Greedy, Runner, new_cache, resume

LAYOUTS = ("packed", "batched")
POSITIONS = ("continuing", "parallel")
MAX_BRANCHES = 16
_SPELLING = re.compile(r"(\w+):(\d+)x(\d+)\+(\d+)(?::(\w+))?")


@dataclass(frozen=True)
class Program:
    """A stage program: N branches of L tokens, then a merge of M, in one layout."""

    layout: str
    branches: int
    branch_tokens: int
    merge_tokens: int
    positions: str = "continuing"
    sees: tuple[tuple[int, ...], ...] = ()  # per segment, the segments it sees; () the contract

    @property
    def label(self) -> str:
        return f"{self.layout}:{self.branches}x{self.branch_tokens}+{self.merge_tokens}:{self.positions}"

    def visibility(self) -> torch.Tensor:
        """[N+2, N+2] bool: segment 0 the prompt, 1..N branches, N+1 the merge; by default a
        branch sees the prompt and itself, the merge everything."""
        n = self.branches + 2
        if self.sees:
            return torch.tensor([[t in seen for t in range(n)] for seen in self.sees])
        sees = torch.eye(n, dtype=torch.bool)
        sees[:, 0] = sees[-1] = True
        return sees


def parse_program(text: str) -> Program:
    """`packed:NxL+M[:continuing|parallel]` -> Program; ProtocolError (exit 2) naming what is wrong."""
    found = _SPELLING.fullmatch(text.strip())
    if not found:
        raise ProtocolError(f"--program {text!r}: spell it LAYOUT:NxL+M[:POSITIONS], e.g. "
                            f"packed:3x8+8:parallel (N branches of L tokens, a merge of M)")
    layout, n, length, merge, positions = found.groups()
    if layout not in LAYOUTS:
        raise ProtocolError(f"--program {text!r}: layout {layout!r} is not available; valid: "
                            f"{', '.join(LAYOUTS)}")
    positions = positions or "continuing"
    if positions not in POSITIONS:
        raise ProtocolError(f"--program {text!r}: positions {positions!r}; valid: {', '.join(POSITIONS)}")
    if not 1 <= int(n) <= MAX_BRANCHES or int(length) < 1 or int(merge) < 1:
        raise ProtocolError(f"--program {text!r}: an empty stage; need 1 <= N <= {MAX_BRANCHES} "
                            f"branches, L >= 1 and M >= 1 tokens")
    return Program(layout, int(n), int(length), int(merge), positions)


def delimiters(codec, program: Program) -> list[list[int]]:
    """Each stage's opening delimiter as token ids: branches 1..N, then the merge."""
    texts = [f"\n[branch {i + 1}]\n" for i in range(program.branches)] + ["\n[merge]\n"]
    tokenizer = getattr(codec, "tokenizer", None)
    if tokenizer is not None:
        return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return [list(t.encode("utf-8")) for t in texts]  # a byte codec: ids 0-255 are bytes


@dataclass
class Layout:
    """The packed sequence as it grows: tokens, each position's segment and position id."""

    sees: torch.Tensor  # [S, S] bool: segment 0 the prompt, 1..N branches, N+1 the merge
    positions_mode: str
    tokens: list[int]
    segments: list[int]
    positions: list[int]

    @classmethod
    def start(cls, program: Program) -> "Layout":
        return cls(program.visibility(), program.positions, [], [], [])

    def next_position(self, segment: int) -> int:
        """The position id of the next token of `segment`."""
        mine = [p for p, s in zip(self.positions, self.segments) if s == segment]
        if mine:
            return mine[-1] + 1
        if self.positions_mode == "continuing" or segment == 0:
            return len(self.tokens)
        prompt = self.segments.count(0)
        if segment == len(self.sees) - 1:  # the merge continues the longest stage
            return max(self.positions) + 1
        return prompt  # a branch restarts after the prompt

    def extend(self, ids: list[int], segment: int) -> None:
        for token in ids:
            self.positions.append(self.next_position(segment))
            self.segments.append(segment)
            self.tokens.append(int(token))

    def mask(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """[1, 1, end - start, end] float: the rows of positions start..end-1 over keys 0..end-1."""
        from kvfid.kernels.attention.reference import segment_mask

        seg = torch.tensor(self.segments[:end])[None]
        visible = segment_mask(seg, self.sees, q_len=end - start)  # [1, q, end]
        return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[:, None]

    def first_segment(self, position: int | None) -> str | None:
        """The name of the segment holding `position` (prompt, branch i, merge)."""
        if position is None:
            return None
        seg = self.segments[position]
        return "prompt" if seg == 0 else "merge" if seg == len(self.sees) - 1 else f"branch {seg}"


def _feed(runner: Runner, cache, layout: Layout, start: int, end: int) -> torch.Tensor:
    """Feed layout tokens start..end-1 after `cache` (which holds 0..start-1); last logits [V]."""
    dtype = next(runner.module.parameters()).dtype
    ids = torch.tensor([layout.tokens[start:end]])
    return runner.forward(ids, cache, attention_mask=layout.mask(start, end, dtype),
                          position_ids=torch.tensor([layout.positions[start:end]]))[0]


def _choose(logits: torch.Tensor, eos_ids) -> tuple[int, float]:
    """The greedy token and margin with end-of-turn ids masked out (the structural logits mask)."""
    masked = logits.float().clone()
    masked[[i for i in eos_ids if i < masked.numel()]] = float("-inf")
    return top2(masked)


def run_live(module, program: Program, prompt: list[int], openers: list[list[int]], eos_ids):
    """The live program: prompt, then each stage's delimiter fed and its tokens generated one at
    a time (packed: in one sequence; batched: the branches as rows, composed). Returns (layout,
    state, generated margins, runner, cache)."""
    layout = Layout.start(program)
    layout.extend(prompt, 0)
    stages = [(i + 1, program.branch_tokens) for i in range(program.branches)]
    stages.append((program.branches + 1, program.merge_tokens))
    if program.layout == "batched":  # the branches as rows, composed (stages_batched)
        cache, margins, runner = stages_batched.run_branches(module, layout, program, prompt,
                                                             openers, _choose, eos_ids)
        stages, openers = stages[-1:], openers[-1:]
    else:
        runner, cache, margins = Runner(module), new_cache(module), []
        _feed(runner, cache, layout, 0, len(prompt))
    for (segment, length), opener in zip(stages, openers):
        start = len(layout.tokens)
        layout.extend(opener, segment)
        logits = _feed(runner, cache, layout, start, len(layout.tokens))
        for _ in range(length):
            token, margin = _choose(logits, eos_ids)
            margins.append(margin)
            layout.extend([token], segment)
            logits = _feed(runner, cache, layout, len(layout.tokens) - 1, len(layout.tokens))
    state = kv.snapshot(cache, layout.tokens, logits[None], config=module.config)
    return layout, state, margins, runner, cache


def rebuild(module, layout: Layout, label: str, prompt_length: int):
    """The merge boundary state over the live layout's tokens, mask and positions, built by
    `label` (prefill, incremental, chunked:N); returns (state, runner)."""
    runner, cache, total = Runner(module), new_cache(module), len(layout.tokens)
    construction = parse_construction(label)
    bounds = [0, *_cuts(construction, prompt_length, total)]
    for start, end in zip(bounds, bounds[1:]):
        logits = _feed(runner, cache, layout, start, end)
    return kv.snapshot(cache, layout.tokens, logits[None], config=module.config), runner


def _cuts(construction, prompt_length: int, total: int) -> list[int]:
    if construction.kind == "prefill":
        return [total]
    if construction.kind == "incremental":
        return [prompt_length, *range(prompt_length + 1, total + 1)]
    return [*range(construction.n, total, construction.n), total]


def decode_suffix(runner: Runner, layout: Layout, state, steps: int, eos_ids) -> Greedy:
    """`steps` greedy suffix tokens of the merge from a boundary state (stopping after EOS)."""
    cache, grown, logits = resume(state, runner.module), _copy(layout), state.logits
    out, merge = Greedy(), len(layout.sees) - 1
    for step in range(steps):
        token, margin = top2(logits)
        out.tokens.append(token)
        out.margins.append(margin)
        if token in eos_ids:
            out.eos = True
            break
        if step < steps - 1:
            grown.extend([token], merge)
            logits = _feed(runner, cache, grown, len(grown.tokens) - 1, len(grown.tokens))
    return out


def _copy(layout: Layout) -> Layout:
    return Layout(layout.sees, layout.positions_mode, list(layout.tokens), list(layout.segments),
                  list(layout.positions))


def segments_exact(a, b, layout: Layout) -> dict:
    """Per segment: whether its positions' keys and values have the same bits in every layer that
    holds the whole prefix (a window layer holds only the last positions and is left out)."""
    out = {}
    for seg in range(len(layout.sees)):
        at = torch.tensor([i for i, x in enumerate(layout.segments) if x == seg])
        same = True
        for la, lb in zip(a.layers, b.layers):
            if la.span != (0, len(layout.tokens)):
                continue
            for part in ("k", "v"):
                if part in la.parts:
                    same &= kv.bits_equal(la.parts[part][:, :, at], lb.parts[part][:, :, at])
        out[layout.first_segment(int(at[0]))] = bool(same)
    return out


@dataclass
class ProgramArm:
    label: str
    state: object
    suffix: Greedy
    wall_s: float
    forward_calls: int


def run_program(model, stack, prompt_text: str, program: Program, S: int, arms: tuple[str, ...],
                ignore_eos: bool = False, replicas: tuple[str, ...] = (),
                transplants: tuple = ()) -> dict:
    """Measure one stage program on one stack: live and each rebuilt arm at the merge boundary,
    compared with live (cache per layer, the first bad segment, boundary logits, suffix); each
    arm of `replicas` built again from scratch and compared with its first build; each of
    `transplants` (stages_transplant) decoded and classified."""
    codec = model.codec
    eos = frozenset() if ignore_eos else codec.eos_ids
    prompt, openers = codec.prompt_ids(prompt_text), delimiters(codec, program)
    check_program_fits(len(prompt), program, [len(o) for o in openers], S, model.context_length)
    if program.layout == "batched":
        stages_batched.check_batched(program, openers)
    built = {}
    with stack.activate(model) as module:
        start = time.perf_counter()
        layout, state, margins, runner, cache = run_live(module, program, prompt, openers, codec.eos_ids)
        del cache
        suffix = decode_suffix(runner, layout, state, S, eos)
        built["live"] = ProgramArm("live", state, suffix, time.perf_counter() - start, runner.calls)
        for label in arms:
            if label == "live":
                continue
            start = time.perf_counter()
            rebuilt, runner = rebuild(module, layout, label, len(prompt))
            suffix = decode_suffix(runner, layout, rebuilt, S, eos)
            built[label] = ProgramArm(label, rebuilt, suffix, time.perf_counter() - start,
                                      runner.calls)
        again = {}
        for label in replicas:
            if label == "live":
                _, state, _, runner, cache = run_live(module, program, prompt, openers, codec.eos_ids)
                del cache
            else:
                state, runner = rebuild(module, layout, label, len(prompt))
            again[label] = (state, decode_suffix(runner, layout, state, S, eos))
        moved = [stages_transplant.run(module, spec, built, layout, len(prompt), S, eos,
                                       decode_suffix) for spec in transplants]
    live = built["live"]
    comparisons = []
    for label, arm in built.items():
        if label == "live":
            continue
        cache_cmp = kv.compare_states(live.state, arm.state)
        comparisons.append({   # the records as plain data, in the result run_from_result types
            "arm": label, "bit_exact": cache_cmp.bit_exact,
            "first_bad_layer": cache_cmp.first_bad_layer, "first_bad_kv": cache_cmp.first_bad_kv,
            "first_position": cache_cmp.first_position,
            "first_bad_segment": layout.first_segment(cache_cmp.first_position),
            "cache": as_plain(cache_cmp),
            "segments_exact": segments_exact(live.state, arm.state, layout),
            "max_abs": cache_cmp.max_abs, "d_rel": cache_cmp.d_rel,
            "logits": as_plain(kv.compare_logits(live.state.logits, arm.state.logits)),
            "suffix": as_plain(kv.compare_suffixes(live.suffix.tokens, arm.suffix.tokens,
                                                   live.suffix.margins, arm.suffix.margins))})
    replica_rows = [{"arm": label, "bit_exact": kv.compare_states(built[label].state, state).bit_exact,
                     "suffix_identical": list(suffix.tokens) == list(built[label].suffix.tokens)}
                    for label, (state, suffix) in again.items()]
    return {
        "program": program.label, "replicas": replica_rows, "transplants": moved, "stack": stack.describe(), "prompt_length": len(prompt),
        "boundary_length": len(layout.tokens), "S": S,
        "segments": [{"segment": layout.first_segment(layout.segments.index(s)),
                      "start": layout.segments.index(s), "length": layout.segments.count(s),
                      "positions": [min(p for p, x in zip(layout.positions, layout.segments) if x == s),
                                    max(p for p, x in zip(layout.positions, layout.segments) if x == s)],
                      "sees": [layout.first_segment(layout.segments.index(t))
                               for t in range(len(layout.sees)) if layout.sees[s, t]]}
                     for s in range(len(layout.sees))],
        "prefix_sha": kv.sha_ids(layout.tokens), "live_margins": margins,
        "layout": {"tokens": layout.tokens, "segments": layout.segments, "positions": layout.positions},
        "arms": {label: {"cache_sha": kv.sha_cache(arm.state), "suffix": list(arm.suffix.tokens),
                         "wall_s": arm.wall_s, "forward_calls": arm.forward_calls}
                 for label, arm in built.items()},
        "comparisons": comparisons}
