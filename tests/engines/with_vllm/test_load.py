"""`kvfid engine-load` on the tiny llama: a load run whose KV budget forces preemption, every
request against itself alone. Faithful: every request bit-exact in tokens, logprobs and engine
state, the preempted ones included, and each preempted request's rebuilt state equal to its live
one. The control: stock vLLM on the same plan, through the same comparison, its preempted
requests told apart (each preemption's rebuilt state compared); whether stock differs is the
machine's and is not asserted. The comparison's own negative controls (a flipped logprob bit, a
changed K element are reported) are tests/engines/test_engine_load.py's, without vLLM."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; `make install-vllm`, then `make test-vllm`")

from kvfid.engines.load import run_load  # noqa: E402
from kvfid.engines.load_plan import LoadShape, plan_load  # noqa: E402
from kvfid.records.engine_load import groups  # noqa: E402

SHAPE = LoadShape(requests=8, clients=4, tokens=24, short=(8, 40), long=(100, 180), prefixes=1,
                  prefix_length=64, prefix_share=0.5, mean_gap=1.0)
KV_BLOCKS = 10          # 320 positions for 4 clients' requests of up to 204: the scheduler preempts


@pytest.fixture(scope="module")
def plan():
    return plan_load(SHAPE, seed=3)


@pytest.mark.parametrize("faithful", [True, False], ids=["faithful", "stock"])
def test_load_run_with_preemption_against_alone(tiny_folder, plan, faithful, tmp_path):
    parts = run_load(str(tiny_folder), "bf16", plan, KV_BLOCKS, faithful=faithful, work=tmp_path)
    rows = parts["requests"]
    assert len(rows) == len(plan.requests) and not any(r.missing for r in rows)
    preempted = [r for r in rows if r.preemptions]
    assert preempted, "the KV budget forced no preemption"
    assert all(r.kv is not None for r in rows), parts["notes"]
    assert max(r.coresident for r in rows) > 1 and parts["generated_tokens"] == 8 * 24
    assert any(sum(r.cache_hits) for r in rows)            # the shared prefix was served
    table = {g.name: g for g in groups(rows)}
    assert table["preempted"].requests == len(preempted) > 0
    assert table["preempted"].requests + table["not preempted"].requests == len(rows)
    if faithful:
        assert not any(r.differs for r in rows), [(r.index, r.first_logprob_step, r.kv) for r in rows]
        assert all(d.exact and d.positions > 0 for r in preempted for d in r.resumed)
        assert sum(r.recomputed for r in rows) >= 0
    else:   # the control: stock on the same plan, its preempted requests told apart. Whether
        # stock differs from alone is the machine's (measured and shown, never assumed here).
        assert table["all requests"].differ == table["preempted"].differ + table["not preempted"].differ
        assert all(len(r.resumed) == r.preemptions for r in rows)
        assert {r.index for r in preempted} == {r.index for r in rows if r.resumed}
