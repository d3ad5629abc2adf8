"""kvfid.environment.invariance: the kernel comparison's table, verdicts, negative controls, and that it can fail."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from kvfid import kernels
from kvfid.environment import invariance, probes
from kvfid.stacks import twins
from kvfid.environment.invariance import IMPLEMENTATIONS, OPS, bits_equal, compare_kernels
from kvfid.reports import invariance_table
from kvfid.reports.invariance_table import render_table, write_result
from kvfid.kernels.attention.kernel import attention_ref

# The comparison runs on CPU tensors; Triton takes them only through its interpreter (always set
# without CUDA, and by `make test`).
needs_interpreter = pytest.mark.skipif(not kernels.interpreting(), reason="needs TRITON_INTERPRET=1")


@pytest.fixture
def quick(quick_kernels):
    """One quick CPU comparison (small shapes, every op and implementation, bf16 and fp32), shared
    with the session (conftest.quick_kernels)."""
    return quick_kernels


def rows_of(result, op=None, impl=None, dtype=None):
    return [r for r in result["rows"] if (op is None or r["op"] == op)
            and (impl is None or r["impl"] == impl) and (dtype is None or r["dtype"] == dtype)]


def test_every_op_and_implementation_has_a_row_per_dtype(quick):
    seen = {(r["op"], r["impl"]) for r in quick["rows"]}
    skipped = {(s["op"], s["impl"]) for s in quick["skipped"]}
    assert seen | skipped == set(IMPLEMENTATIONS) and not seen & skipped  # nothing left out silently
    if kernels.interpreting():  # as in `make test`: only the CUDA-only rows are not run on CPU
        assert skipped == {key for key, impl in IMPLEMENTATIONS.items() if impl.cpu_skip}
    assert {r["op"] for r in quick["rows"]} == set(OPS)
    for op, impl in seen:
        assert sorted(r["dtype"] for r in rows_of(quick, op, impl)) == ["bf16", "fp32"]
    table = render_table(quick)
    for r in quick["rows"]:
        assert f"| {r['op']} | {r['impl']} | {r['dtype']} |" in table


@needs_interpreter
def test_triton_rows_are_invariant_and_the_result_is_ok(quick):
    triton_rows = [r for r in quick["rows"] if r["impl"] == "triton"]
    assert len(triton_rows) == 2 * len(OPS)
    for row in triton_rows:
        assert row["claims"] == {"batch": True, "sequence": True}
        assert row["batch"]["invariant"], row
        assert row["sequence"]["invariant"], row
    assert all(r["ok"] for r in quick["rows"])
    assert quick["ok"] is True


def test_negative_controls_every_twin_is_caught_by_both_checks(quick):
    """The checks can fail on any machine: each op's deliberately variant twin (split chosen from
    the shape) is seen to differ by batch and by construction, in every dtype."""
    twin_rows = rows_of(quick, impl="twin")
    assert {r["op"] for r in twin_rows} == set(OPS) and len(twin_rows) == 2 * len(OPS)
    for row in twin_rows:
        assert not row["batch"]["invariant"] and row["batch"]["max_abs_diff"] > 0, row
        assert not row["sequence"]["invariant"], row
        assert row["sequence"]["first_differing_position"] is not None, row
        assert row["ok"], row
    assert render_table(quick).count("control caught") == len(twin_rows)


def test_a_twin_the_checks_miss_fails_the_result(monkeypatch):
    """Swap the matmul twin for an invariant matmul (stock F.linear under the rowwise mode): the
    control is missed, so the result is not ok."""
    key = ("matmul", "twin")
    monkeypatch.setitem(IMPLEMENTATIONS, key, replace(IMPLEMENTATIONS[key], run=F.linear, mode="rowwise"))
    result = compare_kernels(dtypes=("fp32",), quick=True, ops=("matmul",), impls=("twin",))
    (row,) = result["rows"]
    assert row["batch"]["invariant"] and not row["ok"] and result["ok"] is False
    assert "**CONTROL MISSED**" in render_table(result)


def test_stock_rows_are_findings_never_failures(quick):
    """Whether a stock row varies is machine-dependent: either way it leaves `ok` alone, and a
    stock row that passes both checks is reported as "stock invariant here"."""
    stock = [r for r in quick["rows"] if not r["control"]
             and not (r["claims"]["batch"] or r["claims"]["sequence"])]
    assert stock
    for row in stock:
        assert row["ok"], row
        both = row["batch"]["invariant"] and row["sequence"]["invariant"]
        assert invariance_table._verdict(row) == ("stock invariant here" if both else "-")
    probes = {(p["op"], p["dtype"]) for p in quick["stock_probes"]}
    assert probes == {(op, d) for op in ("mm", "sdpa") for d in ("bf16", "fp32")}
    for p in quick["stock_probes"]:
        assert p["witness"] is None or p["witness"]["max_abs_diff"] > 0, p
    assert "Stock probes" in render_table(quick)


def test_filed_result_is_json_markdown_and_html_of_one_document(quick, tmp_path):
    path = write_result(quick, tmp_path)
    folder = tmp_path / quick["environment_key"]
    assert path == folder / "kernels.md" and path.read_text() == render_table(quick)
    assert json.loads((folder / "kernels.json").read_text())["rows"] == quick["rows"]
    page = (folder / "kernels.html").read_text()
    assert page.count("<tr>") == 1 + len(quick["rows"]) and "<li>" in page  # head + rows; probes
    assert f"<code>{quick['environment_key']}</code>" in page and "`" not in page


def test_result_carries_its_environment_and_is_json(quick):
    assert quick["environment"]["versions"]["torch"] == torch.__version__
    assert quick["environment_key"].startswith(("cpu", ))
    assert quick["threads"] == 1
    assert json.loads(json.dumps(quick))["rows"]


@needs_interpreter
def test_ok_flips_when_a_claiming_implementation_is_not_invariant(monkeypatch):
    """Swap the Triton matmul for stock F.linear (still claiming invariance): the verdict fails."""
    key = ("matmul", "triton")
    monkeypatch.setitem(IMPLEMENTATIONS, key, replace(IMPLEMENTATIONS[key], run=lambda x, w: F.linear(x, w)))
    result = compare_kernels(dtypes=("fp32",), quick=True, ops=("matmul",), impls=("triton",))
    (row,) = result["rows"]
    assert not row["batch"]["invariant"] and not row["ok"]
    assert result["ok"] is False
    assert "FAIL" in render_table(result)


@needs_interpreter
def test_sequence_check_fails_for_a_claiming_attention_that_depends_on_length(monkeypatch):
    """Swap the Triton attention for SDPA (claims kept): decode steps differ from the prefill."""
    key = ("attention-decode", "triton")
    monkeypatch.setitem(IMPLEMENTATIONS, key, replace(IMPLEMENTATIONS[key], run=invariance.attention_sdpa))
    result = compare_kernels(dtypes=("fp32",), quick=True, ops=("attention-decode",), impls=("triton",))
    (row,) = result["rows"]
    assert not row["sequence"]["invariant"] and not row["ok"] and result["ok"] is False


def test_stock_probes_find_a_witness_exactly_when_there_is_one():
    """The probes' own control: a variant op gives a witness, an invariant one gives none."""
    cpu = torch.device("cpu")
    witness = probes.mm_batch_witness(twins.matmul_twin, torch.float32, cpu, grid=((96, 80),))
    assert witness and witness["batch"] == 2 and witness["max_abs_diff"] > 0

    def rowwise(x, w):
        return torch.cat([x[i:i + 1].clone() @ w.t() for i in range(x.shape[0])])

    assert probes.mm_batch_witness(rowwise, torch.float32, cpu, grid=((96, 80),)) is None
    grid = ((4, 2, 16, 24),)
    witness = probes.attention_decode_witness(twins.attention_twin, torch.bfloat16, cpu, grid=grid)
    assert witness and witness["position"] >= 1 and witness["max_abs_diff"] > 0

    def per_position(q, k, v):  # each position computed exactly as its decode step is
        first = k.shape[2] - q.shape[2]
        return torch.cat([attention_ref(q[:, :, i:i + 1], k[:, :, :first + i + 1], v[:, :, :first + i + 1])
                          for i in range(q.shape[2])], dim=2)

    assert probes.attention_decode_witness(per_position, torch.bfloat16, cpu, grid=grid) is None


def test_bits_equal_tells_signed_zeros_apart():
    a = torch.tensor([0.0, 1.0])
    assert torch.equal(a, torch.tensor([-0.0, 1.0]))  # why bits, not torch.equal
    assert not bits_equal(a, torch.tensor([-0.0, 1.0]))
    assert bits_equal(a.bfloat16(), a.clone().bfloat16())
    assert not bits_equal(a, a.double())


def test_batch_check_reports_first_failing_batch_and_difference():
    """A fake op whose row 0 changes once the batch reaches 8 rows."""
    def fake(x):
        out = x.clone()
        if x.shape[0] >= 8:
            out[0] += 0.5
        return out

    pool = torch.arange(32.0).reshape(16, 2)
    verdict, alone = invariance.batch_check(fake, [pool], (2, 7, 8, 16), rows=[0, 1, 15])
    assert not verdict["invariant"]
    assert verdict["first_failing_batch"] == 8
    assert verdict["max_abs_diff"] == 0.5
    assert [f["batch"] for f in verdict["failing"]] == [8, 16]
    assert set(alone) == {0, 1, 15}


def test_unknown_dtype_or_op_is_refused():
    with pytest.raises(ValueError, match="dtypes"):
        compare_kernels(dtypes=("fp8",), quick=True)
    with pytest.raises(ValueError, match="ops"):
        compare_kernels(quick=True, ops=("conv",))
    with pytest.raises(ValueError, match="implementations"):
        compare_kernels(quick=True, impls=("cudnn",))
