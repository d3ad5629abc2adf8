"""harness/protocol/ keeps no state between calls: no module-level mutable value (a dict, a list, a
set, a weak map, a memo), no `global`; the positions a cache covers travel with it
(kvfid.protocol.decode.Cached) through every construction, cut and gather."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "harness" / "protocol"

# Calls whose result is immutable (or a type / pattern, which no call changes).
IMMUTABLE_CALLS = {"frozenset", "tuple", "re.compile", "Version", "TypeVar", "NewType"}
MEMOS = {"functools.cache", "functools.lru_cache", "cache", "lru_cache"}


def _name(node: ast.AST) -> str:
    return ast.unparse(node.func if isinstance(node, ast.Call) else node)


def _mutable(value: ast.AST) -> bool:
    """Whether a module-level value may be changed after import."""
    if isinstance(value, (ast.Constant, ast.Name, ast.Attribute, ast.JoinedStr, ast.Subscript,
                          ast.Lambda)):
        return False
    if isinstance(value, ast.Tuple):
        return any(_mutable(e) for e in value.elts)
    if isinstance(value, (ast.BinOp, ast.Compare, ast.BoolOp, ast.UnaryOp)):
        return any(_mutable(c) for c in ast.iter_child_nodes(value) if isinstance(c, ast.expr))
    if isinstance(value, ast.Call):
        return _name(value) not in IMMUTABLE_CALLS
    return True   # a dict, list or set display, a comprehension, anything else


def module_state(source: str) -> list[str]:
    """Module-level mutable values, memoized functions and `global` statements of a module."""
    tree, found = ast.parse(source), []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and (
                isinstance(node, ast.AugAssign) or node.value is not None and _mutable(node.value)):
            found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found += [f"line {node.lineno}: @{_name(d)} {node.name}" for d in node.decorator_list
                      if _name(d) in MEMOS]
    found += [f"line {n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree)
              if isinstance(n, ast.Global)]
    return found


def test_no_module_level_mutable_state_in_the_protocol():
    found = {path.name: module_state(path.read_text()) for path in sorted(PROTOCOL.glob("*.py"))}
    assert not {name: lines for name, lines in found.items() if lines}, found


@pytest.mark.parametrize("source", [
    "import weakref\n_COVERED = weakref.WeakKeyDictionary()\n",
    "_CHECKED = set()\n",
    "SEEN: dict = {}\n",
    "ORDER = [1, 2]\n",
    "PAIRS = (1, [2])\n",
    "import functools\n@functools.cache\ndef f():\n    return 1\n",
    "N = 0\ndef bump():\n    global N\n    N += 1\n",
])
def test_control_the_check_catches_each_kind_of_module_state(source):
    assert module_state(source)


def test_control_constants_tuples_and_patterns_pass():
    assert not module_state("import re\nA = 1\nB = ('x', 'y')\nC = re.compile('a')\n"
                            "D = frozenset({1})\nE = A + 1\n")


def test_the_positions_travel_with_the_cache_through_a_forward_and_a_cut():
    """A forward returns the cache after it, one position per token fed; the value given stays as
    it was (frozen); a cut returns its own."""
    from dataclasses import FrozenInstanceError

    from kvfid.protocol import prefix_reuse
    from kvfid.protocol.decode import Cached, Runner, as_batch, new_cache
    from kvfid.stacks.stack import Stack
    from support.protocol_fixtures import small

    with Stack("sdpa", "fp32").activate(small()) as module:
        _check_positions(module, FrozenInstanceError, prefix_reuse, Cached, Runner, as_batch,
                         new_cache)


def _check_positions(module, FrozenInstanceError, prefix_reuse, Cached, Runner, as_batch,
                     new_cache):
    runner, empty = Runner(module), new_cache(module)
    logits, after = runner.forward(as_batch([5, 6, 7]), empty)
    assert (empty.positions, after.positions, after.checked) == (0, 3, True)
    assert after.cache is empty.cache and logits.shape[0] == 1
    _, later = runner.forward(as_batch([8, 9]), after)
    assert later.positions == 5 and after.positions == 3
    with pytest.raises(FrozenInstanceError):
        later.positions = 1
    cut = prefix_reuse.rollback(later, 2)
    assert cut.positions == 3 and later.positions == 5
    assert isinstance(cut, Cached)
    assert cut.cache.get_seq_length() == 3
    # the token fed next is at the cut's position 3, as on a cache that never held 8 and 9
    again, _ = runner.forward(as_batch([8]), cut)
    _, fresh = runner.forward(as_batch([5, 6, 7]), new_cache(module))
    fresh, _ = runner.forward(as_batch([8]), fresh)
    assert torch.equal(again, fresh)
    # control: the same token placed as if the cut had not moved the positions differs
    _, uncut = runner.forward(as_batch([5, 6, 7, 8, 9]), new_cache(module))
    moved, _ = runner.forward(as_batch([8]), prefix_reuse.rollback(uncut, 2).after(2))
    assert not torch.equal(moved, fresh)
