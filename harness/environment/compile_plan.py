"""What `kvfid compile` compiles: every Triton kernel in each configuration that the cases, the
speed benches and the model presets launch on a GPU, per GPU arch.

A `Target` is plain data: the kernel function (`module:name`), example values for its runtime
arguments, its constexprs and launch options, as the kernel's launcher would pass them on that
arch (tiles from the kernels' own config tables), plus the work of a launch at stated shapes for
the roofline. Example arguments follow Triton's launch-time specialization: an integer equal to 1
becomes a constant, one divisible by 16 carries that hint, tensors are 16-byte aligned. Decode
(one query row, M = 1) and prefill compile to different binaries, so both are targets.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


from kvfid.environment.roofline import Work
from kvfid.kernels import DTYPES, LAUNCH_OPTIONS
from kvfid.kernels.attention import kernel as _attention
from kvfid.kernels.invariant import matmul as _matmul
from kvfid.kernels.invariant import norm as _norm
from kvfid.kernels.invariant import softmax as _softmax

ARCHS = ("sm_80", "sm_90", "sm_100")
_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4}

# (head dim, GQA group): the presets' (SmolLM2 64/3, Qwen2.5-0.5B 64/7, Llama-3.2-1B 64/4), the
# GPU benches' (64/7, 128/4), and MHA and group 8 at both head dims.
ATTENTION_SHAPES = ((64, 1), (64, 3), (64, 4), (64, 7), (64, 8), (128, 1), (128, 4), (128, 7),
                    (128, 8))
QUICK_SHAPES = ((64, 7),)  # `--quick`: the GPU default case's model (Qwen2.5-0.5B shape) only
DECODE_BATCH, CONTEXT = 32, 1024  # roofline shape of a decode step (GPU benches: B 1/32, 1k/8k)
PREFILL = 2048  # tokens of a prefill (GPU benches)
LONG_CONTEXT = 32768  # the long-context decode of the split path (B=1)
LONG_SHAPES = ((64, 7), (128, 4))  # Qwen2.5-0.5B-like and Llama-3-8B-like heads (2 KV heads here)
HIDDEN = 4096  # matmul K = N, row-op width (GPU benches)
ROW_WIDTHS = {"mean": HIDDEN, "rms_norm": HIDDEN, "softmax": 8192, "log_softmax": 32768}


@dataclass(frozen=True)
class Target:
    """One kernel configuration compiled for one arch."""

    kernel: str  # attention, matmul, mean, rms_norm, softmax, log_softmax
    function: str  # module:name of the @triton.jit function
    arch: str
    dtype: str
    config: str  # what distinguishes this configuration, e.g. "decode-D64-G7"
    args: dict  # runtime argument -> example int/float, or "*<dtype>" for a tensor
    constexprs: dict
    options: dict  # num_warps, num_stages and kvfid.kernels.LAUNCH_OPTIONS
    tensor_cores: bool  # its products must run on tensor cores
    work: tuple[Work, ...] = field(default=())

    @property
    def name(self) -> str:
        """`kernel-arch-dtype-config`: the cubin's file name."""
        return f"{self.kernel}-{self.arch}-{self.dtype}-{self.config}"


def _options(num_warps: int, num_stages: int) -> dict:
    return {"num_warps": num_warps, "num_stages": num_stages, **LAUNCH_OPTIONS}


def _contiguous_strides(*shape: int) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= size
    return strides


# The mechanisms of 2025-26 decoders, each at one model's shape: (config label, q/k head dim,
# v head dim, group, window, chunk, softcap, sinks). Mistral 7B (window 4096), Gemma 2 9B (head
# dim 256, window 4096, softcap 50), Gemma 3 4B (256, window 1024), gpt-oss (64, group 8, window
# 128, sinks), DeepSeek-V3 MLA as transformers runs it (q/k 192, v 128, MHA), Llama 4 (chunk 8192).
ATTENTION_VARIANTS = (
    ("window-D128-G4", 128, 128, 4, 4096, None, None, False),
    ("window-softcap-D256-G2", 256, 256, 2, 4096, None, 50.0, False),
    ("window-D256-G2", 256, 256, 2, 1024, None, None, False),
    ("window-sinks-D64-G8", 64, 64, 8, 128, None, None, True),
    ("mla-D192-V128-G1", 192, 128, 1, None, None, None, False),
    ("chunk-D128-G5", 128, 128, 5, None, 8192, None, False),
)
QUICK_VARIANTS = ()  # `--quick` (what `make test` runs) compiles the base shapes only


def _attention_target(arch: str, dtype: str, phase: str, label: str, head_dim: int, v_dim: int,
                      group: int, window=None, chunk=None, softcap=None, sinks=False,
                      merge=False, batch=None, context=CONTEXT, prefill=PREFILL) -> Target:
    """The attention kernel for one phase (decode, prefill, padded prefill) of one shape, as the
    launcher runs it there: split when its keys reach past the first segment, else unsplit;
    `merge`: the split path's merge launch of it (its work: the segment states it reads)."""
    config = _attention.config_table(max(head_dim, v_dim))[(arch, DTYPES[dtype])]
    size = _SIZE[dtype]
    n_kv = 2
    batch = batch or (DECODE_BATCH if phase == "decode" else 1)
    n_q, q_len = n_kv * group, 1 if phase == "decode" else prefill
    kv_len = context if phase == "decode" else prefill
    local = min(x for x in (window, chunk, kv_len) if x is not None)  # keys a query sees at most
    # A window cache holds the last window - 1 keys and the query: held key 0 is not at 0.
    held, key_start = (min(kv_len, local), 4 * local + 1) if window and phase == "decode" else (kv_len, 0)
    if not split_at(config, key_start, held):
        config = _attention.unsplit(config)
    group_tile = _attention.group_tile_for(group, config)
    q_strides = _contiguous_strides(batch, n_q, q_len, head_dim)
    args = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "o_ptr": f"*{dtype}",
            **dict(zip(("sqb", "sqh", "sqt", "sqd"), q_strides)),
            **dict(zip(("skb", "skh", "skt", "skd"), _contiguous_strides(batch, n_kv, held, head_dim))),
            **dict(zip(("svb", "svh", "svt", "svd"), _contiguous_strides(batch, n_kv, held, v_dim))),
            **dict(zip(("sob", "soh", "sot", "sod"), _contiguous_strides(batch, n_q, q_len, v_dim))),
            "pad_ptr": "*i64", "sink_ptr": "*fp32",
            "ws_m_ptr": "*fp32", "ws_l_ptr": "*fp32", "ws_acc_ptr": "*fp32",
            "n_slots": max(2, _attention._segment_slots(config, held, window, chunk)),
            "n_kv_heads": n_kv, "n_group_chunks": -(-group // group_tile), "q_len": q_len,
            "kv_len": held, "key_start": key_start,
            "window": window or _attention.NO_WINDOW, "chunk": chunk or 0,
            "scale": 0.125, "softcap": float(softcap or 1.0)}
    # `padded`: a left-padded prefill (a co-batched row), each row on its own positions.
    constexprs = {"GROUP": group, "GROUP_TILE": group_tile, "HEAD_DIM": head_dim,
                  "HEAD_DIM_PAD": _attention.head_dim_pad(head_dim), "V_DIM": v_dim,
                  "V_DIM_PAD": _attention.head_dim_pad(v_dim), "BLOCK_M": _attention.BLOCK_M,
                  "BLOCK_N": config.block_n, "USE_DOT": config.use_dot, "PADDED": phase == "padded",
                  "SOFTCAP": softcap is not None, "SINKS": sinks, "SEGMENT": config.segment,
                  "MERGE": merge, "ALIGN_OWN": True, "ALIGN_ABSOLUTE": True}
    qo_bytes = batch * n_q * q_len * (head_dim + v_dim) * size
    kv_bytes = batch * n_kv * held * (head_dim + v_dim) * size
    # Query-key pairs each query sees (causal, within its window or chunk).
    pairs = q_len * min(held, local) if phase == "decode" else sum(
        min(t + 1, local) for t in range(q_len)) if local < kv_len else q_len * (q_len + 1) // 2
    work = Work(f"{phase} B{batch} Hq{n_q} Hkv{n_kv} Tq{q_len} Tk{held}"
                + (f" window {window}" if window else "") + (f" chunk {chunk}" if chunk else ""),
                qo_bytes + kv_bytes, 2 * batch * n_q * pairs * (head_dim + v_dim))
    if merge:  # the real query rows' segment states (at most n_slots each), fp32 m, l, acc
        states = batch * n_q * q_len * args["n_slots"] * (v_dim + 2) * 4
        work = Work(f"merge of {work.label}", states + batch * n_q * q_len * v_dim * size,
                    3 * states // 4)
    return Target("attention", "kvfid.kernels.attention.kernel:_attention_kernel", arch, dtype,
                  f"{phase}{'-merge' if merge else ''}-{label}", args, constexprs,
                  _options(**_attention.merge_launch(_attention.head_dim_pad(v_dim),
                                                   group_tile * _attention.BLOCK_M)) if merge
                  else _options(config.num_warps, config.num_stages), dtype != "fp32" and not merge,
                  (work,))


def split_at(config, key_start: int, held: int) -> bool:
    """Whether the launcher takes the split path for a call over these keys (the unsplit launch
    when every key lies in the first segment: kvfid.kernels.attention.kernel.attention_into)."""
    return config.segment > 0 and key_start + held > config.segment


def attention_targets(arch: str, dtype: str, shapes=ATTENTION_SHAPES,
                      variants=ATTENTION_VARIANTS, prefill=PREFILL) -> list[Target]:
    """The attention kernel at every (head dim, group) of `shapes` for decode, prefill and padded
    prefill (`prefill` tokens), and every mechanism variant for decode and prefill; each split
    one with its merge launch."""
    specs = [(phase, f"D{head_dim}-G{group}", head_dim, head_dim, group, None, None, None, False)
             for (head_dim, group), phase in itertools.product(shapes, ("decode", "prefill", "padded"))]
    specs += [(phase, *variant) for variant, phase in itertools.product(variants, ("decode", "prefill"))]
    out = []
    for phase, *spec in specs:
        target = _attention_target(arch, dtype, phase, *spec, prefill=prefill)
        out.append(target)
        if target.constexprs["SEGMENT"]:  # the split path: its merge launch too
            out.append(_attention_target(arch, dtype, phase, *spec, merge=True, prefill=prefill))
    return out


def long_decode_targets(arch: str, dtype: str) -> list[Target]:
    """B=1 decode at LONG_CONTEXT keys (the split path's case), for its roofline beside the
    unsplit kernel's (docs/gpu.md)."""
    return [_attention_target(arch, dtype, "decode", f"long-D{d}-G{g}", d, d, g, batch=1,
                              context=LONG_CONTEXT, merge=merge)
            for d, g in LONG_SHAPES for merge in (False, True)]


def matmul_targets(arch: str, dtype: str) -> list[Target]:
    """The matmul kernel at each of its M buckets' configs (kvfid.kernels.invariant.matmul.BUCKETS;
    the last is the fixed config every M runs until an arch is in BUCKETS_SHOWN): decode (M = 1)
    with and without bias in every bucket that can serve it, the small bucket's largest M, and a
    prefill (M = PREFILL) with and without bias; each named `<phase>-M<rows>-<BLOCK_M>x<BLOCK_N>`."""
    buckets = _matmul.BUCKETS[(arch, DTYPES[dtype])]
    fixed = buckets[-1][1]
    launches = [(rows, bias, config) for _, config in buckets for rows, bias in ((1, False), (1, True))]
    launches += [(bound, False, config) for bound, config in buckets[:-1]]
    launches += [(PREFILL, False, fixed), (PREFILL, True, fixed)]
    out, size = [], _SIZE[dtype]
    for rows, bias, config in launches:
        phase = "decode" if rows == 1 else "rows" if rows < PREFILL else "prefill"
        # a [M, K] activations, b = w.t() [K, N] (a transposed weight, as nn.Linear passes it).
        args = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": f"*{dtype}",
                "bias_ptr": f"*{dtype}", "M": rows, "N": HIDDEN, "K": HIDDEN,
                "sab": rows * HIDDEN, "sam": HIDDEN, "sak": 1, "sbb": HIDDEN * HIDDEN,
                "sbk": 1, "sbn": HIDDEN, "scb": rows * HIDDEN, "scm": HIDDEN, "scn": 1,
                "s_bias": 1}
        constexprs = {"HAS_BIAS": bias, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
                      "BLOCK_K": config.block_k, "USE_DOT": config.use_dot}
        work = Work(f"{phase} M{rows} K{HIDDEN} N{HIDDEN}",
                    (rows * HIDDEN + HIDDEN * HIDDEN + rows * HIDDEN + bias * HIDDEN) * size,
                    2 * rows * HIDDEN * HIDDEN)
        out.append(Target("matmul", "kvfid.kernels.invariant.matmul:_matmul_kernel", arch, dtype,
                          f"{phase}{'-bias' if bias else ''}-M{rows}-{config.block_m}x{config.block_n}",
                          args, constexprs, _options(config.num_warps, config.num_stages),
                          dtype != "fp32", (work,)))
    return out


def row_targets(arch: str, dtype: str) -> list[Target]:
    """mean (the batch-invariant mode's RMSNorm reduction), rms_norm, softmax and log-softmax,
    at Triton's default launch options (4 warps, 3 stages) unless their launcher sets some."""
    out, size, rows = [], _SIZE[dtype], 2 * DECODE_BATCH  # 64 rows: not specialized like 1
    for kernel in ROW_WIDTHS:
        width = ROW_WIDTHS[kernel]
        if kernel == "mean":
            function, block = "kvfid.kernels.invariant.norm:_mean_kernel", (_norm.BLOCK_ROWS, _norm.BLOCK_COLS)
            args = {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "n_rows": rows,
                    "n_cols": width, "sx_row": width, "sx_col": 1}
            constexprs, flops, writes = {}, rows * width, rows
        elif kernel == "rms_norm":
            function, block = "kvfid.kernels.invariant.norm:_rms_norm_kernel", (_norm.BLOCK_ROWS, _norm.BLOCK_COLS)
            args = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
                    "n_rows": rows, "n_cols": width, "sx_row": width, "sx_col": 1,
                    "so_row": width, "eps": 1e-6}
            constexprs, flops, writes = {"HAS_WEIGHT": True}, 4 * rows * width, rows * width
        else:
            function = "kvfid.kernels.invariant.softmax:_softmax_kernel"
            block = (_softmax.BLOCK_ROWS, _softmax.BLOCK_COLS)
            args = {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "n_rows": rows,
                    "n_cols": width, "sx_row": width, "sx_col": 1, "so_row": width}
            constexprs = {"LOG": kernel == "log_softmax"}
            flops, writes = 5 * rows * width, rows * width
        constexprs.update(BLOCK_ROWS=block[0], BLOCK_COLS=block[1])
        warps = _norm.RMS_NORM_WARPS if kernel == "rms_norm" else 4
        work = Work(f"rows{rows} width{width}", (rows * width + writes) * size, flops)
        out.append(Target(kernel, function, arch, dtype, f"W{width}", args, constexprs,
                          _options(warps, 3), False, (work,)))
    return out


KERNELS = ("attention", "matmul", *ROW_WIDTHS)


def visible_targets(arch: str, dtype: str) -> list[Target]:
    """The visibility-mask kernel (kvfid.kernels.attention.visible) at each of LONG_SHAPES' (head dim,
    group), decode and prefill strides: it has no split path and no per-phase constexprs, so one
    binary per (head dim, group, dtype) serves every call."""
    out = []
    for head_dim, group in LONG_SHAPES:
        config = _attention.config_table(head_dim)[(arch, DTYPES[dtype])]
        group_tile = _attention.group_tile_for(group, config)
        n_kv = 2
        for phase, batch, q_len in (("decode", DECODE_BATCH, 1), ("prefill", 1, PREFILL)):
            kv_len = PREFILL
            args = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}",
                    "o_ptr": f"*{dtype}", "plan_ptr": "*i64", "keys_ptr": "*i64",
                    "sink_ptr": "*fp32", "n_kv_heads": n_kv,
                    "n_group_chunks": -(-group // group_tile), "per_row": 7,
                    "scale": 0.125, "softcap": 1.0}
            for name, shape in (("q", (batch, n_kv * group, q_len, head_dim)),
                                ("k", (batch, n_kv, kv_len, head_dim)),
                                ("v", (batch, n_kv, kv_len, head_dim)),
                                ("o", (batch, n_kv * group, q_len, head_dim))):
                args.update(zip((f"s{name}b", f"s{name}h", f"s{name}t", f"s{name}d"),
                                _contiguous_strides(*shape)))
            constexprs = {"GROUP": group, "GROUP_TILE": group_tile, "HEAD_DIM": head_dim,
                          "HEAD_DIM_PAD": _attention.head_dim_pad(head_dim), "V_DIM": head_dim,
                          "V_DIM_PAD": _attention.head_dim_pad(head_dim),
                          "BLOCK_M": _attention.BLOCK_M, "BLOCK_N": config.block_n,
                          "USE_DOT": config.use_dot, "SOFTCAP": False, "SINKS": False}
            size, n_q = _SIZE[dtype], n_kv * group
            pairs = q_len * kv_len if q_len == 1 else q_len * (q_len + 1) // 2  # every key visible
            work = Work(f"visible {phase} B{batch} Hq{n_q} Hkv{n_kv} Tq{q_len} Tk{kv_len} (all seen)",
                        batch * (n_q * q_len + n_kv * kv_len) * 2 * head_dim * size,
                        2 * batch * n_q * pairs * 2 * head_dim)
            out.append(Target("attention", "kvfid.kernels.attention.visible:_visible_kernel", arch, dtype,
                              f"visible-{phase}-D{head_dim}-G{group}", args, constexprs,
                              _options(config.num_warps, config.num_stages), dtype != "fp32",
                              (work,)))
    return out


def plan(archs=ARCHS, dtypes=tuple(DTYPES), kernels=None, quick=False) -> list[Target]:
    """Every target for the given archs and dtypes (optionally only some kernels; `quick`: the
    attention shapes of the GPU default case only); ValueError names an unknown one."""
    for kind, given, allowed in (("arch", archs, ARCHS), ("dtype", dtypes, tuple(DTYPES)),
                                 ("kernel", kernels or (), KERNELS)):
        unknown = [x for x in given if x not in allowed]
        if unknown:
            raise ValueError(f"unknown {kind} {', '.join(unknown)}; valid: {', '.join(allowed)}")
    shapes = QUICK_SHAPES if quick else ATTENTION_SHAPES
    variants = tuple(v for v in ATTENTION_VARIANTS if not quick or v[0] in QUICK_VARIANTS)
    # `quick`: the default case's prompts lie in the first key segment, so its prefills run
    # unsplit (a CONTEXT-token prefill stands for them).
    prefill = CONTEXT if quick else PREFILL
    targets = [t for arch, dtype in itertools.product(archs, dtypes)
               for t in (*attention_targets(arch, dtype, shapes, variants, prefill),
                         *(() if quick else long_decode_targets(arch, dtype)),
                         *(() if quick else visible_targets(arch, dtype)),
                         *matmul_targets(arch, dtype),
                         *row_targets(arch, dtype))]
    return [t for t in targets if kernels is None or t.kernel in kernels]
