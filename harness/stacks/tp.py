"""Tensor parallelism as part of a stack: transformers' own model sharded Megatron-style over N ranks.

Within `parallel(module, invariant)` the model's projections are replaced in place by
`ParallelLinear`s (transformers' forward is kept): column-parallel q/k/v and gate/up (each rank
computes its heads' and its MLP columns' outputs), row-parallel o/down (each rank multiplies its
slice of the reduction axis; an all-reduce adds the partial sums), and the LM head
vocabulary-parallel (each rank its rows of the vocabulary, zero-padded to equal shards, then
gathered), as serving engines shard them. The embeddings, norms and rotary tables are
replicated. A rank's cache then holds its own K/V heads; kvfid.states.heads reads every state
whole (each rank's heads gathered) and puts back only this rank's.

Which size runs is switchable (`size(module, n)`, n = 1 or the world's size), so one item can
build an arm at another TP size than live (`prefill@tp1` against `live@tp2`): at size 1 every
rank computes the whole layer itself.

Invariant (`+bi`): the products are kvfid.kernels.invariant.parallel's, whose bits do not depend
on N (fixed segments of a row-parallel reduction axis, gathered and added in one fixed tree
instead of an all-reduce; fixed output pieces of a column-parallel one). A `+bi` stack computes
them at size 1 too, so TP=1 and TP=N agree.

The ranks are torch.distributed's default group: torchrun's, or those kvfid.stacks.ranks starts
on this machine.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
import torch.distributed as dist

from kvfid.errors import Unavailable
from kvfid.kernels.invariant import parallel
from kvfid.stacks.ranks import Ranks, backend_for, on_ranks, ranks, shared  # noqa: F401
from kvfid.states import heads
from kvfid.kernels.invariant.mode import batch_invariant_mode

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
ATTENTION, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")


class TPUnavailable(Unavailable):
    """A model or world this TP size cannot shard (exit 3, one line, before compute)."""


# --------------------------------------------------------------------------- what is sharded

def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: the module list as long as the config's layer count."""
    count = getattr(module.config.get_text_config(), "num_hidden_layers", None)
    for sub in module.modules():
        if isinstance(sub, torch.nn.ModuleList) and len(sub) == count:
            return list(sub)
    return []


def shardable(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str]] | str:
    """(parent, attribute, kind) of every projection TP shards, or why this model cannot be:
    every decoder layer needs `self_attn` with q/k/v/o and `mlp` with gate/up/down as
    nn.Linear, and the model an nn.Linear LM head."""
    layers = decoder_layers(module)
    if not layers:
        return "no decoder layer list as long as num_hidden_layers"
    found = []
    for index, layer in enumerate(layers):
        for owner, names in (("self_attn", ATTENTION), ("mlp", MLP)):
            parent = getattr(layer, owner, None)
            missing = [n for n in names if not isinstance(getattr(parent, n, None), torch.nn.Linear)]
            if missing:
                return (f"layer {index} has no {owner}.{missing[0]} linear (TP shards "
                        f"{owner} {'/'.join(names)})")
            found += [(parent, n, "row" if n in ROW else "column") for n in names]
    head = module.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return "its LM head is not an nn.Linear"
    return found + [(module, _attribute_of(module, head), "vocab")]


def _attribute_of(module: torch.nn.Module, child: torch.nn.Module) -> str:
    return next(name for name, sub in module.named_children() if sub is child)


def tp_reason(config, size: int, invariant: bool) -> str | None:
    """Why a model of `config` cannot run at TP `size` (heads, KV heads and MLP width must divide
    by it; invariant, its fixed segments too), or None."""
    text = config.get_text_config()
    heads_, kv = int(text.num_attention_heads), int(getattr(text, "num_key_value_heads", None)
                                                     or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads_)
    width = int(getattr(text, "intermediate_size", 0) or 0)
    for count, what in ((heads_, "attention heads"), (kv, "KV heads"), (width, "MLP width")):
        if count % size:
            return f"{count} {what} do not divide by {size}"
    if invariant:
        for axis, what in ((heads_ * head_dim, "the o_proj reduction axis"),
                           (width, "the down_proj reduction axis"),
                           (heads_ * head_dim, "q_proj's output"), (kv * head_dim, "k_proj's output")):
            reason = parallel.tp_reason(axis, size, what)
            if reason:
                return reason
    return None


# --------------------------------------------------------------------------- the sharded linear

@dataclass
class _Shard:
    """One rank's part of a linear layer at one TP size."""

    weight: torch.Tensor                  # the rank's rows (column, vocab) or columns (row)
    bias: torch.Tensor | None             # column: the rank's; row: the whole (added once)
    pieces: list[torch.Tensor] | None     # invariant: output pieces or reduction segments
    whole: bool = False                   # invariant column: one call gives the pieces' bits


class ParallelLinear(torch.nn.Module):
    """An nn.Linear sharded over the ranks: `column`, `row` or `vocab`, at `size` 1 or N."""

    recording = False   # blame's unit tracer: a stock row-parallel layer keeps its last partial sum

    def __init__(self, linear: torch.nn.Linear, kind: str, world: Ranks, invariant: bool):
        super().__init__()
        self.__dict__["linear"] = linear        # not a child: the module path stays the linear's
        self.kind, self.world, self.invariant = kind, world, invariant
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._shards: dict[tuple, _Shard] = {}
        self.resize(world.size)

    def extra_repr(self) -> str:
        return (f"{self.kind}-parallel, {self.in_features} -> {self.out_features}, size "
                f"{self.size} of {self.world.size}" + (", invariant" if self.invariant else ""))

    @property
    def rank(self) -> int:
        return self.world.rank if self.size > 1 else 0

    def _padded_rows(self) -> int:
        """The vocabulary padded to equal shards (and, invariant, to whole pieces)."""
        unit = parallel.SEGMENTS if self.invariant else self.size
        return -(-self.out_features // unit) * unit

    def resize(self, size: int) -> None:
        """Run at TP `size` from now on: this rank's part made once per size and weight version
        (before any forward, so a forward reads nothing but tensors: `+compile` traces it)."""
        weight, bias = self.linear.weight, self.linear.bias
        self.size = size
        if size == 1 and not self.invariant:
            self.current = None           # the unsharded layer
            return

        # What the pieces' probe depends on is part of the key: the threads and the mode.
        key = (size, weight._version, torch.get_num_threads(), batch_invariant_mode())
        if key not in self._shards:
            self._shards = {k: v for k, v in self._shards.items() if k[1] == weight._version}
            self._shards[key] = self._make(weight.detach(), None if bias is None else bias.detach())
        self.current = self._shards[key]

    def _make(self, weight: torch.Tensor, bias: torch.Tensor | None) -> _Shard:
        size, rank = self.size, self.rank
        if self.kind == "row":
            local = weight.chunk(size, 1)[rank].contiguous()
            count = parallel.segment_count(self.in_features) // size
            segments = parallel.cut(local, count, 1) if self.invariant else None
            return _Shard(local, bias, segments)
        if self.kind == "vocab":
            pad = self._padded_rows() - self.out_features
            weight = torch.cat([weight, weight.new_zeros(pad, weight.shape[1])]) if pad else weight
            bias = torch.cat([bias, bias.new_zeros(pad)]) if bias is not None and pad else bias
        rows = weight.shape[0]
        local = weight.chunk(size, 0)[rank].contiguous()
        local_bias = bias.chunk(size, 0)[rank].contiguous() if bias is not None else None
        count = parallel.segment_count(rows) // size
        pieces = parallel.cut(local, count, 0) if self.invariant else None
        whole = bool(pieces) and (len(pieces) == 1 or parallel.pieces_agree(
            pieces, local.dtype, local_bias is not None))
        return _Shard(torch.nn.Parameter(local, requires_grad=False), local_bias, pieces, whole)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shard = self.current
        if shard is None:
            return F.linear(x, self.linear.weight, self.linear.bias)   # the unsharded layer
        if self.kind == "row":
            if self.invariant:
                sums = parallel.segment_products(x, shard.pieces)       # [g, ..., N]
                if self.size > 1:
                    sums = gather(sums, 0)                             # [G, ..., N], rank order
                return parallel.row_reduce(sums, x.dtype, shard.bias)
            out = F.linear(x, shard.weight)                             # this rank's partial sum
            partial = out.clone() if ParallelLinear.recording else None
            _all_reduce(out)
            self.last_partial = (partial, out) if partial is not None else None
            return out if shard.bias is None else out + shard.bias
        if self.invariant:
            out = parallel.column_product(x, shard.pieces, shard.weight, shard.bias, shard.whole)
        else:
            out = F.linear(x, shard.weight, shard.bias)
        if self.kind == "vocab":
            if self.size > 1:
                out = gather(out, -1)
            out = out[..., :self.out_features]
        return out


def _all_reduce(t: torch.Tensor) -> None:
    dist.all_reduce(t)


def gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Every rank's `t`, concatenated along `dim` in rank order."""
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return torch.cat(parts, dim)


# --------------------------------------------------------------------------- the contexts

_wrapped: "weakref.WeakKeyDictionary[torch.nn.Linear, dict]" = weakref.WeakKeyDictionary()


def _wrapper(linear: torch.nn.Linear, kind: str, world: Ranks, invariant: bool) -> ParallelLinear:
    """The ParallelLinear of `linear` (kept while the linear lives: its shards are made once)."""
    kept = _wrapped.setdefault(linear, {})
    key = (kind, world, invariant)
    if key not in kept:
        kept[key] = ParallelLinear(linear, kind, world, invariant)
    return kept[key]


def is_sharded(module: torch.nn.Module) -> bool:
    return any(isinstance(sub, ParallelLinear) for sub in module.modules())


@contextlib.contextmanager
def parallel_model(module: torch.nn.Module, size: int, invariant: bool) -> Iterator[torch.nn.Module]:
    """The model sharded over this process's ranks and run at `size` within the block (its
    linears put back on exit). A model TP cannot shard is refused (TPUnavailable) when the world
    or `size` is above 1; at size 1 on one rank it runs unchanged."""
    world = ranks()
    if size not in (1, world.size):
        raise TPUnavailable(f"TP size {size} needs {size} ranks; this process has {world.size}")
    plan = shardable(module)
    if isinstance(plan, str):
        if world.size > 1:
            raise TPUnavailable(f"model {module.config.model_type} cannot be sharded: {plan}")
        yield module
        return
    if world.size > 1 or size > 1:
        reason = tp_reason(module.config, world.size, invariant)
        if reason:
            raise TPUnavailable(f"model {module.config.model_type} cannot run at TP={world.size}: "
                                f"{reason}")
    originals = [(parent, name, getattr(parent, name)) for parent, name, _ in plan]
    for parent, name, kind in plan:
        setattr(parent, name, _wrapper(getattr(parent, name), kind, world, invariant))
    try:
        with at_size(module, size):
            yield module
    finally:
        for parent, name, linear in originals:
            setattr(parent, name, linear)


@contextlib.contextmanager
def at_size(module: torch.nn.Module, size: int) -> Iterator[None]:
    """Within the block the sharded model runs at TP `size` (1: every rank computes whole
    layers; the world's size: sharded); its caches are read whole either way."""
    layers = [sub for sub in module.modules() if isinstance(sub, ParallelLinear)]
    world = ranks()
    if size not in (1, world.size):
        raise TPUnavailable(f"an arm at TP={size} needs {size} ranks; this run has {world.size}")
    if size > 1 and not layers:
        raise TPUnavailable("an arm at TP>1 needs a sharded model")
    before = [layer.size for layer in layers]
    for layer in layers:
        layer.resize(size)
    try:
        with (heads.sharded_heads(_gather_heads, _keep_heads) if size > 1 else heads.whole_heads()):
            yield
    finally:
        for layer, was in zip(layers, before):
            layer.resize(was)


def _gather_heads(t: torch.Tensor) -> torch.Tensor:
    return gather(t, 1)     # [B, H_kv / N, T, D] per rank -> [B, H_kv, T, D]


def _keep_heads(t: torch.Tensor) -> torch.Tensor:
    world = ranks()
    return t.chunk(world.size, 1)[world.rank].clone()
