"""Case files: the shipped cases load; each bad key is refused naming file, key, value, allowed."""

from pathlib import Path

import pytest

from kvfid.stacks.backends import backend_names
from kvfid.runs.case import CaseError, load_case, parse_case

CASES = Path(__file__).resolve().parents[2] / "cases"

GOOD = """
model = "tiny-llama"
B = 4
S = 4
constructions = ["live", "prefill"]

[items]
set = "arith"
n = 5

[stacks]
backends = ["sdpa"]
dtypes = ["fp32"]
threads = 1
"""


def edited(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new)


@pytest.mark.parametrize("name", ["smoke", "smollm2-cpu", "paper", "paper-shape", "paper-cpu",
                                  "gpu-qwen2.5-shape", "replay-smollm2"])
def test_shipped_cases_load(name, monkeypatch):
    monkeypatch.chdir(CASES.parent)       # a replay case's trajectories are read from the root
    case = load_case(CASES / f"{name}.toml")
    assert case.name == name and case.stacks and case.items.n >= 1
    measured = sum(case.takes(s, i) for s in case.stacks for i in range(case.items.n))
    assert case.design()["units"] == measured + case.design()["crossing_items"]


def test_gpu_case_names_the_triton_backend_through_the_registry():
    case = load_case(CASES / "gpu-qwen2.5-shape.toml")
    assert "triton" in backend_names()
    assert {s.backend for s in case.stacks} == {"sdpa", "eager", "triton"}
    assert {s.device for s in case.stacks} == {"cuda"}


@pytest.mark.parametrize("name,headline", [("gpu-qwen2.5-shape", {"triton/bf16+bi", "sdpa/bf16+bi"}),
                                           ("smollm2-cpu", {"native/bf16+bi"})])
def test_default_cases_carry_the_batch_invariant_faithful_stack(name, headline):
    """The GPU case's headline is the Triton kernel; the CPU case's the native path of the same
    contract (the Triton interpreter would allow it one item), on every item."""
    case = load_case(CASES / f"{name}.toml")
    labels = [s.label.partition("@t")[0] for s in case.stacks]   # the CPU case sets threads
    assert headline <= set(labels) and labels[0] in headline and labels[0].endswith("+bi")
    assert {"sdpa/bf16", "sdpa/fp32"} <= set(labels)  # the diverging stock rows beside it
    if name == "smollm2-cpu":  # every item, and enough of them for an interval worth reading
        assert (case.stack_items or (None,))[0] is None and case.items.n >= 8


def test_the_cpu_paper_case_is_the_paper_design_on_cpu_stacks():
    """paper-cpu differs from paper only in its stacks: stock sdpa in both precisions (its first
    stack, which the crossing's reference runs like) and the faithful native/bf16+bi, one thread
    each; its control: paper's own stacks are the GPU's."""
    paper, cpu = (load_case(CASES / f"{name}.toml") for name in ("paper", "paper-cpu"))
    same = lambda c: (c.model, c.items, c.B, c.S, c.constructions, c.replicas, c.transplants,
                      c.crossing.dtypes, c.crossing.constructions, c.crossing.items,
                      c.crossing.reference.label.partition("@")[0], c.ignore_eos)
    assert same(cpu) == same(paper)
    assert [s.label for s in cpu.stacks] == ["sdpa/bf16@t1", "sdpa/fp32@t1", "native/bf16+bi@t1"]
    assert {s.device for s in cpu.stacks} == {"cpu"} and not cpu.stack_items
    assert cpu.crossing.reference.label == "sdpa/bf16@t1"
    assert {s.device for s in paper.stacks} == {"cuda"}


STACK_GROUPS = GOOD.replace("""[stacks]
backends = ["sdpa"]
dtypes = ["fp32"]
threads = 1
""", """[[stacks]]
backends = ["triton", "sdpa"]
dtypes = ["bf16"]
batch_invariant = [true]
items = 2

[[stacks]]
backends = ["sdpa"]
dtypes = ["bf16", "fp32"]
""")


def test_stack_tables_union_with_per_table_item_limits():
    case = parse_case(STACK_GROUPS)
    assert [s.label for s in case.stacks] == ["triton/bf16+bi", "sdpa/bf16+bi", "sdpa/bf16",
                                              "sdpa/fp32"]
    assert [i for i in range(5) if case.takes(case.stacks[0], i)] == [0, 1]
    assert all(case.takes(case.stacks[3], i) for i in range(5))
    assert case.design()["units"] == 2 * 2 + 2 * 5


def test_stack_tables_refuse_a_stack_listed_twice_and_a_bad_limit():
    twice = STACK_GROUPS.replace('backends = ["sdpa"]\ndtypes = ["bf16", "fp32"]',
                                 'backends = ["sdpa"]\ndtypes = ["bf16"]\nbatch_invariant = [true]')
    with pytest.raises(CaseError, match=r"\[stacks\] backends = 'sdpa/bf16\+bi'"):
        parse_case(twice)
    with pytest.raises(CaseError, match=r"\[stacks\] items = -1"):
        parse_case(STACK_GROUPS.replace("items = 2", "items = -1"))
    with pytest.raises(CaseError, match="unknown key \\[stacks\\] 'item'"):
        parse_case(STACK_GROUPS.replace("items = 2", "item = 2"))


# (text, the key as named in the message, the bad value, a piece of the allowed list)
BAD = [
    (edited('model = "tiny-llama"', 'model = "gpt-9"'), "model", "'gpt-9'", "tiny-llama"),
    (edited("B = 4", "B = 0"), "B", "0", "an integer >= 1"),
    (edited("S = 4", 'S = "four"'), "S", "'four'", "an integer >= 1"),
    (edited('["live", "prefill"]', '["live", "chunked:0"]'), "constructions", "'chunked:0'",
     "chunked:N"),
    (edited('set = "arith"', 'set = "csv:x"'), "[items] set", "'csv:x'", "jsonl:<path>"),
    (edited("n = 5", "n = -2"), "[items] n", "-2", ">= 1"),
    (edited('backends = ["sdpa"]', 'backends = ["flash"]'), "[stacks] backends", "'flash'",
     ", ".join(backend_names())),
    (edited('dtypes = ["fp32"]', 'dtypes = ["fp8"]'), "[stacks] dtypes", "'fp8'",
     "bf16, fp16, fp32"),
    (edited("threads = 1", 'threads = 1\ndevice = "tpu"'), "[stacks] device", "'tpu'",
     "cpu, cuda"),
    (edited("threads = 1", "threads = 0"), "[stacks] threads", "0", "an integer from 1 to 1024"),
    (GOOD + '[replicas]\narms = ["prefil"]\n', "[replicas] arms", "'prefil'", "incremental-1"),
    (GOOD + '[replicas]\narms = ["prefill"]\nitems = -1\n', "[replicas] items", "-1", '"all"'),
    (GOOD + '[crossing]\nreference = "sdpa/fp8"\ndtypes = ["fp32"]\n', "[crossing] reference",
     "'sdpa/fp8'", "BACKEND/DTYPE"),
    (GOOD + '[crossing]\nreference = "sdpa/bf16"\ndtypes = ["fp64"]\n', "[crossing] dtypes",
     "'fp64'", "bf16, fp16, fp32"),
    (GOOD + '[transplants]\npairs = ["live->prefill"]\n', "[transplants] pairs",
     "'live->prefill'", "RECIPIENT<-DONOR"),
    (GOOD + '[transplants]\npairs = ["live<-prefill"]\nselections = ["layers=4-2"]\n',
     "[transplants] selections", "'layers=4-2'", "positions=prompt"),
    (GOOD + '[transplants]\npairs = ["live<-prefill"]\ncontrols = -3\n',
     "[transplants] controls", "-3", ">= 0"),
]


@pytest.mark.parametrize("text,key,value,allowed", BAD, ids=[b[1] for b in BAD])
def test_bad_value_names_file_key_value_and_allowed(text, key, value, allowed):
    with pytest.raises(CaseError) as err:
        parse_case(text, "cases/broken.toml")
    message = str(err.value)
    assert message.startswith("cases/broken.toml: ")
    assert f"{key} = {value}" in message and "allowed: " in message
    assert allowed in message.split("allowed: ", 1)[1]


def test_unknown_key_lists_the_allowed_keys():
    with pytest.raises(CaseError, match=r"cases/x.toml: unknown key \[stacks\] 'dtype'; "
                                        r"allowed: .*dtypes"):
        parse_case(edited('dtypes = ["fp32"]', 'dtype = ["fp32"]'), "cases/x.toml")
    with pytest.raises(CaseError, match=r"unknown key 'modle'; allowed: .*model"):
        parse_case("modle = 1\n" + GOOD, "cases/x.toml")


def test_missing_table_key_and_bad_toml():
    with pytest.raises(CaseError, match=r"cases/x.toml: missing table \[items\]"):
        parse_case(GOOD.replace('[items]\nset = "arith"\nn = 5\n', ""), "cases/x.toml")
    with pytest.raises(CaseError, match=r"cases/x.toml: missing key B"):
        parse_case(GOOD.replace("B = 4\n", ""), "cases/x.toml")
    with pytest.raises(CaseError, match=r"cases/x.toml: not valid TOML"):
        parse_case("B = [", "cases/x.toml")
    with pytest.raises(CaseError, match=r"nowhere.toml: cannot read"):
        load_case("nowhere.toml")


def test_an_empty_list_is_refused():
    with pytest.raises(CaseError, match=r"\[replicas\] arms = \[\] is not allowed; allowed: a "
                                        r"non-empty list of strings"):
        parse_case(GOOD + "[replicas]\narms = []\n", "cases/x.toml")


def test_ignore_eos_reaches_the_plan_and_must_be_a_boolean():
    assert parse_case("ignore_eos = true\n" + GOOD, "c.toml").plan(0).ignore_eos
    assert not parse_case(GOOD, "c.toml").plan(0).ignore_eos
    with pytest.raises(CaseError, match="ignore_eos"):
        parse_case('ignore_eos = "yes"\n' + GOOD, "c.toml")


def test_plans_replicas_stacks_and_controls():
    case = parse_case(GOOD.replace('dtypes = ["fp32"]', 'dtypes = ["fp32", "bf16"]')
                      .replace('backends = ["sdpa"]', 'backends = ["sdpa", "eager"]')
                      + '[replicas]\narms = ["prefill"]\nitems = 2\n'
                      + '[transplants]\npairs = ["live<-prefill", "prefill<-live"]\n'
                        'selections = ["all", "keys"]\ncontrols = 2\nseed = 7\n', "c.toml")
    assert [s.label for s in case.stacks] == ["sdpa/fp32@t1", "sdpa/bf16@t1", "eager/fp32@t1",
                                              "eager/bf16@t1"]
    assert all(s.threads == 1 for s in case.stacks)
    assert case.plan(1).replicas == ("prefill",) and case.plan(2).replicas == ()
    assert [t.label for t in case.plan(0).transplants] == [
        "live<-prefill:all", "live<-prefill:keys", "prefill<-live:all", "prefill<-live:keys"]
    controls = case.transplants.control_indices(5)
    assert controls == case.transplants.control_indices(5) and len(controls) == 2
    assert case.design()["control_indices"] == list(controls)
    assert case.with_item_count(3).design()["units"] == 12
    assert case.sha == parse_case(case.text, "elsewhere.toml").sha


def test_items_n_is_optional_for_a_jsonl_set_only(tmp_path):
    lines = tmp_path / "items.jsonl"
    lines.write_text("".join(f'{{"prompt": "p{i}", "answer": {i}}}\n\n' for i in range(3)))
    jsonl = edited('set = "arith"\nn = 5\n', f'set = "jsonl:{lines}"\n')
    assert parse_case(jsonl, "cases/x.toml").items.n == 3      # every item of the file
    assert parse_case(jsonl.replace("\n[stacks]", "n = 2\n[stacks]")).items.n == 2
    lines.unlink()          # a stored run is not counted again from its file
    assert parse_case(jsonl, "stored", item_count=3).items.n == 3
    with pytest.raises(CaseError, match=r"cases/x.toml: \[items\] set = 'jsonl:.*cannot read"):
        parse_case(jsonl, "cases/x.toml")
    with pytest.raises(CaseError, match=r"cases/x.toml: missing key \[items\] n \(.*generated"):
        parse_case(edited("n = 5\n", ""), "cases/x.toml")
    lines.write_text("")
    with pytest.raises(CaseError, match=r"\[items\] n = 0 is not allowed"):
        parse_case(jsonl, "cases/x.toml")
