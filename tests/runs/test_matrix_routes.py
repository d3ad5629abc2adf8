"""A run's environment record names the tiled mode's routes its +bi units take, also on a fresh
machine (an empty route store): matrix.prepare chooses them before the record is taken."""

from __future__ import annotations

from kvfid.runs import matrix
from kvfid.runs.case import parse_case
from kvfid.kernels.invariant import route as mode_route

CASE = """
name = "routes"
model = "tiny-llama"
B = 2
S = 1
constructions = ["live", "prefill"]

[items]
set = "arith"
n = 1

[stacks]
backends = ["native"]
dtypes = ["bf16"]
batch_invariant = [true]
device = "cpu"
threads = 1
"""


def test_the_first_run_on_a_fresh_machine_records_the_routes_its_units_take(monkeypatch, tmp_path):
    monkeypatch.setenv("KVFID_CACHE", str(tmp_path))
    monkeypatch.delenv(mode_route.PIN_ENV, raising=False)
    monkeypatch.delenv("KVFID_BI_IMPL", raising=False)
    monkeypatch.setattr(mode_route, "_routes", {})
    monkeypatch.setattr(mode_route, "_records", {})
    prepared = matrix.prepare(parse_case(CASE), None)
    routes = prepared.environment["tiled_routes"]
    assert set(routes) >= {"bf16@t1", "fp32@t1"}
    assert routes["bf16@t1"] == mode_route.kept()["bf16@t1"]["route"]
