"""kvfid.kernels.attention.native_tiles and native_call, the tile math under the native and the paged path: the
call-size probe (positions in one product, more or fewer than a tile, only where this machine
gives each the bits of its tile alone), its controls (a product or a row sum whose row bits depend
on the rows in the call is caught, wider or narrower), tiles one by one giving the same bits, and
the lane-uniform exp2 (its control: a twin whose tail rounds differently)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bitwise_equal, randn

from kvfid.kernels.attention import native, native_call, native_tiles
from kvfid.kernels.attention.native_call import DEFAULT_CONFIG
from kvfid.kernels.invariant import ops
from kvfid.kernels.invariant.ops import lane_uniform_

# SmolLM2's heads (3 KV heads of 3 queries, D 64), a tile of 16 positions (48 rows): calls of a
# key tile's 64 positions and of 1 to 15, one piece of a key tile and a later piece of a full span
SHAPE = (3, 3, 64, 64, DEFAULT_CONFIG)
PROBED = [(False, 64), (True, DEFAULT_CONFIG.span)]
SIZES = (64, 1, 2, 5)


def _probe(positions: int) -> bool:
    """The probe itself, uncached, at one thread count (what `rows_keep_bits` keeps per shape)."""
    return all(native_tiles._rows_probe.__wrapped__(*SHAPE, 1, positions, later, keys)
               for later, keys in PROBED)


def test_the_probe_gives_a_verdict_and_tiles_one_by_one_give_the_same_bits(monkeypatch):
    """Whatever this machine's verdicts, the attention gives the same bits with every call but a
    whole tile refused (a prefill crossing a span, so calls of every piece kind run; decode steps)."""
    print("call sizes (positions) whose rows keep their tile's bits here:",
          {n: _probe(n) for n in SIZES})
    gen = torch.Generator().manual_seed(0)
    q, k, v = (randn(2, h, 700, 64, dtype=torch.bfloat16, gen=gen, on="cpu") for h in (9, 3, 3))
    allowed = native.attention(q, k, v), [native.attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1])
                                          for t in (0, 17, 63, 64, 600)]
    refuse_every_call_but_a_tile(monkeypatch)
    refused = native.attention(q, k, v), [native.attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1])
                                          for t in (0, 17, 63, 64, 600)]
    assert_bitwise_equal(refused[0], allowed[0], "a prefill tile by tile vs in calls the probe allows")
    for a, b in zip(refused[1], allowed[1]):
        assert_bitwise_equal(a, b, "a decode step in its whole tile vs in the rows the probe allows")


def refuse_every_call_but_a_tile(monkeypatch) -> None:
    """The probe refuses every call size (the calls of a run are chosen afresh, not from cache)."""
    monkeypatch.setattr(native_tiles, "rows_keep_bits", lambda *args: False)
    monkeypatch.setattr(native_tiles, "_calls", native_tiles._calls.__wrapped__)
    run = native_call.Run(63, 100, 0, 128)
    assert native_tiles._calls(run, SHAPE[:4] + (DEFAULT_CONFIG, 1)) == tuple(
        (t * 16, 16, run) for t in range(3, 7)), "refused calls are not the run's tiles"


def _twin(stock, other):
    """A twin of `stock` that, on calls of another row count than one tile's 48, computes another way."""
    def twin(a, *args, **kwargs):
        return (stock if a.shape[1] == 16 * 3 else other)(a, *args, **kwargs)
    return twin


@pytest.mark.parametrize("positions", [64, 5])
def test_control_the_probe_catches_a_product_whose_rows_depend_on_the_call(monkeypatch, positions):
    stock = torch.bmm

    def split(a, b, **kwargs):   # the reduction over D in two halves, then added
        half = a.shape[-1] // 2
        out = stock(a[..., :half], b[:, :half]) + stock(a[..., half:], b[:, half:])
        return kwargs["out"].copy_(out) if "out" in kwargs else out
    monkeypatch.setattr(torch, "bmm", _twin(stock, split))
    assert not _probe(positions), "a product whose row bits depend on the rows in the call was not caught"


@pytest.mark.parametrize("positions", [64, 5])
def test_control_the_probe_catches_a_row_sum_that_depends_on_the_call(monkeypatch, positions):
    stock = torch.sum

    def backwards(x, dim, **kwargs):   # the row summed from its last element
        return stock(x.flip(dim), dim, **kwargs)
    monkeypatch.setattr(torch, "sum", _twin(stock, backwards))
    assert not _probe(positions), "a row sum whose bits depend on the rows in the call was not caught"


def _sequences_probe(count: int = 5) -> bool:
    """The stacking probe of decode steps, uncached: `count` sequences of 2-position calls."""
    return all(native_tiles._sequences_probe.__wrapped__(*SHAPE, 1, count, 2, later, keys)
               for later, keys in PROBED)


def test_control_the_sequences_probe_catches_a_product_whose_batch_entries_depend_on_the_batch(monkeypatch):
    """Sequences stacked in the products' batch dimension: a product that computes a batch of more
    than one sequence's heads another way is caught (this machine's own verdict is printed)."""
    print(f"decode steps of 5 sequences stacked keep their bits here: {_sequences_probe()}")
    stock = torch.bmm

    def split(a, b, **kwargs):   # the reduction in two halves, then added
        half = a.shape[-1] // 2
        out = stock(a[..., :half], b[:, :half]) + stock(a[..., half:], b[:, half:])
        return kwargs["out"].copy_(out) if "out" in kwargs else out
    monkeypatch.setattr(torch, "bmm", lambda a, *rest, **kw: (split if a.shape[0] > SHAPE[0] else stock)(a, *rest, **kw))
    assert not _sequences_probe(), "a product whose batch entries depend on the batch was not caught"


def _sizes_check(exp2) -> None:
    """exp2(x) over calls of several sizes: each element's bits those of a call of LANES elements."""
    lanes = ops.LANES
    x = torch.randn(3 * ops.BLOCK + lanes, generator=torch.Generator().manual_seed(1)) * 30
    expected = torch.cat([torch.exp2(x[i:i + lanes]) for i in range(0, x.numel(), lanes)])
    for n in (1, 7, 255, 257, 1000, x.numel() - 44, x.numel()):
        assert_bitwise_equal(exp2(x[:n].clone()), expected[:n], f"exp2 over {n} elements")
    alone = torch.cat([exp2(x[i:i + 1].clone()) for i in range(2048)])
    assert_bitwise_equal(alone, expected[:2048], "exp2 of each element alone")


def _in_room(x: torch.Tensor) -> torch.Tensor:
    """exp2 of x computed at the start of a larger buffer, the call rounded up inside it."""
    room = torch.full((x.numel() + ops.LANES,), 7.0)
    return lane_uniform_(torch.exp2, room.narrow(0, 0, x.numel()).copy_(x), room).clone()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("room", [False, True], ids=["padded-copy", "in-room"])
def test_lane_uniform_exp2_gives_an_element_its_bits_at_any_size(threads, room):
    """Every element takes the vector body, in calls of any size (tails of every length, more
    than BLOCK elements) at one thread and at two, padded by a copy or rounded up in a buffer."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _sizes_check(_in_room if room else lambda x: lane_uniform_(torch.exp2, x))
    finally:
        torch.set_num_threads(before)


def test_control_the_size_check_catches_an_exp2_whose_tail_rounds_differently():
    """A twin whose call's last elements (not a whole vector of 8) take another formula, as a
    stock scalar tail may; the stock call itself, on this machine, is printed."""
    def tailed(x):
        out = torch.exp2(x)
        tail = x.numel() % 8
        if tail:
            out[-tail:] = torch.exp(x[-tail:] * torch.log(torch.tensor(2.0)))
        return out
    with pytest.raises(AssertionError, match="not bitwise equal"):
        _sizes_check(tailed)
    try:
        _sizes_check(torch.exp2)
        print("stock exp2: every element its vector bits at every size, on this machine")
    except AssertionError as err:
        print(f"stock exp2 on this machine: {err}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("keys", [70, 600])
def test_a_dense_decode_step_of_several_rows_is_one_stacked_call_with_each_rows_bits_alone(
        monkeypatch, dtype, keys):
    """native.attention on a decode step of 5 rows at one position: one stacked call where the
    machine's probe allows it (spied), else row by row; either way each row has the bits it gets
    in a batch of one (the row's own step alone)."""
    stacked = []
    real = native_tiles.run_stacked
    monkeypatch.setattr(native, "run_stacked", lambda *a: stacked.append(real(*a)) or stacked[-1])
    q = randn(5, 6, 1, 64, seed=1, on="cpu").to(dtype)
    k, v = (randn(5, 2, keys, 64, seed=s, on="cpu").to(dtype) for s in (2, 3))
    together = native.attention(q, k, v)
    assert len(stacked) == 1, "the stacked path was not tried"
    alone = torch.cat([native.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1]) for b in range(5)])
    assert len(stacked) == 1, "a batch of one took the stacked path"
    assert_bitwise_equal(together, alone, f"5 rows over {keys} keys against each alone")
    print(f"stacked here: {stacked[0] is not None}")


def test_control_a_stacked_decode_whose_batch_entries_depend_on_the_batch_differs_from_alone(monkeypatch):
    """The stacked call itself, with a product that computes a batch of more than one sequence's
    heads another way (forced past the probe): the rows part from their bits alone, so the test
    above would see a stacking that changes them."""
    stock = torch.bmm

    def split(a, b, **kwargs):   # the reduction in two halves, then added
        half = a.shape[-1] // 2
        out = stock(a[..., :half], b[:, :half]) + stock(a[..., half:], b[:, half:])
        return kwargs["out"].copy_(out) if "out" in kwargs else out
    monkeypatch.setattr(native_tiles, "sequences_keep_bits", lambda *a: True)
    q = randn(5, 6, 1, 64, seed=1, on="cpu")
    k, v = (randn(5, 2, 70, 64, seed=s, on="cpu") for s in (2, 3))
    alone = torch.cat([native.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1]) for b in range(5)])
    monkeypatch.setattr(torch, "bmm", lambda a, *rest, **kw: (split if a.shape[0] > 2 else stock)(a, *rest, **kw))
    assert not torch.equal(native.attention(q, k, v), alone)
