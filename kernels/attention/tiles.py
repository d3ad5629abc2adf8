"""The attention kernel's elementwise pieces, one definition each so every path runs the same
arithmetic: tanh for softcapping, one key tile's scores and its online-softmax update, the merge
of two partial softmax states, the sink."""

import triton.language as tl

from kvfid.kernels.dot import mma
from kvfid.kernels.jit import device_function


@device_function
def tanh(x):
    """tanh from one exp, the same arithmetic on every path: sign(x) (1 - e) / (1 + e), e = exp(-2|x|)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@device_function
def merge(m, l, acc, m_s, l_s, acc_s):
    """The softmax state (m, l, acc) of keys A then B from those of A (m, l, acc [ROWS, D]) and
    B (m_s, l_s, acc_s), all fp32. An empty A (m = -inf) takes B's state as it is, bit for bit; an
    empty B leaves A's unchanged (scaled by exactly 1, exactly -0.0 added)."""
    first = m == float("-inf")
    live = m_s > float("-inf")
    m_new = tl.maximum(m, m_s)
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    a = tl.where(live, tl.exp(m - m_use), 1.0)
    b = tl.exp(m_s - m_use)
    l_out = tl.where(first, l_s, l * a + tl.where(live, l_s * b, -0.0))
    acc_out = tl.where(first[:, None], acc_s,
                       acc * a[:, None] + tl.where(live[:, None], acc_s * b[:, None], -0.0))
    return tl.where(first, m_s, m_new), l_out, acc_out


@device_function
def with_sink(m, l, acc, sink):
    """Add a sink logit [ROWS] to the softmax denominator of a finished state (split path)."""
    m_f = tl.maximum(m, sink)
    a = tl.exp(m - m_f)
    return l * a + tl.exp(sink - m_f), acc * a[:, None]


@device_function
def tile_scores(q, k, scale, softcap, SOFTCAP: tl.constexpr, USE_DOT: tl.constexpr,
                ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """[ROWS, BLOCK_N] fp32 scores of q [ROWS, D] against one key tile k [BLOCK_N, D], scaled and
    softcapped: by the tensor-core product on a GPU, else by an fp32 broadcast product reduced with
    `tl.sum` (the interpreter's `tl.dot` bits depend on a row's place in the tile)."""
    if USE_DOT:
        s = mma(q, tl.trans(k), tl.zeros([ROWS, BLOCK_N], tl.float32))
    else:
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    s = s * scale
    if SOFTCAP:
        s = softcap * tanh(s / softcap)
    return s


@device_function
def tile_update(m_i, l_i, acc, s, v, USE_DOT: tl.constexpr):
    """The online softmax state (m_i, l_i [ROWS], acc [ROWS, Dv], fp32) after one key tile:
    s [ROWS, BLOCK_N] scaled scores, -inf where a row does not see the key; v [BLOCK_N, Dv] (fp32
    off the GPU). A row that sees no key here is scaled by exactly 1 and gets exactly -0.0 added:
    x * 1 and x + (-0.0) are x, bit for bit (signed zeros too): its state is unchanged."""
    m_tile = tl.max(s, axis=1)
    live = m_tile > float("-inf")  # the row sees a key of this tile
    m_new = tl.maximum(m_i, m_tile)
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # no inf - inf before its first key
    alpha = tl.where(live, tl.exp(m_i - m_use), 1.0)
    p = tl.exp(s - m_use[:, None])
    l_i = l_i * alpha + tl.where(live, tl.sum(p, axis=1), -0.0)
    if USE_DOT:
        pv = mma(p.to(v.dtype), v, tl.zeros_like(acc))
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    acc = acc * alpha[:, None] + tl.where(live[:, None], pv, -0.0)
    return m_new, l_i, acc
