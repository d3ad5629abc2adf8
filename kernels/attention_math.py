"""The attention kernel's elementwise pieces, one definition each so every path runs the same
arithmetic: tanh for softcapping, the merge of two partial softmax states, the sink."""

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh from one exp, the same arithmetic on every path: sign(x) (1 - e) / (1 + e), e = exp(-2|x|)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
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


@triton.jit
def with_sink(m, l, acc, sink):
    """Add a sink logit [ROWS] to the softmax denominator of a finished state (split path)."""
    m_f = tl.maximum(m, sink)
    a = tl.exp(m - m_f)
    return l * a + tl.exp(sink - m_f), acc * a[:, None]
