"""`kvfid compile`: the GPU path compiled for sm_80/sm_90/sm_100 on this CPU and judged, with the
two negative controls (atomics, no tensor cores) and the SASS/resource parsers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvfid.cli import main
from kvfid.environment.compile import compile_targets, instruction_mix, problems, resource_usage
from kvfid.environment.compile_plan import ARCHS, Target, plan

# Where the workers import compile_controls from (the support modules' folder).
CONTROLS = str(Path(__file__).resolve().parents[1] / "support")


def _control(function: str, arch: str = "sm_90") -> Target:
    """A bf16 [256, 256] x [256, 256] launch of a control kernel in compile_controls.py."""
    args = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32" if "atomic" in function else "*bf16",
            "M": 256, "N": 256, "K": 256, "sam": 256, "sak": 1, "sbk": 256, "sbn": 1, "scm": 256,
            "scn": 1}
    return Target("control", f"compile_controls:{function}", arch, "bf16", function, args,
                  {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, {"num_warps": 4, "num_stages": 2},
                  tensor_cores=True)


def test_controls_atomic_split_k_and_fp32_upcast_are_flagged():
    report = compile_targets([_control("split_k_atomic_kernel"), _control("upcast_dot_kernel")],
                             jobs=1, python_path=(CONTROLS,))
    atomic, upcast = report["configs"]
    assert not report["ok"]
    assert atomic["atomics"] > 0 and any("atomic" in p for p in atomic["problems"]), atomic
    assert atomic["mma"] > 0, "the split-K control should still use tensor cores"
    assert upcast["mma"] == 0 and upcast["ffma"] > 0, upcast
    assert "no tensor cores" in upcast["problems"], upcast


@pytest.mark.gpu_rehearsal
def test_kvfid_compile_passes_for_every_config_of_the_gpu_default_case(tmp_path):
    """What the GPU default case launches (bf16 and fp32, every kernel) on every arch: 0 spills,
    0 atomics, shared memory within the limit, tensor cores in every bf16 product. (`kvfid
    compile` without --quick adds head dims 64/128 x groups 1/3/4/7/8 and fp16: minutes here.)"""
    result = CliRunner().invoke(main, ["compile", "--quick", "--dtypes", "bf16,fp32", "--format",
                                       "json", "--out", str(tmp_path)])
    report = json.loads(result.output)
    failed = {r["name"]: r["problems"] for r in report["configs"] if r["problems"]}
    assert result.exit_code == 0 and report["ok"], failed
    names = {r["name"] for r in report["configs"]}
    assert {r["arch"] for r in report["configs"]} == set(ARCHS)
    assert {f"attention-{arch}-bf16-decode-D64-G7" for arch in ARCHS} <= names  # Qwen2.5 shape
    for row in report["configs"]:
        assert row["stack"] == 0 and row["stl"] == 0 and row["atomics"] == 0, row
        assert row["mma"] > 0 if row["tensor_cores_expected"] else row["mma"] == 0, row
        assert row["roofline"] and all(r["floor_us"] > 0 for r in row["roofline"]), row
        assert (tmp_path / f"{row['name']}.cubin").stat().st_size > 0


def test_plan_covers_head_dims_groups_and_phases():
    names = {t.name for t in plan(archs=("sm_90",), dtypes=("bf16",))}
    for head_dim in (64, 128):
        for group in (1, 4, 7, 8):
            for phase in ("decode", "prefill"):
                assert f"attention-sm_90-bf16-{phase}-D{head_dim}-G{group}" in names
    with pytest.raises(ValueError, match="unknown arch sm_70"):
        plan(archs=("sm_70",))


SASS = """
        /*0100*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0110*/              @P0  FFMA R3, R4, R5, R6 ;
        /*0120*/             @!P1  RED.E.ADD.F32.FTZ.RN.STRONG.GPU [R2.64], R7 ;
        /*0130*/                   REDUX.SUM UR4, R3 ;
        /*0138*/                   ATOMS.OR RZ, [UR5+0x14], R3 ;
        /*0140*/                   STL [R1+0x4], R9 ;
        /*0150*/                   UTCHMMA gdesc[UR8], gdesc[UR10], tmem[UR12], tmem[UR6], idesc[UR7], UPT ;
"""


def test_instruction_mix_counts_mma_ffma_atomics_and_spills():
    mix = instruction_mix(SASS)
    assert (mix["mma"], mix["ffma"], mix["atomics"], mix["stl"], mix["ldl"]) == (2, 1, 1, 1, 0)
    assert mix["mma_ops"] == {"HGMMA": 1, "UTCHMMA": 1}  # REDUX (a warp reduction) is no atomic
    assert mix["shared_atomics"] == 1  # sm_100 tensor-memory allocator bookkeeping, apart


def test_resource_usage_and_problems():
    usage = resource_usage(" Function k:\n  REG:96 STACK:8 SHARED:0 LOCAL:0 CONSTANT[0]:648")
    assert usage == {"registers": 96, "stack": 8, "local": 0}
    target = _control("upcast_dot_kernel", "sm_80")
    record = {**usage, "shared": 200 * 1024, "mma": 0, "ffma": 1, "atomics": 0, "stl": 1, "ldl": 1}
    found = problems(target, record)
    assert len(found) == 3 and found[0].startswith("spills")
    assert found[1] == "shared memory 204800 B > 166912 B"
    assert found[2] == "no tensor cores"
