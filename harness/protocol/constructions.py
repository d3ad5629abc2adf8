"""Constructions: the one `Construction` type, what `--constructions`, case files, transplant
specs and the Python API may say, and the one parser of their labels.

A `Construction` is parsed once at the edge (`parse_construction`; a comma list:
`parse_constructions`) from the vocabulary's spellings (`prefill`, `chunked:16`, `batched:2`,
`cobatched:4`, `cobatched:4+decode`, `cached:K`, `spec:k`, `spec:tree:WxD`; any of them but live
`@tpN`, built at another tensor-parallel size than the stack's), or raises `ProtocolError` naming
what is allowed, before any compute. Each kind is a subclass: it knows its label (`label`), how
it is built over P (`build`: the forward calls that feed P into a fresh cache) and how a trainer
re-scores by it (`rescore`), what it needs (`rows`, `regenerates` P itself, `needs_neighbours`,
`cuts_cache`, `needs_plain_layers`) and why it may be refused (`reason`, `check_fits`). The
protocol, the checks, prefix reuse and re-scoring ask it, never its string.

Adding a construction is defining a subclass with its `read` (the parser asks every subclass of
`Construction`, the built-in ones first); nothing else changes (tests/protocol/test_stand_in.py
adds one and runs it in `repro`, in a case and through the API).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from kvfid.stacks.serving import describe_layers
from kvfid.states import surgery
from kvfid.protocol import draft_tree, prefix_reuse
from kvfid.protocol.prefix_reuse import RollbackError
from kvfid.protocol.decode import Cached, Runner, as_batch, feed_chunks, new_cache
from kvfid.protocol.draft_tree import parse_tree
from kvfid.errors import BadInput
from kvfid.checks import MAX_BATCH
from kvfid.names import CONSTRUCTION_HELP

# The acceptance patterns of `spec:k` (prefix_reuse.py says what each means).
SPEC_PATTERNS = ("all", "none", "ngram")
_SERVING_HELP = ("cached:K takes K >= 1 tokens, a fraction in (0, 1) or `prompt`; spec:k takes "
                 "k >= 1 draft tokens and an optional pattern +all, +none, +ngram or +rateR with "
                 "R in (0, 1); spec:tree:WxD or spec:tree:P1,P2,.. (each node's parent) an "
                 "optional +rateR")


class ProtocolError(BadInput, ValueError):
    """Bad protocol input, raised before any compute."""


@dataclass(frozen=True, kw_only=True)
class Construction:
    """How a boundary state over P is built (docs/glossary.md, 'construction'). A subclass per
    kind; its class attributes say what it needs."""

    at: str | None = None          # a stack option the arm is built under (`tp1`), or None

    kind: ClassVar[str] = ""
    regenerates: ClassVar[bool] = False        # builds its own P (live): not built over a given P
    needs_neighbours: ClassVar[bool] = False   # built in a batch with other items of the item set
    cuts_cache: ClassVar[bool] = False         # cuts the cache back (a model's recurrent state cannot)
    needs_plain_layers: ClassVar[bool] = False  # its mask must reach every layer as it is
    rebuilds_stages: ClassVar[bool] = False    # a stage program's boundary can be rebuilt by it
    rescores: ClassVar[bool] = False           # a trainer or an engine re-scores by it (replay)

    @classmethod
    def read(cls, text: str) -> "Construction | None":
        """This kind from its spelling (no `@tpN`); None when `text` is not its spelling,
        ProtocolError when it is but says something wrong."""
        return cls() if cls.kind and text == cls.kind else None

    @property
    def base_label(self) -> str:
        return self.kind

    @property
    def label(self) -> str:
        return self.base_label + (f"@{self.at}" if self.at else "")

    @property
    def rows(self) -> int:
        """Rows of the batch it is built in (the item's duplicates)."""
        return 1

    def reason(self) -> str | None:
        """Why it cannot be run here (e.g. a batch too large to hold), or None."""
        return None

    def check_fits(self, prompt_length: int, prefix_length: int) -> None:
        """Refuse (ProtocolError) before any compute a P it cannot be built over."""

    def chunk_sizes(self, prompt_length: int, prefix_length: int) -> list[int]:
        """The forward-call sizes that feed P."""
        raise ProtocolError(f"{self.label} has no chunk sizes")

    def build(self, runner: Runner, at: Cached, prompt_length: int, prefix: list[int],
              vocab_size: int, layout=None) -> tuple[torch.Tensor, tuple[int, ...] | None, Cached]:
        """Feed P into the empty cache `at`: the boundary logits [rows, V], the acceptance pattern
        (speculative kinds; else None) and the cache covering P. `layout`: a stage program's
        (kvfid.stages.layout.Layout), whose `chunk` feeds each chunk under its visibility."""
        chunk = layout.chunk(runner) if layout is not None else None
        logits, at = feed_chunks(runner, at, prefix, self.chunk_sizes(prompt_length, len(prefix)),
                                 self.rows, chunk)
        return logits, None, at

    def rescore(self, runner: Runner, ids: list[int], prompt_length: int, first: int, count: int,
                vocab_size: int, cached: int | None = None
                ) -> tuple[torch.Tensor, tuple[int, ...] | None]:
        """The next-token logits of positions `first` .. `first + count - 1` of `ids`
        [count, V] as a trainer or an engine computes them (`cached`: a prefix-cache hit's K),
        and the acceptance pattern of a speculative kind (else None)."""
        raise ProtocolError(f"{self.label} is not a re-scoring construction")

    def trajectory_length(self, prompt_length: int, length: int) -> int | None:
        """A prefix-cache hit's K over a supplied trajectory of `length` tokens; None for kinds
        that take none."""
        return None


@dataclass(frozen=True, kw_only=True)
class Live(Construction):
    """Prefill the prompt, then greedy-decode B tokens one step at a time: the generator's state."""

    kind: ClassVar[str] = "live"
    regenerates: ClassVar[bool] = True


@dataclass(frozen=True, kw_only=True)
class Prefill(Construction):
    """A fresh cache, one forward call over all of P."""

    kind: ClassVar[str] = "prefill"
    rebuilds_stages: ClassVar[bool] = True
    rescores: ClassVar[bool] = True

    def chunk_sizes(self, prompt_length: int, prefix_length: int) -> list[int]:
        return [prefix_length]

    def rescore(self, runner, ids, prompt_length, first, count, vocab_size, cached=None):
        logits, _ = runner.forward_all(as_batch(ids, self.rows), None)
        return logits[0][first:first + count], None


@dataclass(frozen=True, kw_only=True)
class Incremental(Construction):
    """The prompt in one call, then P's later tokens teacher-forced one at a time."""

    kind: ClassVar[str] = "incremental"
    rebuilds_stages: ClassVar[bool] = True

    def chunk_sizes(self, prompt_length: int, prefix_length: int) -> list[int]:
        return [prompt_length] + [1] * (prefix_length - prompt_length)


@dataclass(frozen=True, kw_only=True)
class IncrementalOne(Construction):
    """Every token of P one at a time."""

    kind: ClassVar[str] = "incremental-1"

    def chunk_sizes(self, prompt_length: int, prefix_length: int) -> list[int]:
        return [1] * prefix_length


class _Counted:
    """A construction spelled `KIND:N` with N >= 1 (its field `n`)."""

    @classmethod
    def read(cls, text: str) -> "Construction | None":
        match = re.fullmatch(rf"{cls.kind}:(\d+)", text)
        return cls(n=int(match[1])) if match and int(match[1]) >= 1 else None

    @property
    def base_label(self) -> str:
        return f"{self.kind}:{self.n}"


@dataclass(frozen=True, kw_only=True)
class Chunked(_Counted, Construction):
    """P fed in chunks of `n` tokens."""

    n: int
    kind: ClassVar[str] = "chunked"
    rebuilds_stages: ClassVar[bool] = True
    rescores: ClassVar[bool] = True

    def chunk_sizes(self, prompt_length: int, prefix_length: int) -> list[int]:
        full, rest = divmod(prefix_length, self.n)
        return [self.n] * full + ([rest] if rest else [])

    def rescore(self, runner, ids, prompt_length, first, count, vocab_size, cached=None):
        at, parts, start = new_cache(runner.module), [], 0
        for size in self.chunk_sizes(prompt_length, len(ids)):
            logits, at = runner.forward_all(as_batch(ids[start:start + size]), at)
            parts.append(logits[0])
            start += size
        return torch.cat(parts)[first:first + count], None


@dataclass(frozen=True, kw_only=True)
class Batched(_Counted, Prefill):
    """The prefill with the item in a batch of `n` identical rows."""

    n: int
    kind: ClassVar[str] = "batched"
    rebuilds_stages: ClassVar[bool] = False

    @property
    def rows(self) -> int:
        return self.n

    def reason(self) -> str | None:
        return f"allowed: {self.kind}:N with N <= {MAX_BATCH}" if self.n > MAX_BATCH else None


@dataclass(frozen=True, kw_only=True)
class Cobatched(Construction):
    """P built in one left-padded batch with `n` - 1 other items (`+decode`: the suffix too)."""

    n: int
    decode_in_batch: bool = False
    kind: ClassVar[str] = "cobatched"
    needs_neighbours: ClassVar[bool] = True

    @classmethod
    def read(cls, text: str) -> "Construction | None":
        match = re.fullmatch(r"cobatched:(\d+)(\+decode)?", text)
        return cls(n=int(match[1]), decode_in_batch=match[2] is not None) \
            if match and int(match[1]) >= 2 else None

    @property
    def base_label(self) -> str:
        return f"{self.kind}:{self.n}" + ("+decode" if self.decode_in_batch else "")

    def reason(self) -> str | None:
        return f"allowed: {self.kind}:N with N <= {MAX_BATCH}" if self.n > MAX_BATCH else None


@dataclass(frozen=True, kw_only=True)
class Reused(Construction):
    """A construction that reuses a cache as a serving engine does, cutting it back
    (kvfid.protocol.prefix_reuse): not a kind itself."""

    n: int | None = None
    variant: str | None = None
    cuts_cache: ClassVar[bool] = True
    rescores: ClassVar[bool] = True

    def build(self, runner, at, prompt_length, prefix, vocab_size, layout=None):
        return prefix_reuse.feed(runner, at, self, prompt_length, prefix, vocab_size)

    def rescore(self, runner, ids, prompt_length, first, count, vocab_size, cached=None):
        # fed up to the last position asked for, as the reference feeds them
        rows, acceptance, _ = prefix_reuse.feed_rows(runner, new_cache(runner.module), self,
                                                     prompt_length, ids[:first + count],
                                                     vocab_size, first, cached_length=cached)
        return rows, acceptance

    def reuse(self, runner: Runner, at: Cached, prompt_length: int, prefix: list[int],
              vocab_size: int, first: int, cached: int | None
              ) -> tuple[torch.Tensor, tuple[int, ...] | None, Cached]:
        """Feed P into the empty cache `at` the engine's way: the next-token logits of positions
        `first`.. [|P| - first, V], the acceptance pattern, and the cache after it."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class CachedPrefix(Reused):
    """`cached:K`: a prefix-cache hit (kvfid.protocol.prefix_reuse): K tokens, a fraction of P
    (`variant` "0.5") or the prompt (`variant` "prompt")."""

    kind: ClassVar[str] = "cached"

    @classmethod
    def read(cls, text: str) -> "Construction | None":
        if not text.startswith("cached:"):
            return None
        match = re.fullmatch(r"cached:(?:(\d+)|(0?\.\d+)|(prompt))", text)
        if match and match[1] is not None and int(match[1]) >= 1:
            return cls(n=int(match[1]))
        if match and match[2] is not None and 0 < float(match[2]) < 1:
            return cls(variant=match[2])
        if match and match[3]:
            return cls(variant="prompt")
        raise ProtocolError(f"bad arm {text!r}: {_SERVING_HELP}")

    @property
    def base_label(self) -> str:
        return f"cached:{self.n if self.variant is None else self.variant}"

    def check_fits(self, prompt_length: int, prefix_length: int) -> None:
        self.cached_length(prompt_length, prefix_length)   # something must be left to extend

    def cached_length(self, prompt_length: int, prefix_length: int) -> int:
        """`cached:K`: how many leading tokens of P the earlier request left in the cache;
        ProtocolError unless 1 <= K < |P| (something must be extended on top)."""
        if self.variant == "prompt":
            k = prompt_length
        elif self.variant is not None:
            k = int(float(self.variant) * prefix_length)
        else:
            k = self.n
        if not 1 <= k < prefix_length:
            raise ProtocolError(f"{self.label}: K={k} must be at least 1 and below the boundary "
                                f"prefix's {prefix_length} tokens (prompt {prompt_length} + B)")
        return k

    def trajectory_length(self, prompt_length: int, length: int) -> int:
        """K over a supplied trajectory of `length` tokens: the prompt's last position for
        `prompt` (its logits predict the first continuation token), a fraction of the whole."""
        if self.variant == "prompt":
            return prompt_length - 1
        if self.variant is not None:
            return int(float(self.variant) * length)
        return self.n

    def reuse(self, runner, at, prompt_length, prefix, vocab_size, first, cached):
        k = self.cached_length(prompt_length, len(prefix)) if cached is None else cached
        assert k <= first, f"{self.label}: no logits before position K={k}"
        rows, at = prefix_reuse.prefix_hit(runner, at, k, prefix, vocab_size, len(prefix) - first)
        return rows, None, at


@dataclass(frozen=True, kw_only=True)
class Spec(Reused):
    """`spec:k[+pattern]`: speculative verification of `n` drafts plus one per forward, the
    drafts by the pattern in `variant`."""

    kind: ClassVar[str] = "spec"

    @classmethod
    def read(cls, text: str) -> "Construction | None":
        if not text.startswith("spec:") or text.startswith("spec:tree:"):
            return None
        match = re.fullmatch(r"spec:(\d+)(?:\+(all|none|ngram|rate(0?\.\d+)))?", text)
        if match and int(match[1]) >= 1 and (match[3] is None or 0 < float(match[3]) < 1):
            return cls(n=int(match[1]), variant=match[2] or "all")
        raise ProtocolError(f"bad arm {text!r}: {_SERVING_HELP}")

    @property
    def base_label(self) -> str:
        return f"spec:{self.n}" + ("" if self.variant == "all" else f"+{self.variant}")

    def verify(self, runner, at, prompt_length, prefix, vocab_size):
        """The prompt, then the verification steps (prefix_reuse.speculate)."""
        return prefix_reuse.speculate(runner, at, self, prompt_length, prefix, vocab_size)

    def reuse(self, runner, at, prompt_length, prefix, vocab_size, first, cached):
        assert prompt_length - 1 <= first, f"{self.label}: no logits inside the prompt"
        rows, acceptance, at = self.verify(runner, at, prompt_length, prefix, vocab_size)
        return rows[first - (prompt_length - 1):], acceptance, at


@dataclass(frozen=True, kw_only=True)
class SpecTree(Spec):
    """`spec:tree:WxD` / `spec:tree:P1,P2,..`: a draft tree verified under its ancestor mask
    (kvfid.protocol.draft_tree); `variant` as spelled, `tree` each node's parent (0: the root)."""

    tree: tuple[int, ...] = ()
    kind: ClassVar[str] = "spec-tree"
    needs_plain_layers: ClassVar[bool] = True

    @classmethod
    def read(cls, text: str) -> "Construction | None":
        try:
            tree = parse_tree(text)
        except ValueError as err:
            raise ProtocolError(str(err)) from None
        if tree is None and text.startswith("spec:tree:"):
            raise ProtocolError(f"bad arm {text!r}: {_SERVING_HELP}")
        if tree is None:
            return None
        return cls(variant=text.removeprefix("spec:tree:"), tree=tree[0])

    @property
    def base_label(self) -> str:
        return f"spec:tree:{self.variant}"

    def verify(self, runner, at, prompt_length, prefix, vocab_size):
        return draft_tree.verify(runner, at, self, prompt_length, prefix, vocab_size)


def kinds() -> list[type[Construction]]:
    """Every kind of construction: the subclasses of `Construction`, in the order they were
    defined (the built-in ones first), a kind before the kinds it is the base of."""
    out, stack = [], list(Construction.__subclasses__())
    while stack:
        kind = stack.pop(0)
        out.append(kind)
        stack[:0] = kind.__subclasses__()
    return out


def parse_construction(text: "str | Construction") -> Construction:
    """`prefill`, `chunked:16`, `batched:2`, `cobatched:4+decode`, ... -> Construction (one
    given already: itself); ProtocolError otherwise."""
    if isinstance(text, Construction):
        return text
    text, sep, at = text.strip().partition("@")
    if sep:
        built = _read(text)
        if not re.fullmatch(r"tp[1-9]\d*", at) or built is None or built.regenerates:
            raise ProtocolError(f"bad arm {text}@{at}: an arm other than live takes @tpN (built "
                                f"at TP size N), e.g. prefill@tp1")
        return replace(built, at=at)
    built = _read(text)
    if built is None:
        raise ProtocolError(f"unknown arm {text!r}; valid: {CONSTRUCTION_HELP}")
    return built


def _read(text: str) -> Construction | None:
    """The first kind whose spelling `text` is; None when none's."""
    for kind in kinds():
        found = kind.read(text)
        if found is not None:
            return found
    return None


def parse_constructions(text: str) -> tuple[Construction, ...]:
    """A comma-separated list of constructions (the command line's); a piece that is no
    construction by itself continues the one before it where together they are one (a tree
    spelled by its parents keeps its commas: `spec:tree:0,0,1,1`)."""
    out: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if out and not _claimed(piece) and _claimed(f"{out[-1]},{piece}"):
            out[-1] += f",{piece}"
        elif piece:
            out.append(piece)
    return tuple(parse_construction(label) for label in out)


def check_rollback(model, arms) -> None:
    """Refuse, before any compute, a prefix-cache hit or a speculative arm on a model with a
    recurrent layer state, which a cut cannot put back (RollbackError, exit 3). `arms`:
    Constructions or their labels."""
    arms = [parse_construction(a) for a in arms]
    serving_arms = [a.label for a in arms if a.cuts_cache]
    if not serving_arms:
        return
    _check_tree(describe_layers(model), [a.label for a in arms if a.needs_plain_layers])
    recurrent = [info for info in describe_layers(model) if "recurrent" in info.mechanisms]
    if recurrent:
        raise RollbackError(f"{', '.join(serving_arms)}: a prefix-cache hit or a speculative "
                            f"rollback cuts the cache back, which layer {recurrent[0].index} "
                            f"({recurrent[0].layer_type}, a recurrent state) cannot take")


def _check_tree(layers, trees: list[str]) -> None:
    """A tree arm needs layers that attend through the mask alone (the ancestor mask reaches
    every layer as it is) and plain keys and values (to gather the accepted path): exit 3."""
    for info in layers if trees else ():
        other = set(info.mechanisms) & {"sliding_window", "chunked_attention", "recurrent"}
        if other or info.kind != "full":
            what = sorted(other)[0] if other else f"a {info.kind} state"
            raise RollbackError(f"{trees[0]}: layer {info.index} is {what}; tree verification "
                                f"serves models whose layers attend through the mask only")


def split_arms(text: str) -> tuple[str, ...]:
    """A comma-separated list of constructions, as their labels."""
    return tuple(c.label for c in parse_constructions(text))


def construction_reason(construction: "str | Construction") -> str | None:
    """Why a construction cannot be run here (e.g. a batch too large to hold), or None."""
    return parse_construction(construction).reason()


def _claimed(text: str) -> bool:
    """Whether some kind takes `text` (no `@tpN`) for its spelling, right or wrong."""
    try:
        return _read(text.partition("@")[0]) is not None
    except ProtocolError:
        return True


def _read_quietly(text: str) -> Construction | None:
    try:
        return parse_construction(text)
    except ProtocolError:
        return None


@dataclass(frozen=True)
class TransplantSpec:
    """`recipient<-donor:selection`."""

    recipient: str
    donor: str
    selection: surgery.Selection

    @property
    def label(self) -> str:
        return f"{self.recipient}<-{self.donor}:{self.selection.label}"


def parse_transplant(text: str) -> TransplantSpec:
    """`live<-prefill`, `prefill<-live:keys`, `live<-chunked:16:layers=0-4+values`,
    `live<-cobatched:4+decode:values`: the longest donor that is a construction, then its
    selection."""
    recipient, arrow, rest = text.strip().partition("<-")
    pieces = rest.strip().split(":")
    for cut in range(len(pieces), 0, -1) if arrow and recipient.strip() else ():
        donor, selection = ":".join(pieces[:cut]), ":".join(pieces[cut:])
        if _read_quietly(donor) is None or not re.fullmatch(r"[\w=+-]*", selection):
            continue
        recipient, donor = parse_construction(recipient).label, parse_construction(donor).label
        try:
            return TransplantSpec(recipient, donor, surgery.parse_selection(selection or "all"))
        except ValueError as err:
            raise ProtocolError(str(err)) from None
    if arrow and recipient.strip() and pieces[0].strip():   # the construction's own refusal
        parse_construction(recipient), parse_construction(pieces[0])
    raise ProtocolError(f"bad transplant {text!r}; expected RECIPIENT<-DONOR[:SELECTION], "
                        f"selection: {surgery.SELECTION_HELP}")
