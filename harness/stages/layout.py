"""A stage program's layout (kvfid.stages.program): the packed sequence as it grows, each
token's segment (0 the prompt, 1..N the branches, N+1 the merge) and position id, and which
segments each sees. It is what the protocol's arms and greedy loop feed through: a chunk of a
construction (`chunk`), a greedy step inside a stage (`stage_feed`), a suffix step in the merge
(`suffix_feed`), each at its positions under its rows of the visibility mask."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvfid.protocol.decode import Cached, Feeder, Runner
from kvfid.records.program import Segment
from kvfid.kernels.attention.reference import segment_mask


@dataclass
class Layout:
    """The packed sequence as it grows: tokens, each position's segment and position id."""

    sees: torch.Tensor  # [S, S] bool: segment 0 the prompt, 1..N branches, N+1 the merge
    positions_mode: str
    tokens: list[int]
    segments: list[int]
    positions: list[int]

    @classmethod
    def start(cls, program) -> "Layout":
        """The empty layout of `program` (kvfid.stages.program.Program)."""
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
        seg = torch.tensor(self.segments[:end])[None]
        visible = segment_mask(seg, self.sees, q_len=end - start)  # [1, q, end]
        return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[:, None]

    def forward(self, runner: Runner, at: Cached, start: int, end: int
                ) -> tuple[torch.Tensor, Cached]:
        """Feed tokens start..end-1 after `at` (which holds 0..start-1) under their rows of the
        mask at their position ids; last logits [1, V] and the cache after them."""
        dtype = next(runner.module.parameters()).dtype
        return runner.forward(torch.tensor([self.tokens[start:end]]), at,
                              attention_mask=self.mask(start, end, dtype),
                              position_ids=torch.tensor([self.positions[start:end]]))

    def chunk(self, runner: Runner):
        """A construction's chunk feed (kvfid.protocol.decode.feed_chunks) over this layout."""
        return functools.partial(self.forward, runner)

    def stage_feed(self, runner: Runner, at: Cached, segment: int) -> Feeder:
        """The greedy loop's feed inside stage `segment`: the token appended to the stage (the
        layout grows) and fed at its position under its visibility; its logits [V]."""
        def step(at: Cached, token: int) -> tuple[torch.Tensor, Cached]:
            self.extend([token], segment)
            logits, at = self.forward(runner, at, len(self.tokens) - 1, len(self.tokens))
            return logits[0], at

        return Feeder(at, step)

    def suffix_feed(self, runner: Runner, at: Cached) -> Feeder:
        """A suffix's feed (kvfid.protocol.decode.Feeding): in the merge of a copy of this layout,
        which stays the boundary's."""
        grown = Layout(self.sees, self.positions_mode, list(self.tokens), list(self.segments),
                       list(self.positions))
        return grown.stage_feed(runner, at, len(self.sees) - 1)

    def segment_records(self) -> tuple[Segment, ...]:
        """Each stage's tokens, position ids and the stages it sees, as the record keeps them."""
        return tuple(Segment(
            self.first_segment(self.segments.index(s)), self.segments.index(s),
            self.segments.count(s),
            (min(p for p, x in zip(self.positions, self.segments) if x == s),
             max(p for p, x in zip(self.positions, self.segments) if x == s)),
            tuple(self.first_segment(self.segments.index(t)) for t in range(len(self.sees))
                  if self.sees[s, t]))
            for s in range(len(self.sees)))

    def first_segment(self, position: int | None) -> str | None:
        """The name of the segment holding `position` (prompt, branch i, merge)."""
        if position is None:
            return None
        seg = self.segments[position]
        return "prompt" if seg == 0 else "merge" if seg == len(self.sees) - 1 else f"branch {seg}"
