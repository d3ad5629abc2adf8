"""Construction and transplant names: what `--constructions`, case files and transplant specs
may say.

`parse_construction` and `parse_transplant` turn the vocabulary's spellings (`prefill`,
`chunked:16`, `batched:2`, `cobatched:4`, `cobatched:4+decode`, `live<-prefill:keys`; any of them
`@tpN`, built at another tensor-parallel size than the stack's) into frozen
specs, or raise `ProtocolError` naming what is allowed, before any compute. The protocol module
runs them; this one only names them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from kvfid.states import surgery
from kvfid.protocol.draft_tree import parse_tree
from kvfid.errors import BadInput
from kvfid.names import CONSTRUCTION_HELP
_NUMBERED = (r"(?:chunked|batched):\d+|cobatched:\d+(?:\+decode)?"
             r"|cached:(?:\d+|0?\.\d+|prompt)|spec:\d+(?:\+(?:all|none|ngram|rate0?\.\d+))?"
             r"|spec:tree:(?:\d+x\d+|\d+(?:,\d+)*)(?:\+rate0?\.\d+)?")
# The acceptance patterns of `spec:k` (prefix_reuse.py says what each means).
SPEC_PATTERNS = ("all", "none", "ngram")


class ProtocolError(BadInput, ValueError):
    """Bad protocol input, raised before any compute."""


@dataclass(frozen=True)
class Construction:
    """How a boundary state over P is built (docs/glossary.md, 'construction')."""

    kind: str
    n: int | None = None
    decode_in_batch: bool = False  # cobatched only: the suffix is decoded in the co-batch too
    variant: str | None = None     # cached: "prompt" or a fraction ("0.5"); spec: the pattern;
                                   # spec-tree: the tree as spelled (`2x3`, `0,0,1,1+rate0.5`)
    tree: tuple[int, ...] | None = None   # spec-tree: each draft node's parent (0: the root)
    at: str | None = None          # a stack option the arm is built under (`tp1`), or None

    @property
    def label(self) -> str:
        return self.base_label + (f"@{self.at}" if self.at else "")

    @property
    def base_label(self) -> str:
        if self.kind == "cached":
            return f"cached:{self.n if self.variant is None else self.variant}"
        if self.kind == "spec-tree":
            return f"spec:tree:{self.variant}"
        if self.kind == "spec":
            return f"spec:{self.n}" + ("" if self.variant == "all" else f"+{self.variant}")
        if self.n is None:
            return self.kind
        return f"{self.kind}:{self.n}" + ("+decode" if self.decode_in_batch else "")

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

    def chunk_sizes(self, prompt_length: int, prefix_length: int) -> list[int]:
        """The forward-call sizes that feed P (not used by `live`)."""
        if self.kind in ("prefill", "batched"):
            return [prefix_length]
        if self.kind == "incremental":
            return [prompt_length] + [1] * (prefix_length - prompt_length)
        if self.kind == "incremental-1":
            return [1] * prefix_length
        if self.kind == "chunked":
            full, rest = divmod(prefix_length, self.n)
            return [self.n] * full + ([rest] if rest else [])
        raise ProtocolError(f"{self.label} has no chunk sizes")


def parse_construction(text: str) -> Construction:
    """`prefill`, `chunked:16`, `batched:2`, `cobatched:4+decode`, ... -> Construction;
    ProtocolError otherwise."""
    text, sep, at = text.strip().partition("@")
    if sep:
        if not re.fullmatch(r"tp[1-9]\d*", at) or text == "live":
            raise ProtocolError(f"bad arm {text}@{at}: an arm other than live takes @tpN (built "
                                f"at TP size N), e.g. prefill@tp1")
        return replace(parse_construction(text), at=at)
    if text in ("live", "prefill", "incremental", "incremental-1"):
        return Construction(text)
    if text.startswith(("cached:", "spec:")):
        return _parse_serving(text)
    match = re.fullmatch(r"(chunked|batched|cobatched):(\d+)(\+decode)?", text)
    if match and int(match[2]) >= (2 if match[1] == "cobatched" else 1) and (
            match[3] is None or match[1] == "cobatched"):
        return Construction(match[1], int(match[2]), match[3] is not None)
    raise ProtocolError(f"unknown arm {text!r}; valid: {CONSTRUCTION_HELP}")


def _parse_serving(text: str) -> Construction:
    """`cached:K` (K tokens, a fraction of P in (0, 1), or `prompt`) and `spec:k[+pattern]`."""
    match = re.fullmatch(r"cached:(?:(\d+)|(0?\.\d+)|(prompt))", text)
    if match:
        if match[1] is not None and int(match[1]) >= 1:
            return Construction("cached", int(match[1]))
        if match[2] is not None and 0 < float(match[2]) < 1:
            return Construction("cached", variant=match[2])
        if match[3]:
            return Construction("cached", variant="prompt")
    try:
        tree = parse_tree(text)
    except ValueError as err:
        raise ProtocolError(str(err)) from None
    if tree is not None:
        return Construction("spec-tree", variant=text.removeprefix("spec:tree:"), tree=tree[0])
    match = re.fullmatch(r"spec:(\d+)(?:\+(all|none|ngram|rate(0?\.\d+)))?", text)
    if match and int(match[1]) >= 1 and (match[3] is None or 0 < float(match[3]) < 1):
        return Construction("spec", int(match[1]), variant=match[2] or "all")
    raise ProtocolError(f"bad arm {text!r}: cached:K takes K >= 1 tokens, a fraction in (0, 1) "
                        f"or `prompt`; spec:k takes k >= 1 draft tokens and an optional pattern "
                        f"+all, +none, +ngram or +rateR with R in (0, 1); spec:tree:WxD or "
                        f"spec:tree:P1,P2,.. (each node's parent) an optional +rateR")


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
    `live<-cobatched:4+decode:values`."""
    recipient, arrow, rest = text.strip().partition("<-")
    match = re.fullmatch(rf"((?:{_NUMBERED}|[\w-]+)(?:@tp\d+)?)(?::([\w=+-]+))?", rest.strip())
    if not arrow or not match or not recipient.strip():
        raise ProtocolError(f"bad transplant {text!r}; expected RECIPIENT<-DONOR[:SELECTION], "
                            f"selection: {surgery.SELECTION_HELP}")
    recipient, donor = parse_construction(recipient).label, parse_construction(match[1]).label
    try:
        selection = surgery.parse_selection(match[2] or "all")
    except ValueError as err:
        raise ProtocolError(str(err)) from None
    return TransplantSpec(recipient, donor, selection)
