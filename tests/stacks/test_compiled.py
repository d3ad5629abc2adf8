"""The `+compile` stack option: parsing, refusals before compute, the case-file key, the units
`kvfid blame` compiles one by one, and one compiled run through the protocol."""

import pytest

from kvfid.stacks.stack import Stack, StackUnavailable, check_supports, parse_stack
from kvfid.stacks.compiled import units
from kvfid.runs.case import load_case
from kvfid.runs.case_fields import CaseError
from protocol_fixtures import PROMPT, small, tiny


def test_the_compile_option_is_part_of_the_stack_label():
    stack = parse_stack("eager/bf16+bi+compile@t1")
    assert (stack.backend, stack.batch_invariant, stack.compiled, stack.threads) == ("eager", True, True, 1)
    assert stack.label == "eager/bf16+bi+compile@t1"
    assert parse_stack(stack.label) == stack
    assert stack.with_dtype("fp32").label == "eager/fp32+bi+compile@t1"
    assert parse_stack("sdpa/bf16").compiled is False


def test_compiling_the_interpreted_triton_kernel_is_refused_before_compute(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(StackUnavailable, match="needs CUDA"):
        check_supports(Stack("triton", "bf16", True, compiled=True), tiny())


def test_a_case_expands_and_checks_its_compile_list(tmp_path):
    text = ('name = "c"\nmodel = "tiny-llama"\nB = 4\nS = 4\n[items]\nset = "arith"\nn = 1\n'
            '[stacks]\nbackends = ["eager"]\ndtypes = ["bf16"]\nthreads = 1\n')
    good = tmp_path / "good.toml"
    good.write_text(text + "compile = [false, true]\n")
    assert [s.label for s in load_case(good).stacks] == ["eager/bf16@t1", "eager/bf16+compile@t1"]
    bad = tmp_path / "bad.toml"
    bad.write_text(text + 'compile = "yes"\n')
    with pytest.raises(CaseError, match="compile"):
        load_case(bad)


def test_blame_compiles_each_child_of_a_decoder_layer_and_the_leaves_outside_them():
    module = tiny().cast(Stack().torch_dtype, "cpu")
    names = [name for name, _ in units(module)]
    layers = module.config.num_hidden_layers
    assert sum(name.endswith(".self_attn") for name in names) == layers
    assert sum(name.endswith(".mlp") for name in names) == layers
    assert "lm_head" in names and not any(name.endswith(".q_proj") for name in names)


@pytest.mark.slow
def test_a_compiled_stack_runs_every_arm_and_restores_the_eager_forward(serving_run):
    """What holds on any machine: the compiled forward is deterministic (a replica is bit-exact)
    and live ~ incremental feeds the same shapes (the bridge is bit-exact); whether prefill is
    bit-exact compiled is a finding per machine, so it is reported, not asserted. The run is the
    session's serving run (conftest.SERVING_CASE: a one-layer model, the compiled stack on one
    item)."""
    from kvfid.ledger.store import Ledger

    db, run_id = serving_run
    with Ledger(db) as ledger:
        (record,) = [u.record for u in ledger.units(run_id) if u.stack.endswith("+compile@t1")]
    assert record.stack["label"] == "eager/bf16+bi+compile@t1"
    assert {"incremental", "prefill"} <= {c.b for c in record.comparisons if c.a == "live"}
    assert record.against_live("incremental").cache.bit_exact
    assert record.replicas[0].comparison.cache.bit_exact
    assert "forward" not in small(layers=1).cast(Stack().torch_dtype, "cpu").__dict__


def test_compiling_the_native_kernel_is_refused_in_one_line_before_compute():
    """Measured on tiny-llama (torch 2.13): the wrapper's host reads graph-break every layer and
    transformers' shared decorated frame passes dynamo's recompile limit, so part of a
    `native+compile` forward would run eagerly; refused (exit 3) before any model loads."""
    from click.testing import CliRunner

    from kvfid.cli import main

    with pytest.raises(StackUnavailable, match="recompile_limit"):
        check_supports(Stack("native", "bf16", True, compiled=True), tiny())
    result = CliRunner().invoke(main, ["repro", "--model", "tiny-llama", "--backend", "native",
                                       "--batch-invariant", "--compile", "--prompt", "hi"])
    assert result.exit_code == 3, result.output
    errors = [line for line in result.output.splitlines() if line.strip()]
    assert len(errors) == 1 and "cannot be compiled whole" in errors[0], result.output
    assert check_supports(Stack("native", "bf16", True), tiny()) is None   # eagerly it runs


def test_blame_names_the_layer_when_units_agree_alone_but_not_compiled_whole():
    from kvfid.diagnoses.blame import BlameResult, render

    result = BlameResult("incremental (prompt prefill)", "prefill", 19, 1,
                         whole_forward={"layer": 0, "part": "k", "module": "model.layers.0",
                                        "first_position": 1})
    text = render(result, "eager/bf16+bi+compile@t1")
    assert "compiled whole, not alone" in text and "model.layers.0 (layer 0, K, position 1)" in text
    assert "no culprit among aligned ops" not in text
    assert result.to_json()["whole_forward"]["module"] == "model.layers.0"


@pytest.mark.slow
@pytest.mark.xdist_group("serving_run")   # inductor's caches warm (tests/conftest.py)
def test_blame_under_compile_names_a_module_wherever_the_compiled_states_differ():
    """Whether the compiled stack is bit-exact is a finding per machine; where it is not, blame
    names a compiled unit as culprit or, when every unit agrees alone, the decoder layer whose
    state first differs compiled whole. On the serving fixture's one-layer model and stack, so
    the whole forward's graphs are in inductor's cache already; that every unit stays
    compiled past dynamo's recompile limit is the next test's."""
    from kvfid.diagnoses.blame_command import blame_item

    model = small(layers=1)
    prompt = model.codec.prompt_ids(PROMPT.prompt)
    result, first = blame_item(model, Stack("eager", "bf16", True, threads=1, compiled=True),
                               prompt, 4)
    names = {name for name, _ in units(model.cast(Stack().torch_dtype, "cpu"))}
    if first is None:
        assert not result.culprits and result.whole_forward is None
        return
    named = [op.module for op in result.culprits] or [result.whole_forward["module"]]
    assert all(name in names or name.startswith("model.layers.") for name in named), named


def _units_traced(monkeypatch, limits=None) -> list[str]:
    """The one-layer model's prompt and one decode step on eager/bf16+bi with each unit compiled
    alone (`compiled.trace_units`), dynamo failing where a frame passes its recompile limit
    instead of running it eagerly, and that limit held to 1 entry a frame outside
    compiled_units: a deep model's, at this depth (measured with dynamo's own 8: the five-layer
    model's attention passes it, the four-layer one's does not). Dynamo counts its cache entries
    whatever compiles the graphs, so its `eager` backend stands in for inductor (no C++ to
    compile). `limits`: in place of the ones compiled_units sets. The units reported, in call
    order."""
    import functools

    import torch

    from kvfid.protocol.decode import Runner, as_batch, new_cache
    from kvfid.stacks import compiled

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    if limits is not None:
        monkeypatch.setattr(compiled, "unit_limits", lambda count: limits)
    model = small(layers=1)
    prompt = model.codec.prompt_ids(PROMPT.prompt)
    seen = []
    with Stack("eager", "bf16", True, threads=1).activate(model) as module:
        runner, cache = Runner(module), new_cache(module)

        def run():
            logits, cached = runner.forward(as_batch(prompt), cache)
            runner.forward(as_batch([int(logits[0].argmax())]), cached)

        compiled.trace_units(module, run, lambda name, *_: seen.append(name))
    return seen


def test_each_unit_compiled_alone_stays_compiled_past_dynamos_recompile_limit(monkeypatch):
    """Each unit is called at two shapes (a prompt, a decode step); a layer's units key dynamo's
    entries by their layer (the attention's cache index), so a deep model passes dynamo's
    recompile limit in a frame its units share, and its later units would run eagerly,
    unreported as compiled. compiled_units raises the limits for its block; control: at the
    limits outside it the same run passes them."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    names = {name for name, _ in units(small(layers=1).cast(Stack().torch_dtype, "cpu"))}
    seen = _units_traced(monkeypatch)
    assert set(seen) == names and len(seen) == 2 * len(names), seen
    with pytest.raises(FailOnRecompileLimitHit):
        _units_traced(monkeypatch, limits={})


def _graphs_compiled(monkeypatch) -> int:
    """Graphs dynamo compiles for the one-layer model's compiled stack over a prompt and three
    decode steps: on the cache as the model left it, on it laid out as a compiled prefill leaves
    it, and on it in torch's default strides (as kvfid's state copies and eager updates lay
    it out). A counting backend stands in for inductor (dynamo's guards and graphs are the same;
    no C++ to compile)."""
    import functools

    import torch

    from kvfid.protocol.decode import Runner, as_batch, new_cache

    graphs = []

    def counting(gm, example_inputs, **options):   # options: inductor's (INDUCTOR_OPTIONS)
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counting))
    model = small(layers=1)
    prompt = model.codec.prompt_ids(PROMPT.prompt)
    with Stack("eager", "bf16", True, threads=1, compiled=True).activate(model) as module:
        runner, cached = Runner(module), new_cache(module)
        logits, cached = runner.forward(as_batch(prompt), cached)
        logits, cached = runner.forward(as_batch([int(logits[0].argmax())]), cached)
        token = int(logits[0].argmax())
        (layer,) = cached.cache.layers
        for copy in (projected, default):
            layer.keys, layer.values = copy(layer.keys), copy(layer.values)
            _, cached = runner.forward(as_batch([token]), cached)
    return len(graphs)


def projected(t):
    """t [B, H, T, D] laid out in memory as [B, T, H, D], as a compiled prefill into an empty
    cache leaves it (the key projection's transposed view)."""
    import torch

    _, heads, length, dim = t.shape
    strides = (length * heads * dim, dim, heads * dim, 1)
    return torch.empty_strided(t.shape, strides, dtype=t.dtype).copy_(t)


def default(t):
    """t in torch's default strides, as kvfid's state copies lay it out."""
    import torch

    return t.clone(memory_format=torch.contiguous_format)


def test_a_compiled_stack_compiles_one_graph_per_call_shape_whatever_the_cache_layout(monkeypatch):
    """Dynamo guards on the cache tensors' strides (size-1 dims too): unless the compiled stack
    puts the cache in default strides before each call, a decode step on a cache laid out as a
    compiled prefill leaves it and one laid out as a state copy compile apart (control).
    Two graphs: the prompt's and the decode step's."""
    from kvfid.stacks import compiled

    assert _graphs_compiled(monkeypatch) == 2
    monkeypatch.setattr(compiled, "default_layout", lambda cache: None)
    assert _graphs_compiled(monkeypatch) == 3   # control: the projected layout compiles again


def test_inductor_caches_are_kept_apart_per_cpu_capability(monkeypatch, tmp_path):
    """Inductor picks its vector ISA from ATEN_CPU_CAPABILITY but does not key its caches by it (a
    compiled stack run under the AVX2 stand-in, then without it on the same default cache,
    aborted the process: harness/stacks/compiled.py): a compiled stack compiles into a folder of
    the capability's, restores the variable after it, and keeps a folder the user chose."""
    import os

    import torch
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    from kvfid.stacks import compiled

    own = os.path.join(default_cache_dir(), f"cpu-{torch.backends.cpu.get_cpu_capability()}")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with Stack("eager", "bf16", True, threads=1, compiled=True).activate(small(layers=1)):
        assert cache_dir() == own
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())   # inductor's, once used
    with compiled.capability_cache() as folder:
        assert folder == own == cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))           # the user's
    with compiled.capability_cache() as folder:
        assert folder == str(tmp_path) == cache_dir()
