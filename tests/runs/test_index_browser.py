"""reports/index.html in a real browser: headless Chromium (Debian's `chromium`) lays the page out
at 1280 px; it must not scroll sideways, and every link must lead to a file.

The suite installs nothing: `make install-chromium` (a step of `make test`; apt-get, as root)
does, and CI's .ci/run stops where chromium is still missing, so there the check never turns into a
skip. Elsewhere, without chromium, these tests skip and say why. The page stays script-free: a copy of it,
with a <base> pointing at the original folder and a script appended that writes the measured
widths and each resolved link into the DOM, is what Chromium renders and dumps.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from kvfid.reports.document import to_html
from kvfid.reports.index_page import index_document

ROOT = Path(__file__).resolve().parents[2]
WIDTH = 1280
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MEASURE = """<script>(() => {
  const d = document.documentElement;
  const out = {inner: innerWidth, scroll: d.scrollWidth, client: d.clientWidth,
               links: [...document.links].map(a => a.href)};
  const pre = document.createElement("pre");
  pre.id = "kvfid-measure";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();</script>"""


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium, as `make install-chromium` installs it; the tests skip without it."""
    found = shutil.which("chromium")
    if found is None:
        pytest.skip("Debian's `chromium` is not installed (`make install-chromium` installs it with "
                    "apt-get, as root)")
    return found


def measure(chromium: str, page: Path, scratch: Path) -> dict:
    """The page at 1280 px: viewport and document widths, and every link as Chromium resolved it."""
    text = page.read_text(encoding="utf-8")
    base = f'<base href="{page.parent.resolve().as_uri()}/">'
    copy = scratch / "measure.html"
    text = text.replace("<head>", "<head>" + base, 1).replace("</body>", MEASURE + "</body>", 1)
    copy.write_text(text, encoding="utf-8")
    profile = scratch / "profile"
    profile.mkdir()
    done = subprocess.run(["chromium", *FLAGS, f"--user-data-dir={profile}",
                           f"--window-size={WIDTH},900", "--dump-dom", copy.as_uri()],
                          executable=chromium, capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="kvfid-measure">(.*?)</pre>', done.stdout, flags=re.S)
    assert found, f"no measurement in Chromium's DOM (exit {done.returncode}): {done.stderr[-400:]}"
    return json.loads(html.unescape(found[1]))


def assert_fits_and_links_resolve(result: dict) -> None:
    widths = {k: result[k] for k in ("inner", "scroll", "client")}
    assert widths["inner"] == WIDTH, widths             # the layout really is 1280 px wide
    assert widths["scroll"] <= widths["client"], f"scrolls sideways: {widths}"
    target = lambda href: Path(unquote(urlparse(href).path))
    missing = [href for href in result["links"]
               if urlparse(href).scheme != "file" or not target(href).is_file()]
    assert result["links"] and not missing, f"{len(missing)} links lead nowhere: {missing[:3]}"


def test_the_committed_index_fits_1280_px_and_every_link_resolves(chromium, tmp_path):
    page = ROOT / "reports" / "index.html"
    result = measure(chromium, page, tmp_path)
    assert_fits_and_links_resolve(result)
    runs = {p.parent.name for p in (ROOT / "reports").rglob("summary.json")}
    assert {Path(unquote(urlparse(h).path)).parent.name for h in result["links"]} >= runs


def entries(folder: Path, stacks: int, keys: int) -> list[dict]:
    """`keys` GPU environment keys with one run each over `stacks` stacks, reports on disk."""
    cons = {"prefill": {"kind": "arm", "cache_bit_exact": {"k": 7, "n": 8, "rate": 0.875},
                        "suffix_disagree": {"k": 1, "n": 8, "rate": 0.125, "ci": [0.02, 0.47]}}}
    out = []
    for i in range(keys):
        key = f"NVIDIA-H200/570.{i}/12.8/2.11.0+cu128/3.6.0"
        report = folder / key / f"2026010{i}-000000-000{i}" / "report.html"
        report.parent.mkdir(parents=True)
        report.write_text("<!DOCTYPE html><title>r</title>")
        out.append({"run": report.parent.name, "case": "wide", "status": "finished",
                    "environment_key": key, "git_revision": "0123456789abcdef0123",
                    "environment": {"gpus": [{"name": "NVIDIA H200", "driver_version": f"570.{i}"}],
                                    "versions": {"cuda_runtime": "12.8", "torch": "2.11.0+cu128",
                                                 "triton": "3.6.0"}},
                    "date": "2026-01-01T00:00:00Z", "report": str(report.relative_to(folder)),
                    "report_html": str(report.relative_to(folder)), "kernels": None,
                    "kernels_html": None, "stacks": {f"{b}/{d}+bi@t{t}": {"constructions": cons}
                                                     for b, d, t in _stack_names(stacks)}})
    return out


def _stack_names(n: int):
    names = [(b, d, t) for t in (1, 8) for d in ("bf16", "fp16", "fp32")
             for b in ("sdpa", "eager", "triton", "flash_attention_2")]
    return names[:n]


@pytest.mark.parametrize("stacks,keys", [(5, 8), (12, 3), (12, 12)])
def test_a_wide_index_still_fits_1280_px(chromium, tmp_path, stacks, keys):
    folder = tmp_path / "reports"
    folder.mkdir()
    page = folder / "index.html"
    page.write_text(to_html(index_document(entries(folder, stacks, keys))), encoding="utf-8")
    assert_fits_and_links_resolve(measure(chromium, page, tmp_path))
