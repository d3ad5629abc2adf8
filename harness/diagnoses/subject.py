"""What a diagnosis runs on, checked before any compute: the one set-up of `repro`, `repro
--program`, `replay` and `blame`.

`command_stack` turns a command's stack options into one `Stack`: `--stack`'s label
(`native/bf16+bi@t1`, as reports print it; kvfid.stacks.stack.parse_stack) or the separate
options (`--backend`, `--dtype`, ...), never two stacks that disagree. `check_subject` checks the
model name and the stack, picks the item, loads the model and tokenizes the prompt: a `Subject`.
`Subject.check_serves` refuses, still before compute, a model the stack cannot serve over the
length the diagnosis needs. Bad input is `BadInput` (exit 2: the option, the value, what is
allowed); what this machine cannot do is `Unavailable` (exit 3).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvfid import checks
from kvfid.errors import BadInput
from kvfid.inputs.items import Item
from kvfid.inputs.models import Model, load_model
from kvfid.names import MODEL_NAMES, PRESET_NAMES
from kvfid.stacks.stack import Stack, check_supports, parse_stack
from kvfid.inputs import items
from kvfid.protocol.constructions import parse_construction

# The separate options that name a part of a stack's label, by the Stack field each sets.
STACK_PARTS = {"backend": "--backend", "dtype": "--dtype", "batch_invariant": "--batch-invariant",
               "faithful_recurrence": "--faithful-recurrence/--chunked-scan",
               "compiled": "--compile", "threads": "--threads", "tp": "--tp"}


def command_stack(label: str | None = None, device: str = "cpu", **given) -> Stack:
    """The stack a command names: `label` (`--stack`, with `device`, which no label names), or
    the separate options `given` (the STACK_PARTS fields; each left out takes the Stack's
    default). Both: each given option must say what the label says (exit 2 otherwise, naming
    both), so one command never carries two stacks."""
    unknown = set(given) - set(STACK_PARTS)
    if unknown:
        raise TypeError(f"command_stack: unknown stack options {sorted(unknown)}")
    if label is None:   # checked before the Stack's own checks, which name no option
        checks.device_and_threads(device, given.get("threads"))
        checks.require(checks.tp_reason(given.get("tp", 1)), "--tp", given.get("tp", 1))
        try:
            return Stack(device=device, **given)
        except ValueError as err:
            raise BadInput(str(err)) from None
    try:
        stack = parse_stack(label, device)
    except ValueError as err:
        raise BadInput(f"--stack {label}: {err}") from None
    for field, value in given.items():
        said = getattr(stack, field)
        if value != said:
            shown = value if not isinstance(value, bool) else ("on" if value else "off")
            raise BadInput(f"--stack {label} and {STACK_PARTS[field]} {shown} disagree (the "
                           f"label's {field}: {said}); give the stack once: --stack, or the "
                           f"separate options")
    return checked_stack(stack)


def checked_stack(stack: Stack) -> Stack:
    """`stack`, its device, thread count and TP size checked (exit 2 naming what is allowed; a
    CUDA device this machine lacks: exit 3)."""
    checks.device_and_threads(stack.device, stack.threads)
    checks.require(checks.tp_reason(stack.tp), "--tp", stack.tp)
    return stack


def check_model_name(model_name: str) -> None:
    """Refuse a model that is neither a preset nor hf:<folder> (exit 2), before any loading."""
    if model_name not in PRESET_NAMES and not (model_name.startswith("hf:") and len(model_name) > 3):
        raise BadInput(f"--model: unknown model {model_name!r}; valid: {', '.join(MODEL_NAMES)}")


def plan_world(stack: Stack, constructions, option: str) -> int:
    """How many ranks an item needs: the largest TP size of the stack and its constructions
    (`@tpN`); one item runs TP size 1 and one other size only (exit 2 otherwise)."""
    sizes = {stack.tp} | {int(c.at[2:]) for c in map(parse_construction, constructions) if c.at}
    world = max(sizes)
    if not sizes <= {1, world}:
        raise BadInput(f"{option}: TP sizes {sorted(sizes)} in one item; it runs at TP size 1 "
                       f"and one other size N (the stack's, or its constructions' @tpN)")
    return world


def pick_item(prompt: str | None, item_set: str | None, item_index: int | None) -> Item:
    """The item of `--prompt`, or of `--item-set` and `--item`."""
    if (prompt is None) == (item_set is None):
        raise BadInput("give exactly one of --prompt or --item-set/--item")
    if prompt is not None:
        checks.require(checks.prompt_reason(prompt), "--prompt", prompt)
        return items.Item(id="prompt", prompt=prompt, answer=None)
    if item_index is None or not 0 <= item_index < checks.MAX_ITEMS:
        raise BadInput(f"--item = {item_index!r} is not allowed; --item-set needs --item N with "
                       f"0 <= N < {checks.MAX_ITEMS}")
    try:
        chosen = items.load_item_set(item_set, item_index + 1 if not item_set.startswith("jsonl:") else None)
    except ValueError as err:
        raise BadInput(f"--item-set {item_set}: {err}") from None
    if item_index >= len(chosen):
        raise BadInput(f"--item = {item_index} is not allowed; {item_set} has {len(chosen)} "
                       f"items (0 to {len(chosen) - 1})")
    return chosen[item_index]


@dataclass(frozen=True)
class Subject:
    """A diagnosis's model, stack and item, checked: the model loaded, the prompt tokenized."""

    model: Model
    model_name: str          # what each rank loads at a TP size above 1
    stack: Stack
    item: Item | None        # None: a replay, whose trajectories carry their prompts
    prompt_ids: tuple[int, ...]
    world: int = 1           # ranks: the largest TP size of the stack and its constructions

    def check_serves(self, length: int, stacks: tuple[Stack, ...] = ()) -> None:
        """Refuse a model this stack (and each of `stacks`, e.g. a crossing's) cannot serve over
        `length` tokens, also at the TP size the item runs at (exit 3, one line)."""
        for each in (self.stack, *stacks):
            check_supports(each, self.model, length)
            if self.world > each.tp:   # a construction at the larger size
                check_supports(replace(each, tp=self.world), self.model, length)


def check_subject(model: str | Model, stack: Stack, prompt: str | None = None,
                  item_set: str | None = None, item_index: int | None = None, *,
                  with_item: bool = True, world: int = 1) -> Subject:
    """Check the model name and the stack, pick the item (unless `with_item` is False), load
    the model and tokenize the prompt. `model`: a preset, `hf:<folder>`, or a Model already
    loaded (the Python API's; at TP size 1 only: each rank loads the model by its name)."""
    loaded = None if isinstance(model, str) else model
    name = model.name if loaded is not None else model
    if loaded is None:
        check_model_name(name)
    checked_stack(stack)
    if loaded is not None and world > 1:
        raise BadInput("a model loaded in memory is measured at TP size 1; give a preset or "
                       "hf:<folder> for TP sizes above 1 (each rank loads it by that name)")
    item = pick_item(prompt, item_set, item_index) if with_item else None
    model = loaded or load_model(name)
    prompt_ids = tuple(model.codec.prompt_ids(item.prompt)) if item is not None else ()
    return Subject(model, name, stack, item, prompt_ids, world)
