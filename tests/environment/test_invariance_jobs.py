"""`compare_kernels(jobs=2)`: the rows measured in two spawned processes are the rows measured in
this one, in the same order, with the same tiled-mode probes."""

from kvfid.environment import invariance
from kvfid.kernels.invariant import tiled as mode_tiled


def test_two_processes_give_the_rows_and_probes_of_one(monkeypatch):
    monkeypatch.setattr(mode_tiled, "_verdicts", {})    # this process's probes: these rows' only
    options = dict(dtypes=("bf16",), quick=True, ops=("rms-norm",), threads=1)
    alone = invariance.compare_kernels(**options)
    shared = invariance.compare_kernels(**options, jobs=2)
    strip = lambda rows: [{k: v for k, v in row.items() if k != "seconds"} for row in rows]
    assert strip(shared["rows"]) == strip(alone["rows"]) and len(alone["rows"]) > 2
    assert shared["ok"] == alone["ok"]
    key = lambda probes: sorted(repr(sorted(p.items())) for p in probes)
    assert key(shared["tiled_probes"]) == key(alone["tiled_probes"])
