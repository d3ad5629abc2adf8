"""The floors hold: every import in harness/ (`kvfid`) and kernels/ (`kvfid.kernels`), inside
functions too, goes to its own floor or one below, in the order docs/architecture.md states once,
and no modules import each other in a circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Each folder and the import name it has (setup.py's package_dir), the deeper name first.
FOLDERS = {"kernels": "kvfid.kernels", "harness": "kvfid"}


def floors(text: str) -> list[list[str]]:
    """The ```floors block of architecture.md: one floor a line, top first; names on a line share
    a floor."""
    block = re.search(r"```floors\n(.*?)```", text, flags=re.S)
    assert block, "docs/architecture.md has no ```floors block"
    return [line.split() for line in block.group(1).splitlines() if line.strip()]


def module_name(path: Path, root: Path) -> str:
    folder, *parts = path.relative_to(root).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join([FOLDERS[folder], *parts])


def is_module(name: str, root: Path) -> bool:
    for folder, package in FOLDERS.items():
        if name == package or name.startswith(package + "."):
            path = root.joinpath(folder, *name[len(package):].split(".")[1:])
            return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()
    return False


def imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of kvfid in `path`, wherever it stands:
    `from a import b` counts as importing a.b when a.b is a module, else as importing a."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                whole = f"{base}.{alias.name}"
                found.append((node.lineno, whole if is_module(whole, root) else base))
    return [(line, m) for line, m in found if m.split(".")[0] == "kvfid"]


def graph(root: Path) -> dict[str, list[tuple[int, str]]]:
    return {module_name(p, root): imports(p, root)
            for folder in FOLDERS for p in sorted((root / folder).rglob("*.py"))}


def placed(module: str, units: list[str]) -> str | None:
    """The floor unit a module belongs to: the longest unit that is it or holds it."""
    holding = [u for u in units if module == u or module.startswith(u + ".")]
    return max(holding, key=len) if holding else None


def problems(root: Path, order: list[list[str]]) -> list[str]:
    """Every upward import, unplaced module and import circle, as lines naming file and line."""
    level = {unit: -i for i, line in enumerate(order) for unit in line}   # higher floor, higher level
    edges = graph(root)
    found = []
    for module, targets in edges.items():
        if module == "kvfid":      # the root package: the public names, from kvfid.api only
            found += [f"harness/__init__.py:{line} imports {t}" for line, t in targets
                      if t != "kvfid.api"]
            continue
        unit = placed(module, list(level))
        if unit is None:
            found.append(f"{module} is on no floor of docs/architecture.md")
            continue
        for line, target in targets:
            other = placed(target, list(level))
            if other is not None and level[other] > level[unit]:
                found.append(f"{_file(module, root)}:{line} imports {target}: "
                             f"upward, from floor {unit} to {other}")
    found += [f"import circle: {' -> '.join(c)}" for c in circles(
        {m: {t for _, t in ts if t in edges and t != m} for m, ts in edges.items()})]
    units = {}
    for module, targets in edges.items():
        unit = placed(module, list(level))
        for _, target in targets:
            other = placed(target, list(level))
            if unit and other and other != unit:
                units.setdefault(unit, set()).add(other)
    found += [f"package circle: {' -> '.join(c)}" for c in circles(units)]
    return found


def _file(module: str, root: Path) -> str:
    """The file of a module, as the repository names it (harness/..., kernels/...)."""
    for folder, package in FOLDERS.items():
        if module == package or module.startswith(package + "."):
            path = Path(folder, *module[len(package):].split(".")[1:])
            return str(path / "__init__.py" if (root / path).is_dir() else path.with_suffix(".py"))
    return module


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each node that lies on one (depth-first, in name order)."""
    seen, found, on_path = set(), [], []

    def visit(node: str) -> None:
        if node in on_path:
            found.append(on_path[on_path.index(node):] + [node])
            return
        if node in seen:
            return
        seen.add(node)
        on_path.append(node)
        for target in sorted(edges.get(node, ())):
            visit(target)
        on_path.pop()

    for node in sorted(edges):
        visit(node)
    return found


def test_imports_go_only_downward_and_never_in_a_circle():
    order = floors((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    found = problems(ROOT, order)
    assert not found, "\n".join(found)


def test_the_floors_name_every_package_once():
    order = floors((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    units = [u for line in order for u in line]
    assert len(units) == len(set(units))
    assert all(is_module(u, ROOT) for u in units), units
    assert [line for line in order if "kvfid.kernels" in line] == [["kvfid.kernels"]] == order[-1:]


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


FLOORS = [["kvfid.top"], ["kvfid.low"], ["kvfid.kernels"]]
BASE = {"harness/__init__.py": "", "harness/top/__init__.py": "", "harness/low/__init__.py": "",
        "kernels/__init__.py": "", "harness/top/a.py": "from kvfid.low import b\n",
        "harness/low/b.py": "from kvfid import kernels\n"}


def test_the_check_finds_an_upward_import_inside_a_function(tmp_path):
    root = _tree(tmp_path, {**BASE, "harness/low/c.py": "def f():\n    from kvfid.top.a import x\n"})
    assert problems(root, FLOORS) == [
        "harness/low/c.py:2 imports kvfid.top.a: upward, from floor kvfid.low to kvfid.top",
        "package circle: kvfid.low -> kvfid.top -> kvfid.low"]
    assert problems(_tree(tmp_path, {"harness/low/c.py": "import kvfid.kernels\n"}), FLOORS) == []


def test_the_check_finds_a_circle_inside_a_package_and_kernels_importing_harness(tmp_path):
    root = _tree(tmp_path, {**BASE, "harness/low/c.py": "from kvfid.low import d\n",
                            "harness/low/d.py": "def f():\n    from . import c\n",
                            "kernels/k.py": "from kvfid.low import b\n"})
    assert problems(root, FLOORS) == [
        "kernels/k.py:1 imports kvfid.low.b: upward, from floor kvfid.kernels to kvfid.low",
        "import circle: kvfid.low.c -> kvfid.low.d -> kvfid.low.c",
        "package circle: kvfid.kernels -> kvfid.low -> kvfid.kernels"]


def backend_name_tests(root: Path) -> list[str]:
    """`file:line` of every comparison in the protocol's rooms (harness/protocol/ and the rooms
    below or beside it: inputs, records, states, stacks, tracing, stages, engines) against a
    built-in backend's name (`backend == "sdpa"`, `name in ("triton", "native")`): the backends
    say what they refuse."""
    from kvfid.names import BACKENDS

    def named(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in BACKENDS
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(named, node.elts))

    found = []
    rooms = ("protocol", "inputs", "records", "states", "stacks", "tracing", "stages", "engines")
    for path in sorted(p for room in rooms for p in (root / "harness" / room).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and any(map(named, [node.left, *node.comparators])):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_protocol_code_tests_a_backend_name(tmp_path):
    assert backend_name_tests(ROOT) == []
    planted = _tree(tmp_path, {"harness/protocol/x.py": 'def f(b):\n    return b in ("eager", "x")\n'})
    assert backend_name_tests(planted) == ["harness/protocol/x.py:2"]   # the check can fail


# Imports stand at the top of a module, where the graph shows them; one inside a function stays
# only with a comment saying why (an optional dependency, a module's own import cost, a guarded
# import), on its line or the line above. The command line, cli.py and the package `__init__`s
# keep theirs: they are what keeps `kvfid --help` and `import kvfid` free of torch.
MAX_LOCAL_IMPORTS = 60


def local_imports(root: Path) -> list[tuple[str, int, bool]]:
    """(file, line, commented) for every import inside a function below the command line."""
    found = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith("harness/commands/") or rel == "harness/cli.py" \
                    or path.name == "__init__.py":
                continue
            text = path.read_text(encoding="utf-8")
            lines = text.splitlines()
            for function in ast.walk(ast.parse(text)):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(function):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        said = "#" in lines[node.lineno - 1] or \
                            lines[node.lineno - 2].strip().startswith("#")
                        found.append((rel, node.lineno, said))
    return sorted(set(found))


def test_imports_inside_functions_are_few_and_each_says_why():
    found = local_imports(ROOT)
    silent = [f"{file}:{line}" for file, line, said in found if not said]
    assert not silent, "an import inside a function without a comment saying why:\n" + \
        "\n".join(silent)
    assert len(found) <= MAX_LOCAL_IMPORTS, len(found)


def test_control_the_count_finds_a_silent_import_inside_a_function(tmp_path):
    root = _tree(tmp_path, {**BASE, "harness/low/c.py": "def f():\n    import json\n",
                            "harness/low/d.py": "def g():\n    import json   # lazy: why\n",
                            "harness/commands/e.py": "def h():\n    import json\n"})
    assert local_imports(root) == [("harness/low/c.py", 2, False), ("harness/low/d.py", 2, True)]


# The modules that are one engine's own (kvfid.engines.registry's modules and what they run):
# they may name their engine; nothing else in harness/ may test an engine's name.
ENGINE_MODULES = re.compile(r"harness/engines/(vllm_\w+|transformers_\w+|kv|faithful\w*|load\w*|"
                            r"bench|registry)\.py$")


def engine_name_tests(root: Path) -> list[str]:
    """`file:line` of every comparison anywhere in harness/ outside an engine's own modules
    against a registered engine's name (`engine == "vllm"`, `name in ("vllm", "x")`): commands
    and diagnoses go through the registry, and each engine says what it offers and refuses."""
    from kvfid.engines.registry import ENGINES

    def named(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in ENGINES
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(named, node.elts))

    found = []
    for path in sorted((root / "harness").rglob("*.py")):
        if ENGINE_MODULES.search(path.relative_to(root).as_posix()):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and any(map(named, [node.left, *node.comparators])):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_command_or_diagnosis_tests_an_engine_name(tmp_path):
    assert engine_name_tests(ROOT) == []
    planted = _tree(tmp_path, {"harness/commands/x.py": 'def f(engine):\n    return engine == "vllm"\n',
                               "harness/engines/vllm_engine.py": 'X = "vllm" == "vllm"\n'})
    assert engine_name_tests(planted) == ["harness/commands/x.py:2"]   # the check can fail
