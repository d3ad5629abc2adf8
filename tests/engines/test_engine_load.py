"""`kvfid engine-load` without vLLM: the seeded plan, the per-request comparison (with its
negative controls: a flipped logprob bit, a changed K element, a different token are found),
the groups, the record through the ledger (beside an engine check; a ledger without load runs
still reads), the report and the index, and bad input against a stand-in OpenAI server in its
own process: a rejected request, a client timeout, a server killed mid-run; an incomplete run
is stored with no verdict."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from kvfid.engines import load_server
from kvfid.engines.load_compare import Served, compare_request, missing_request
from kvfid.engines.load_plan import Clients, LoadShape, plan_load
from kvfid.errors import BadInput
from kvfid.records.engine_load import EngineLoadRecord, LoadRequest, StateDiff, SweepPoint, groups

SMALL = LoadShape(requests=12, clients=3, tokens=4, short=(5, 9), long=(40, 60), prefixes=2,
                  prefix_length=20, prefix_share=0.5)


def test_the_plan_is_seeded_and_mixed():
    a, b, c = plan_load(SMALL, 1), plan_load(SMALL, 1), plan_load(SMALL, 2)
    assert a == b and a != c
    assert [r.client for r in a.requests] == [i % 3 for i in range(12)]
    assert sum(len(q) for q in a.by_client()) == 12
    assert {r.greedy for r in a.requests} == {True, False}
    assert all((r.seed is None) == r.greedy for r in a.requests)
    shared = [r for r in a.requests if r.prefix is not None]
    assert shared and all(len(r.prompt) > 20 for r in shared)
    heads = {r.prefix: r.prompt[:20] for r in shared}
    assert all(r.prompt[:20] == heads[r.prefix] for r in shared)
    assert a.longest == max(len(r.prompt) for r in a.requests) + 4
    for bad in (dict(requests=0), dict(greedy_share=1.5), dict(short=(0, 3)), dict(prefix_length=50)):
        with pytest.raises(BadInput):
            plan_load(dataclasses.replace(SMALL, **bad))


def _state(tokens, layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = len(tokens)
    return {"tokens": list(tokens), "keys": [torch.randn(1, 1, n, 4, generator=g) for _ in range(layers)],
            "values": [torch.randn(1, 1, n, 4, generator=g) for _ in range(layers)]}


def _served(folder, name, tokens, logprobs, state, **seen):
    folder.mkdir(exist_ok=True)
    torch.save(state, folder / name)
    return Served(tuple(tokens), tuple(logprobs), {"final_state": name, **seen})


def test_clients_send_each_request_its_gap_after_their_previous_one_finished():
    """Every engine's load loop (vLLM's and transformers'): a request in flight for 2 steps; each
    client's next request is sent `gap` steps after its previous one finished, and where nothing
    is in flight the loop jumps to the next send."""
    plan = plan_load(LoadShape(requests=9, clients=3), seed=4)
    clients, sent, flying, step = Clients(plan), {}, {}, 0
    while True:
        for planned in clients.due(step):
            sent[planned.index], flying[planned.index] = step, step + 2
        if clients.idle():
            after = clients.next_step(step)
            if after is None:
                break
            step = after
            continue
        step += 1
        for index in [i for i, end in flying.items() if end == step]:
            del flying[index]
            clients.finished(plan.requests[index].client, step)
    assert sorted(sent) == [r.index for r in plan.requests]
    for queue in plan.by_client():
        assert sent[queue[0].index] == queue[0].gap
        for before, after in zip(queue, queue[1:]):
            assert sent[after.index] == sent[before.index] + 2 + after.gap


def test_a_request_against_alone_and_the_controls(tmp_path):
    planned = plan_load(SMALL, 0).requests[0]
    prompt = list(planned.prompt)
    tokens, logprobs = [5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4]
    state = _state(prompt + tokens[:-1])
    alone = _served(tmp_path / "alone", "a.pt", tokens, logprobs, state)
    seen = {"cache_hits": [0, 10], "computed": len(prompt) + 3, "scheduled": len(prompt) + 3 + 7,
            "coresident": 5, "preempted_at": [len(prompt) + 1], "states": ["p.pt"]}
    torch.save({"tokens": prompt + tokens[:1], "keys": [k[:, :, :len(prompt) + 1] for k in state["keys"]],
                "values": [v[:, :, :len(prompt) + 1] for v in state["values"]]}, tmp_path / "p.pt")
    same = compare_request(planned, _served(tmp_path, "l.pt", tokens, logprobs, state, **seen), alone,
                           tmp_path, tmp_path / "alone")
    assert not same.differs and same.kv.exact and same.kv.positions == len(prompt) + 3
    assert same.token_ids == tuple(tokens) and same.token_logprobs == tuple(logprobs)
    assert same.kv_sha is not None and len(same.kv_sha) == 64
    assert same.preemptions == 1 and same.recomputed == 10 - 3 and same.cache_hits == (0, 10)
    assert same.coresident == 5 and len(same.resumed) == 1 and same.resumed[0].exact
    # one logprob's last bit flipped: found, at its step
    flipped = logprobs.copy()
    flipped[2] = float(torch.tensor(flipped[2]).view(torch.int32).add(1).view(torch.float32))
    row = compare_request(planned, _served(tmp_path, "l.pt", tokens, flipped, state, **seen), alone,
                          tmp_path, tmp_path / "alone")
    assert row.differs and row.logprobs_differ == 1 and row.first_logprob_step == 2 and row.kv.exact
    # one K element of layer 1 changed: the state differs from layer 1 at that position
    changed = _state(prompt + tokens[:-1])
    changed["keys"][1][0, 0, 3, 1] += 1.0
    row = compare_request(planned, _served(tmp_path, "c.pt", tokens, logprobs, changed, **seen), alone,
                          tmp_path, tmp_path / "alone")
    assert row.differs and not row.kv.exact and row.kv.first_bad_layer == 1 and row.kv.first_position == 3
    assert row.kv.n_diff == 1 and row.kv.max_ulp > 0 and row.kv.d_rel > 0   # the CacheDiff's totals
    assert not row.resumed[0].exact            # the live state before preemption is not the rebuilt one
    # a different token at step 2: compared up to there
    row = compare_request(planned, _served(tmp_path, "l.pt", [5, 6, 9, 9], logprobs, state, **seen),
                          alone, tmp_path, tmp_path / "alone")
    assert row.tokens_equal is False and row.first_token_step == 2 and row.logprobs == 2
    assert row.kv.positions == len(prompt) + 2


def _record(**fields) -> EngineLoadRecord:
    rows = (LoadRequest(0, 0, 30, True, preemptions=1, coresident=3, tokens_equal=True,
                        kv=StateDiff(33, True), resumed=(StateDiff(31, True),)),
            LoadRequest(1, 1, 8, False, coresident=12, tokens_equal=False, first_token_step=4,
                        logprobs=4, logprobs_differ=1, first_logprob_step=2, max_abs=1e-3,
                        kv=StateDiff(11, False, 1, 9, 4, 2, 1e-3)),
            LoadRequest(2, 0, 8, True, coresident=1, tokens_equal=True, kv=StateDiff(11, True)))
    base = dict(model="smollm2-135m", dtype="bf16", engine="vllm 0.32.0", faithful=False,
                mode="in-process", seed=0, clients=2, tokens=4, kv_blocks=18, chunk=None,
                prefix_caching=True, requests=rows, load_wall_s=2.0, generated_tokens=12,
                sweep=(SweepPoint(1, 200, 1, 0), SweepPoint(4, 200, 4, 2, 3), SweepPoint(1, 576, 1, 0)))
    return EngineLoadRecord(**{**base, **fields})


def test_groups_split_preempted_and_coresident():
    table = {g.name: g for g in groups(_record().requests)}
    assert table["all requests"].differ == 1 and table["preempted"].requests == 1
    assert table["not preempted"].differ == 1 and table["co-resident 9-16"].differ == 1
    assert table["co-resident 1"].requests == 1 and table["co-resident 2-4"].requests == 1
    assert table["all requests"].first_bad_layer == 1 and table["all requests"].first_token_step == 4


def test_stored_reported_and_indexed_and_an_incomplete_run_has_no_verdict(tmp_path):
    from kvfid.ledger.engine_checks import checks
    from kvfid.ledger.store import Ledger
    from kvfid.reports.engine_load_report import write_report
    from kvfid.reports.index import update_index
    from kvfid.tasks.engine_store import list_checks, report_check, store_result

    environment = {"git": {"revision": "abc", "dirty": False}}
    db = tmp_path / "ledger.sqlite"
    stored = store_result(db, _record(), environment)
    assert stored.id.startswith("load-") and stored.record == _record()
    incomplete = dataclasses.replace(_record(), requests=_record().requests[:2] + (
        missing_request(plan_load(SMALL, 0).requests[2], "no answer: the server died (exit -9)"),),
        status="incomplete")
    later = store_result(db, incomplete, environment)
    with Ledger(db, readonly=True) as ledger:
        assert [s.record for s in checks(ledger)] == [_record(), incomplete]
    listed = list_checks(db)
    assert [r["complete"] for r in listed] == [True, False] and not listed[1]["exact"]
    text, files = report_check(db, later.id, tmp_path / "reports")
    assert "No verdict: 1 of 3 requests are missing" in text and "the server died" in text
    report = write_report(stored, tmp_path / "reports")
    md = report["markdown"].read_text()
    assert "Differs: 1 of 3 requests" in md and "co-resident 9-16" in md
    assert "prompt 200: first differs at 4 co-resident" in md and "prompt 576: never differs" in md
    assert "<svg" in report["html"].read_text()
    index = update_index(tmp_path / "reports").read_text()     # the newest of the two (one key)
    assert "Engine load runs" in index and index.count("| vllm 0.32.0/bf16 |") == 1
    only = tmp_path / "only"
    write_report(later, only)
    assert "no verdict" in update_index(only).read_text()


def test_an_engine_check_ledger_without_load_runs_still_reads(tmp_path):
    from kvfid.records.engine import EngineCheckRecord, EngineRow
    from kvfid.tasks.engine_store import list_checks, store_result

    check = EngineCheckRecord("m", "bf16", "vllm 0.32.0", 2, 8, 32,
                              rows=(EngineRow("decode vs prefill re-scoring", 16, 0, 0.0, 2, 2),))
    stored = store_result(tmp_path / "l.sqlite", check, {"git": {}})
    assert stored.id.startswith("engine-")
    assert [r["kind"] for r in list_checks(tmp_path / "l.sqlite")] == ["engine-check"]


STAND_IN = r'''
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if len(body["prompt"]) > 50:
            self.send_response(400); self.end_headers()
            self.wfile.write(b'{"error": "This model\'s maximum context length is 50 tokens"}'); return
        if body["request_id"] == "kvfidreq1x":
            time.sleep(3)
        n = body["max_tokens"]
        out = {"choices": [{"token_ids": [7] * n, "logprobs": {"token_logprobs": [-0.5] * n}}]}
        data = json.dumps(out).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
print("up", flush=True)
server.serve_forever()
'''


def test_bad_input_a_rejection_a_timeout_and_a_dead_server(tmp_path):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    port = load_server._free_port()
    process = subprocess.Popen([sys.executable, str(script), str(port)], stdout=subprocess.PIPE,
                               start_new_session=True)
    try:
        assert process.stdout.readline().strip() == b"up"
        plan = plan_load(dataclasses.replace(SMALL, requests=8, clients=1, long=(60, 70), long_share=0.0,
                                             prefix_share=0.0, mean_gap=0.0), 0)
        plan = dataclasses.replace(plan, requests=tuple(
            dataclasses.replace(r, prompt=r.prompt * 12) if r.index == 2 else r for r in plan.requests))
        served, missing, _ = load_server.clients(f"http://127.0.0.1:{port}", process, plan,
                                                 load_server.Faults(client_timeout_s=1.0, kill_after=4))
    finally:
        load_server.stop(process)
    assert missing[1].startswith("client timeout") and missing[2].startswith("rejected by the server: HTTP 400")
    assert sorted(served) == [0, 3, 4, 5]                   # the fourth answer killed the server
    assert all(missing[i] == "no answer: the server died (exit -9)" for i in (6, 7))
    assert served[0] == ((7,) * 4, (-0.5,) * 4)


def test_without_vllm_this_process_environment_is_left_as_it_was(tmp_path, monkeypatch):
    # kvfid as a library: asking for vLLM where it is absent sets nothing (PYTHONSAFEPATH leaked
    # into every later child of the process, the suite's included). The control: a stand-in vllm
    # gets vLLM's settings.
    import importlib.util
    import os

    from kvfid.engines.vllm_llm import require_vllm
    from kvfid.errors import Unavailable

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    saved = dict(os.environ)
    try:
        for name in ("PYTHONSAFEPATH", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING"):
            os.environ.pop(name, None)
        before = dict(os.environ)
        with pytest.raises(Unavailable):
            require_vllm()
        assert dict(os.environ) == before
        (tmp_path / "vllm").mkdir()
        (tmp_path / "vllm" / "__init__.py").write_text("")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, "vllm", raising=False)
        assert require_vllm().__file__ == str(tmp_path / "vllm" / "__init__.py")
        assert os.environ["PYTHONSAFEPATH"] == "1" and os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_an_engine_kv_row_is_the_worst_of_its_items_typed_and_stored_as_before():
    """engine-check --kv's row over pairs of states (kvfid.engines.bits.compare_rows): an
    EngineKV built from each pair's CacheDiff; one K element of item 1's layer 1 changed is found
    there, the other item stays exact, and its plain form has the keys engine-check stored."""
    from kvfid.engines.bits import compare_rows
    from kvfid.records.engine import EngineKV
    from kvfid.records.plain import as_plain
    from kvfid.states.cache import BoundaryState

    states = [_state(range(6), seed=s) for s in (0, 1)]
    as_state = lambda s: BoundaryState(s["tokens"], keys=s["keys"], values=s["values"])
    changed = _state(range(6), seed=1)
    changed["keys"][1][0, 0, 4, 2] += 1.0
    row = compare_rows([as_state(s) for s in states], [as_state(states[0]), as_state(changed)])
    assert isinstance(row, EngineKV) and not row.exact
    assert (row.items, row.items_exact, row.first_bad_layer, row.first_position) == (2, 1, 1, 4)
    assert row.n_diff == 1 and row.positions == 12 and row.d_rel > 0
    assert row.d_rel_per_layer[0] == 0.0 and row.d_rel_per_layer[1] > 0
    assert list(as_plain(row)) == ["items", "items_exact", "first_bad_layer", "first_position",
                                   "n_diff", "max_abs", "max_ulp", "d_rel", "positions",
                                   "d_rel_per_layer", "d_rel_aggregation"]
    same = compare_rows([as_state(s) for s in states], [as_state(s) for s in states], [3, 5])
    assert same.exact and same.positions == 8 and same.first_bad_layer is None
