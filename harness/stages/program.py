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

A program is a layout (`Layout`: segments, positions, visibility) that the protocol's arms, its
greedy loop and `compare_arms` run over (kvfid.protocol.protocol): the layout feeds each chunk
and each greedy step at its positions under its visibility. Arms: `live` (the prompt prefilled,
each stage's delimiter fed, its tokens generated one at a time and fed back), and rebuilt over
the same integer tokens, mask and positions: `prefill` (one call), `incremental` (the prompt in
one call, then one token at a time), `chunked:N`. `measure` returns the typed run
(kvfid.records.program.ProgramRun) and the live layout. Inside a
branch or the merge, end-of-turn tokens are masked out of the logits (the structural logits
mask), so a stage runs its full length and its cap is where the next delimiter is forced.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass

import torch

from kvfid.states import cache as kv
from kvfid.stacks.serving import describe_layers
from kvfid.stages import batched as stages_batched, transplant as stages_transplant
from kvfid.stages.checks import check_layers, check_program_fits, program_length
from kvfid.protocol.constructions import ProtocolError, TransplantSpec, parse_construction
from kvfid.protocol.decode import Greedy, Runner, greedy, new_cache, top2_without
from kvfid.protocol.protocol import (Arm, compare_arms, decode_suffix, run_construction,
                                     run_transplant)
from kvfid.records.program import (ProgramArm, ProgramComparison, ProgramReplica, ProgramRun,
                                   ProgramTransplant)
from kvfid.stages.layout import Layout

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


def check(model, program: Program, prompt_length: int, S: int, arms: tuple[str, ...],
          transplants: tuple[str, ...] = ()) -> tuple[tuple[TransplantSpec, ...], int]:
    """Everything a program is checked for against `model` before compute (ProtocolError, exit
    2, in one line): its stages and suffix fit the context, the batched layout's rows, the
    transplants (`segment=NAME` resolved), layers that attend through the mask only. Returns the
    transplants parsed and the tokens the program needs (the merge boundary and S)."""
    openers = delimiters(model.codec, program)
    lengths = [len(o) for o in openers]
    check_program_fits(prompt_length, program, lengths, S, model.context_length)
    if program.layout == "batched":
        stages_batched.check_batched(program, openers)
    moves = ()
    if transplants:
        ranges = stages_transplant.segment_ranges(prompt_length, program, lengths)
        moves = tuple(stages_transplant.parse(t, ranges, arms) for t in transplants)
    check_layers(describe_layers(model))
    return moves, program_length(prompt_length, program, lengths) + S


def live_program(module, program: Program, prompt: list[int], openers: list[list[int]], S: int,
             eos_ids, suffix_eos) -> tuple[Layout, Arm]:
    """The live program: prompt, then each stage's delimiter fed and its tokens generated one at
    a time by the greedy loop, end-of-turn masked (packed: in one sequence; batched: the branches
    as rows, composed); then its suffix from the merge boundary state, stopping at `suffix_eos`.
    Returns the layout it grew and the live arm (`generated`: the stages' tokens and margins)."""
    started = time.perf_counter()
    layout = Layout.start(program)
    layout.extend(prompt, 0)
    stages = [(i + 1, program.branch_tokens) for i in range(program.branches)]
    stages.append((program.branches + 1, program.merge_tokens))
    if program.layout == "batched":  # the branches as rows, composed (stages_batched)
        cached, margins, runner = stages_batched.run_branches(module, layout, program, prompt,
                                                              openers, top2_without, eos_ids)
        stages, openers = stages[-1:], openers[-1:]
    else:
        runner, margins = Runner(module), []
        _, cached = layout.forward(runner, new_cache(module), 0, len(prompt))
    choose = functools.partial(top2_without, eos_ids=eos_ids)
    for (segment, length), opener in zip(stages, openers):
        start = len(layout.tokens)
        layout.extend(opener, segment)
        logits, cached = layout.forward(runner, cached, start, len(layout.tokens))
        feed = layout.stage_feed(runner, cached, segment)
        generated, logits = greedy(logits[0], length, frozenset(), feed, feed_last=True,
                                   choose=choose)
        cached = feed.cached
        margins += generated.margins
    state = kv.snapshot(cached.cache, layout.tokens, logits[None], config=module.config)
    del cached, feed
    suffix = decode_suffix(runner, state, S, suffix_eos, layout.suffix_feed)
    return layout, Arm("live", state, suffix, time.perf_counter() - started, runner.calls,
                       runner.seconds, generated=Greedy(margins=margins))  # the run keeps margins


def rebuild(module, layout: Layout, label: str, prompt_length: int, S: int, eos_ids) -> Arm:
    """The merge boundary state over the live layout's tokens, mask and positions, built by
    `label` (prefill, incremental, chunked:N) as the protocol builds an arm, its suffix decoded
    in the merge."""
    return run_construction(module, parse_construction(label), prompt_length, layout.tokens, S,
                            eos_ids, layout=layout)


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


def against_live(live: Arm, arm: Arm, layout: Layout) -> ProgramComparison:
    """A rebuilt arm against live at the merge boundary (kvfid.protocol.protocol.compare_arms),
    with the stage of the first differing position and each stage's verdict."""
    compared = compare_arms(live, arm, "arm")
    return ProgramComparison(arm.label, compared.cache, compared.logits, compared.suffix,
                             layout.first_segment(compared.cache.first_position),
                             segments_exact(live.state, arm.state, layout))


def transplant(module, spec: TransplantSpec, built: dict[str, Arm], layout: Layout,
               prompt_length: int, S: int, eos_ids, spelled: str | None) -> ProgramTransplant:
    """One transplant at the merge boundary (kvfid.protocol.protocol.run_transplant), its
    suffix decoded in the merge; `spelled`: as the case wrote it."""
    moved = run_transplant(module, spec, built, prompt_length, S, eos_ids, layout.suffix_feed)
    return ProgramTransplant(f"{spec.recipient}<-{spec.donor}:{spec.selection.label}",
                             moved.outcome, moved.recipient_equals_donor, spelled, moved.suffix,
                             moved.suffix_sha)


def cache_exact(a: Arm, b: Arm) -> bool:
    """Whether two arms' boundary caches have the same bits (a live replica that grew other
    tokens has another prefix: not the same)."""
    return a.state.prefix == b.state.prefix and kv.compare_states(a.state, b.state).bit_exact


@dataclass(frozen=True)
class Measured:
    """A measured program: its typed run and the live layout it was measured over (the
    crossing rebuilds that layout's integers on other stacks)."""

    run: ProgramRun
    layout: Layout


def measure(model, stack, prompt_text: str, program: Program, S: int, arms: tuple[str, ...],
            ignore_eos: bool = False, replicas: tuple[str, ...] = (), transplants: tuple = (),
            spelled: tuple[str, ...] = ()) -> Measured:
    """Measure one stage program on one stack: live and each rebuilt arm at the merge boundary,
    compared with live (cache per layer, the first bad segment, boundary logits, suffix); each
    arm of `replicas` built again from scratch and compared with its first build; each of
    `transplants` decoded and classified (`spelled`: as the case wrote them). The program is
    checked against the model before (`check`; a case's `program_matrix.bind`)."""
    codec = model.codec
    eos = frozenset() if ignore_eos else codec.eos_ids
    prompt, openers = codec.prompt_ids(prompt_text), delimiters(codec, program)
    with stack.activate(model) as module:
        layout, live = live_program(module, program, prompt, openers, S, codec.eos_ids, eos)
        built = {"live": live}
        for label in arms:
            if label != "live":
                built[label] = rebuild(module, layout, label, len(prompt), S, eos)
        again = {label: live_program(module, program, prompt, openers, S, codec.eos_ids, eos)[1]
                 if label == "live" else rebuild(module, layout, label, len(prompt), S, eos)
                 for label in replicas}
        moved = tuple(transplant(module, spec, built, layout, len(prompt), S, eos,
                                 spelled[i] if spelled else None)
                      for i, spec in enumerate(transplants))
    run = ProgramRun(
        program.label, S, len(prompt), len(layout.tokens), layout.segment_records(),
        kv.sha_ids(layout.tokens), tuple(live.generated.margins),
        {label: ProgramArm(kv.sha_cache(arm.state), tuple(arm.suffix.tokens), arm.wall_s,
                           arm.forward_calls) for label, arm in built.items()},
        tuple(against_live(live, arm, layout) for label, arm in built.items() if label != "live"),
        tuple(ProgramReplica(label, cache_exact(built[label], arm),
                             arm.suffix.tokens == built[label].suffix.tokens)
              for label, arm in again.items()),
        moved)
    return Measured(run, layout)


def run_program(model, stack, prompt_text: str, program: Program, S: int, arms: tuple[str, ...],
                ignore_eos: bool = False, replicas: tuple[str, ...] = (), transplants: tuple = (),
                spelled: tuple[str, ...] = ()) -> ProgramRun:
    """One stage program on one stack, its typed run (`measure`, without the layout)."""
    return measure(model, stack, prompt_text, program, S, arms, ignore_eos, replicas,
                   transplants, spelled).run
