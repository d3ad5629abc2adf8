"""Cache surgery and comparisons on hand-made states: ULPs, first bad layer, transplants."""

import pytest
import torch

from kvfid.states import cache as kv
from kvfid.states import surgery


def make_state(seed=0, layers=3, heads=2, length=6, dim=4, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    shape = (1, heads, length, dim)   # [1, H_kv, T, D]
    keys = tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(layers))
    values = tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(layers))
    logits = torch.randn(50, generator=g).to(dtype)
    return kv.BoundaryState(tuple(range(length)), keys, values, logits)


def flip_low_bit(t, index):
    """Copy of t with the lowest mantissa bit flipped at `index` (one ULP away)."""
    ints = t.clone().view(torch.int16 if t.element_size() == 2 else torch.int32)
    ints[index] ^= 1
    return ints.view(t.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bits_mean_bits_a_signed_zero_differs_and_agrees_with_the_fingerprint(dtype):
    a = torch.tensor([[[[0.0, 1.0], [2.0, 3.0]]]], dtype=dtype)   # [1, 1, T=2, D=2]
    b = a.clone()
    b[0, 0, 1, 0] = 0.0
    a[0, 0, 1, 0] = -0.0
    assert torch.equal(a, b)   # why raw bits: torch.equal calls -0.0 and +0.0 equal
    diff = kv.tensor_diff(a, b)
    assert not diff.equal and diff.n_diff == 1 and diff.first_position == 1
    assert diff.max_abs == 0.0 and diff.max_ulp == 0 and diff.max_abs_rel == 0.0
    assert kv.sha_tensor(a) != kv.sha_tensor(b)
    same = kv.tensor_diff(a, a.clone())
    assert same.equal and kv.sha_tensor(a) == kv.sha_tensor(a.clone())


def test_nan_payloads_count_as_bits():
    a = torch.tensor([float("nan"), 1.0])
    b = a.clone()
    b.view(torch.int32)[0] ^= 1   # another NaN payload
    assert torch.isnan(b[0]) and not kv.bits_equal(a, b) and kv.bits_equal(a, a.clone())
    assert kv.tensor_diff(a[None, None, :, None], b[None, None, :, None]).n_diff == 1
    assert not kv.compare_logits(a, b).equal


def test_max_abs_rel_stays_small_where_ulps_explode_through_zero():
    a = torch.tensor([[[[1e-30], [4.0]]]])
    b = torch.tensor([[[[-1e-30], [4.0]]]])
    diff = kv.tensor_diff(a, b)
    assert diff.max_ulp > 2 ** 24   # a sign change of a tiny value: far apart in ULPs
    assert diff.max_abs_rel < 1e-29


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_flipped_bit_is_found_at_its_layer_position_and_kv(dtype):
    a = make_state(dtype=dtype)
    values = list(a.values)
    values[1] = flip_low_bit(values[1], (0, 1, 4, 2))
    b = kv.BoundaryState(a.prefix, a.keys, tuple(values), a.logits)
    diff = kv.compare_states(a, b)
    assert not diff.bit_exact
    assert (diff.first_bad_layer, diff.first_bad_kv) == (1, "v")
    assert diff.first_position == 4
    assert diff.n_diff == 1 and diff.max_ulp == 1
    assert diff.layers[1].k.equal and not diff.layers[1].v.equal
    assert diff.bad_layers == (1,)
    assert diff.d_rel > 0


def test_identical_states_compare_bit_exact():
    a, b = make_state(), make_state()
    diff = kv.compare_states(a, b)
    assert diff.bit_exact and diff.n_diff == 0 and diff.max_ulp == 0
    assert diff.first_bad_layer is None and diff.first_position is None


def test_ulp_distance_counts_across_zero():
    a = torch.tensor([0.0, -0.0, 1.0], dtype=torch.float32).view(1, 1, 3, 1)
    b = torch.tensor([-0.0, 0.0, 1.0], dtype=torch.float32).view(1, 1, 3, 1)
    diff = kv.tensor_diff(a, b)
    assert not diff.equal and diff.n_diff == 2   # other bits...
    assert diff.max_ulp == 0                        # ...but +0 and -0 are 0 ULPs apart
    tiny = torch.tensor([1e-45, -1e-45], dtype=torch.float32)   # smallest subnormals
    c = tiny.view(1, 1, 2, 1)
    d = torch.zeros(2).view(1, 1, 2, 1)
    assert kv.tensor_diff(c, d).max_ulp == 1
    assert kv.tensor_diff(c, c.flip(2)).max_ulp == 2


def test_transplant_into_itself_is_a_no_op():
    a = make_state()
    for text in ["all", "keys", "values", "layers=1-2", "positions=generated", "positions=1-3"]:
        b = surgery.transplant(a, a, surgery.parse_selection(text), prompt_length=2)
        assert kv.compare_states(a, b).bit_exact
        assert torch.equal(a.logits, b.logits)


def test_transplant_selection_moves_exactly_the_selected_part():
    r, d = make_state(seed=1), make_state(seed=2)
    d = kv.BoundaryState(r.prefix, d.keys, d.values, d.logits)
    out = surgery.transplant(r, d, surgery.parse_selection("layers=1-3+keys+positions=generated"),
                        prompt_length=2)
    assert torch.equal(out.logits, r.logits)      # the recipient's boundary logits are kept
    for layer in range(3):
        assert torch.equal(out.values[layer], r.values[layer])
        expected = r.keys[layer].clone()
        if layer >= 1:
            expected[:, :, 2:] = d.keys[layer][:, :, 2:]
        assert torch.equal(out.keys[layer], expected)


@pytest.mark.parametrize("bad", ["layer=1-2", "positions=3-1", "keys+foo", "positions=middle"])
def test_bad_selection_is_refused(bad):
    with pytest.raises(ValueError, match="valid"):
        surgery.parse_selection(bad)


def test_transplant_refuses_different_prefixes():
    a, b = make_state(), make_state()
    b = kv.BoundaryState((9,) * 6, b.keys, b.values, b.logits)
    with pytest.raises(ValueError, match="same prefix"):
        surgery.transplant(a, b, surgery.Selection(), prompt_length=2)


def test_fingerprints_see_every_bit():
    a = make_state()
    values = list(a.values)
    values[2] = flip_low_bit(values[2], (0, 0, 0, 0))
    b = kv.BoundaryState(a.prefix, a.keys, tuple(values), a.logits)
    assert kv.sha_cache(a) == kv.sha_cache(make_state())
    assert kv.sha_cache(a) != kv.sha_cache(b)
    assert kv.sha_ids([1, 2, 3]) != kv.sha_ids([1, 2, 4])


def test_suffix_comparison_reports_divergence_and_margins():
    out = kv.compare_suffixes([1, 2, 3, 4], [1, 2, 9], [5.0, 4.0, 0.5, 1.0], [5.0, 4.0, 0.4])
    assert not out.identical and out.first_divergence == 2 and out.common_prefix == 2
    assert out.margin_a_at_divergence == 0.5 and out.margin_b_at_divergence == 0.4
    prefix = kv.compare_suffixes([1, 2], [1, 2, 3], [1, 1], [1, 1, 1])
    assert prefix.first_divergence == 2 and prefix.margin_a_at_divergence is None


def test_rows_identical_sees_one_differing_bit_in_any_row():
    from transformers import DynamicCache

    cache = DynamicCache()
    keys = torch.randn(3, 2, 5, 4).to(torch.bfloat16)
    keys[1:] = keys[:1]                                  # three duplicate rows  [B, H, T, D]
    cache.update(keys, keys.clone(), 0)
    logits = torch.randn(1, 50).expand(3, 50).clone()
    assert kv.rows_identical(cache, logits)
    cache.layers[0].values[2] = flip_low_bit(cache.layers[0].values[2], (1, 3, 0))
    assert not kv.rows_identical(cache, logits)


def _sha_part_by_part(state):
    """The fingerprint's definition, each part hashed from its own host copy (as before the parts
    were copied to the host at once)."""
    import hashlib

    h = hashlib.sha256()
    for layer in state.layers:
        for name, t in layer.parts.items():
            tag = "" if name in kv.POSITIONAL else f"{name}:"
            h.update(f"{tag}{t.dtype}:{tuple(t.shape)}:".encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def test_one_copy_fingerprint_and_compare_equal_the_part_by_part_definitions():
    """sha_cache copies every part to the host at once and compare_states decides equality for
    all parts in one read-back: the digest and the verdicts are those of the parts one by one,
    over mixed dtypes, a named non-positional part and an empty one."""
    from kvfid.states.layers import LayerState

    a = make_state()
    extra = LayerState("recurrent", {"recurrent": torch.randn(1, 2, 3, 3), "conv": torch.zeros(1, 0)})
    state = kv.BoundaryState(a.prefix, logits=a.logits, layers=(*a.layers, extra))
    assert kv.sha_cache(state) == _sha_part_by_part(state)
    values = list(a.values)
    values[1] = flip_low_bit(values[1], (0, 1, 2, 3))
    b = kv.BoundaryState(a.prefix, a.keys, tuple(values), a.logits)
    found = kv.compare_states(a, b)
    for index, (la, lb) in enumerate(zip(a.layers, b.layers)):
        for name in ("k", "v"):
            assert getattr(found.layers[index], name) == kv.tensor_diff(la.parts[name], lb.parts[name], la.start)
    assert found.first_bad_layer == 1 and found.first_bad_kv == "v" and found.n_diff == 1
