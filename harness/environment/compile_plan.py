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


from harness.environment.roofline import Work
from kernels import DTYPES, LAUNCH_OPTIONS
from kernels import attention as _attention
from kernels import matmul as _matmul
from kernels import norm as _norm
from kernels import softmax as _softmax

ARCHS = ("sm_80", "sm_90", "sm_100")
_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4}

# (head dim, GQA group): the presets' (SmolLM2 64/3, Qwen2.5-0.5B 64/7, Llama-3.2-1B 64/4), the
# GPU benches' (64/7, 128/4), and MHA and group 8 at both head dims.
ATTENTION_SHAPES = ((64, 1), (64, 3), (64, 4), (64, 7), (64, 8), (128, 1), (128, 4), (128, 7),
                    (128, 8))
QUICK_SHAPES = ((64, 7),)  # `--quick`: the GPU default case's model (Qwen2.5-0.5B shape) only
DECODE_BATCH, CONTEXT = 32, 1024  # roofline shape of a decode step (GPU benches: B 1/32, 1k/8k)
PREFILL = 2048  # tokens of a prefill (GPU benches)
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
    options: dict  # num_warps, num_stages and kernels.LAUNCH_OPTIONS
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


def attention_targets(arch: str, dtype: str, shapes=ATTENTION_SHAPES) -> list[Target]:
    """The attention kernel at every (head dim, group) of `shapes`, for decode and prefill."""
    config = _attention.CONFIGS[(arch, DTYPES[dtype])]
    out, size = [], _SIZE[dtype]
    for (head_dim, group), phase in itertools.product(shapes, ("decode", "prefill", "padded")):
        batch, n_kv = (DECODE_BATCH, 2) if phase == "decode" else (1, 2)
        n_q, q_len = n_kv * group, 1 if phase == "decode" else PREFILL
        group_tile = _attention.group_tile_for(group, config)
        q_strides = _contiguous_strides(batch, n_q, q_len, head_dim)
        kv_strides = _contiguous_strides(batch, n_kv, CONTEXT if phase == "decode" else PREFILL,
                                         head_dim)
        kv_len = CONTEXT if phase == "decode" else PREFILL
        args = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}",
                "o_ptr": f"*{dtype}",
                **dict(zip(("sqb", "sqh", "sqt", "sqd"), q_strides)),
                **dict(zip(("skb", "skh", "skt", "skd"), kv_strides)),
                **dict(zip(("svb", "svh", "svt", "svd"), kv_strides)),
                **dict(zip(("sob", "soh", "sot", "sod"), q_strides)),
                "pad_ptr": "*i64",
                "n_kv_heads": n_kv, "n_group_chunks": -(-group // group_tile), "q_len": q_len,
                "kv_len": kv_len, "scale": 0.125}
        # `padded`: a left-padded prefill (a co-batched row), each row on its own positions.
        constexprs = {"GROUP": group, "GROUP_TILE": group_tile, "HEAD_DIM": head_dim,
                      "HEAD_DIM_PAD": _attention.head_dim_pad(head_dim),
                      "BLOCK_M": _attention.BLOCK_M, "BLOCK_N": config.block_n,
                      "USE_DOT": config.use_dot, "PADDED": phase == "padded", "ALIGN_OWN": True}
        qo_bytes = 2 * batch * n_q * q_len * head_dim * size
        kv_bytes = 2 * batch * n_kv * kv_len * head_dim * size
        pairs = q_len * kv_len if phase == "decode" else q_len * (q_len + 1) // 2  # causal
        work = Work(f"{phase} B{batch} Hq{n_q} Hkv{n_kv} Tq{q_len} Tk{kv_len}",
                    qo_bytes + kv_bytes, 4 * batch * n_q * pairs * head_dim)
        out.append(Target("attention", "kernels.attention:_attention_kernel", arch, dtype,
                          f"{phase}-D{head_dim}-G{group}", args, constexprs,
                          _options(config.num_warps, config.num_stages),
                          dtype != "fp32", (work,)))
    return out


def matmul_targets(arch: str, dtype: str) -> list[Target]:
    """The matmul kernel with and without bias, for decode (M = 1) and prefill."""
    config = _matmul.CONFIGS[(arch, DTYPES[dtype])]
    out, size = [], _SIZE[dtype]
    for bias, rows in itertools.product((False, True), (1, PREFILL)):
        phase = "decode" if rows == 1 else "prefill"
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
        out.append(Target("matmul", "kernels.matmul:_matmul_kernel", arch, dtype,
                          f"{phase}{'-bias' if bias else ''}", args, constexprs,
                          _options(config.num_warps, config.num_stages), dtype != "fp32",
                          (work,)))
    return out


def row_targets(arch: str, dtype: str) -> list[Target]:
    """mean (the batch-invariant mode's RMSNorm reduction), rms_norm, softmax and log-softmax,
    at Triton's default launch options (4 warps, 3 stages) unless their launcher sets some."""
    out, size, rows = [], _SIZE[dtype], 2 * DECODE_BATCH  # 64 rows: not specialized like 1
    for kernel in ROW_WIDTHS:
        width = ROW_WIDTHS[kernel]
        if kernel == "mean":
            function, block = "kernels.norm:_mean_kernel", (_norm.BLOCK_ROWS, _norm.BLOCK_COLS)
            args = {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "n_rows": rows,
                    "n_cols": width, "sx_row": width, "sx_col": 1}
            constexprs, flops, writes = {}, rows * width, rows
        elif kernel == "rms_norm":
            function, block = "kernels.norm:_rms_norm_kernel", (_norm.BLOCK_ROWS, _norm.BLOCK_COLS)
            args = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
                    "n_rows": rows, "n_cols": width, "sx_row": width, "sx_col": 1,
                    "so_row": width, "eps": 1e-6}
            constexprs, flops, writes = {"HAS_WEIGHT": True}, 4 * rows * width, rows * width
        else:
            function = "kernels.softmax:_softmax_kernel"
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


def plan(archs=ARCHS, dtypes=tuple(DTYPES), kernels=None, quick=False) -> list[Target]:
    """Every target for the given archs and dtypes (optionally only some kernels; `quick`: the
    attention shapes of the GPU default case only); ValueError names an unknown one."""
    for kind, given, allowed in (("arch", archs, ARCHS), ("dtype", dtypes, tuple(DTYPES)),
                                 ("kernel", kernels or (), KERNELS)):
        unknown = [x for x in given if x not in allowed]
        if unknown:
            raise ValueError(f"unknown {kind} {', '.join(unknown)}; valid: {', '.join(allowed)}")
    shapes = QUICK_SHAPES if quick else ATTENTION_SHAPES
    targets = [t for arch, dtype in itertools.product(archs, dtypes)
               for t in (*attention_targets(arch, dtype, shapes), *matmul_targets(arch, dtype),
                         *row_targets(arch, dtype))]
    return [t for t in targets if kernels is None or t.kernel in kernels]
