"""Decode weights packed in the order a forward reads them, and the L2 prefetch that reads ahead through them
(layers.prefetch): packing keeps every value and the logits' bits, the bytes after each weight are the next weight
the forward reads, and the prefetching GEMV compiles for the H200 and (on a GPU) keeps its bits."""

import pytest
import torch
from conftest import DEVICE, random_prompt

from pocketlab.layers import gemv, prefetch
from pocketlab.layers.prefetch import VIEW_ALIGN, ahead_of, pack_in_reading_order


class Block:
    streamed = ("first", "second")

    def __init__(self, seed: int, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        self.first = torch.randn(5, 7, generator=g).to(dtype)  # 35 values: the next weight starts after padding
        self.second = torch.randn(3, 5, generator=g).to(dtype)
        self.other = torch.randn(4, generator=g)  # not streamed: left alone


def storage_end(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() + t.untyped_storage().nbytes()


def test_packing_lays_the_weights_out_in_reading_order_with_their_values():
    blocks = [Block(0), Block(1)]
    before = [(b.first.clone(), b.second.clone(), b.other) for b in blocks]
    assert pack_in_reading_order(blocks) == 1
    order = [w for b in blocks for w in (b.first, b.second)]
    assert len({w.untyped_storage().data_ptr() for w in order}) == 1
    assert [w.data_ptr() for w in order] == sorted(w.data_ptr() for w in order)
    assert all((w.data_ptr() - order[0].data_ptr()) % VIEW_ALIGN == 0 for w in order)
    for b, (first, second, other) in zip(blocks, before, strict=True):
        assert torch.equal(b.first, first) and torch.equal(b.second, second) and b.other is other
        assert b.first.is_contiguous() and b.second.is_contiguous()


def test_ahead_of_a_weight_is_what_follows_it_in_its_buffer():
    blocks = [Block(0), Block(1)]
    pack_in_reading_order(blocks)
    a, b = blocks[0].first, blocks[0].second
    addr, n = ahead_of(a, 1 << 20)  # more than is left: up to the buffer's end
    assert a.data_ptr() + a.numel() * 4 <= addr <= b.data_ptr() and addr % 16 == 0
    assert 0 <= storage_end(a) - (addr + n) < 16 and n % 16 == 0  # whole 16-byte pieces up to the end
    assert ahead_of(a, 40) == (addr, 32)  # rounded down to whole 16-byte pieces
    assert ahead_of(blocks[1].second, 1 << 20) == (0, 0)  # the last weight: nothing follows
    assert ahead_of(torch.randn(4, 4), 1 << 20) == (0, 0)  # a weight of its own


def test_packing_starts_a_new_buffer_at_the_chunk_size_another_dtype_and_after_a_block_off_the_stream():
    blocks = [Block(0), Block(1), Block(2, torch.bfloat16)]
    assert pack_in_reading_order(blocks, chunk_bytes=3 * VIEW_ALIGN) == 3  # a block per chunk, then a dtype change
    assert blocks[0].first.untyped_storage().data_ptr() == blocks[0].second.untyped_storage().data_ptr()
    assert ahead_of(blocks[0].second, 1 << 20) == (0, 0)  # its chunk ends there
    assert blocks[2].first.dtype == torch.bfloat16
    blocks = [Block(0), object(), Block(1), Block(2)]  # the second reads weights of its own (an MoE block's experts)
    assert pack_in_reading_order(blocks) == 2
    assert ahead_of(blocks[0].second, 1 << 20) == (0, 0)
    assert ahead_of(blocks[2].second, 1 << 20)[1] > 0


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3_5"])
def test_a_forward_reads_the_packed_weights_in_memory_order_and_its_logits_keep_their_bits(make_engine, preset):
    e = make_engine(preset, prefix_cache=False)  # the second prefill computes every token again
    prompt = random_prompt(20, seed=3)
    first = e.prefill(prompt, slot_id=0)
    want = [first.logits, e.decode_step(first.next_token, slot_id=0).logits]
    parts = e.model.reading_order()
    assert len(parts) == 2 * len(e.model.layers)
    pack_in_reading_order(parts)
    streamed = {getattr(p, name).data_ptr() for p in parts for name in p.streamed}
    kernels, read = e.model.kernels, []
    linear = kernels.linear

    def recording(x, weight, *args, **kwargs):
        if weight.data_ptr() in streamed:
            read.append(weight.data_ptr())
        return linear(x, weight, *args, **kwargs)

    object.__setattr__(kernels, "linear", recording)  # the kernels are frozen (and may be shared): put it back
    try:
        again = e.prefill(prompt, slot_id=1)
        read.clear()
        got = [again.logits, e.decode_step(again.next_token, slot_id=1).logits]
    finally:
        object.__setattr__(kernels, "linear", linear)
    assert len(read) == len(streamed) and read == sorted(read)  # the decode step read each once, in memory order
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


def test_the_sm90_check_compiles_every_gemv_launch_prefetching_too():
    from sm90 import gpu_variants

    launch = dict(module=gemv.__name__, name="_gemv", signature=dict(ahead_addr="i32", ahead_bytes="i32"),
                  constants=dict(AHEAD=0, PDL=False), options=dict(num_warps=4))  # fmt: skip
    *_, ahead = gpu_variants(launch)
    assert ahead["constants"] == dict(AHEAD=1, PDL=True) and ahead["signature"]["ahead_addr"] == "i64"
    assert ahead["options"]["launch_pdl"]


@pytest.mark.skipif(DEVICE != "cuda", reason="the bulk prefetch runs on Hopper GPUs")
def test_gemv_keeps_its_bits_while_prefetching_the_next_weight():
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    blocks = [Block(s, torch.bfloat16) for s in range(3)]
    weights = [torch.randn(n, 1024, dtype=torch.bfloat16) for _ in range(3) for n in (4096, 2048)]
    for b, pair in zip(blocks, zip(weights[::2], weights[1::2], strict=True), strict=True):
        b.first, b.second = (w.cuda() for w in pair)
    pack_in_reading_order(blocks)
    before = prefetch.AHEAD_BYTES
    try:
        prefetch.AHEAD_BYTES = 0
        plain = [gemv.gemv(x, b.first) for b in blocks]
        prefetch.AHEAD_BYTES = 8 << 20
        assert ahead_of(blocks[0].first, prefetch.AHEAD_BYTES)[1] > 0
        ahead = [gemv.gemv(x, b.first) for b in blocks]
    finally:
        prefetch.AHEAD_BYTES = before
    for p, a in zip(plain, ahead, strict=True):
        assert torch.equal(p, a)
