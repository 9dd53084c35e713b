"""The L2 prefetch of the next projection's weight from the decode attention kernel (layers.prefetch): its programs
cover the weight once in whole 16-byte pieces, the switch and the spans refuse what the bulk prefetch cannot take,
the sm_90 check compiles both placements, and (on a GPU) attention and logits keep their bits."""

import os

import pytest
import torch
from conftest import DEVICE

from pocketlab.layers import prefetch

triton = pytest.importorskip("triton")
tl = triton.language
runs_kernels = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _record_pieces(starts_ptr, sizes_ptr, nbytes, LANES: tl.constexpr):
    program, programs = tl.program_id(0), tl.num_programs(0)
    start, size = prefetch.pieces(nbytes, program, programs, LANES)
    lane = program * LANES + tl.arange(0, LANES)
    tl.store(starts_ptr + lane, start)
    tl.store(sizes_ptr + lane, size)


@pytest.mark.skipif(not runs_kernels, reason="needs Triton on a GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("nbytes,programs,lanes", [(16 << 20, 16, 128), (4096 * 16, 3, 32), (48, 5, 4), (0, 2, 4)])
def test_the_programs_cover_the_weight_once_in_whole_16_byte_pieces(nbytes, programs, lanes):
    starts = torch.full((programs * lanes,), -1, dtype=torch.int64, device=DEVICE)
    sizes = torch.full((programs * lanes,), -1, dtype=torch.int32, device=DEVICE)
    _record_pieces[(programs,)](starts, sizes, nbytes, LANES=lanes)
    starts, sizes = starts.cpu(), sizes.cpu().long()
    live = sizes > 0
    assert bool((sizes >= 0).all()) and bool((starts[live] % 16 == 0).all()) and bool((sizes[live] % 16 == 0).all())
    assert int(sizes.sum()) == nbytes  # every byte once ...
    begin, size = starts[live].sort()[0], sizes[live][starts[live].argsort()]
    edges = torch.cat([begin, (begin + size)[-1:]]) if nbytes else torch.tensor([0])
    assert torch.equal(edges[1:-1], (begin + size)[:-1])  # ... in pieces that touch and never overlap,
    assert int(edges[0]) == 0 and int(edges[-1]) == nbytes  # from the weight's first byte to its last


def test_the_span_is_the_whole_weight_where_the_bulk_prefetch_can_take_it(monkeypatch):
    w = torch.empty(64, 40, dtype=torch.bfloat16)
    assert prefetch.span(w) == 64 * 40 * 2
    monkeypatch.setenv("POCKETLAB_ATTN_PREFETCH_MIB", str(1000 / (1 << 20)))
    assert prefetch.span(w) == 992  # its first 1,000 bytes, in whole pieces
    monkeypatch.delenv("POCKETLAB_ATTN_PREFETCH_MIB")
    assert prefetch.span(torch.empty(3, 3, dtype=torch.bfloat16)) == 16  # 18 bytes: whole 16-byte pieces only
    assert prefetch.span(w[:, :8]) == 0  # not contiguous
    assert prefetch.span(w.view(-1)[1:]) == 0  # not 16-byte aligned


def test_the_switch_takes_a_placement_and_the_cpu_never_prefetches(monkeypatch):
    for value in ("0", "1", "2"):
        monkeypatch.setenv("POCKETLAB_ATTN_PREFETCH", value)
        assert prefetch.mode(torch.device("cpu")) == 0
    monkeypatch.setenv("POCKETLAB_ATTN_PREFETCH", "3")
    with pytest.raises(ValueError, match="POCKETLAB_ATTN_PREFETCH is 0, 1 or 2"):
        prefetch.mode(torch.device("cpu"))


def test_the_sm90_check_compiles_both_placements():
    from sm90 import gpu_variants

    launch = dict(module="m", name="k", signature={}, constants=dict(PREFETCH=0, PDL=False), options={})
    plain, pdl, after, before = gpu_variants(launch)
    assert plain is launch and pdl["constants"] == dict(PREFETCH=0, PDL=True)
    assert (after["constants"]["PREFETCH"], before["constants"]["PREFETCH"]) == (1, 2)
    assert after["constants"]["PDL"] and after["options"]["launch_pdl"]
    assert len(gpu_variants(dict(launch, constants=dict(PDL=False)))) == 2  # a kernel without the prefetch


@pytest.mark.skipif(DEVICE != "cuda", reason="the bulk prefetch runs on sm_90 GPUs")
@pytest.mark.parametrize("placement", ["1", "2"])
def test_attention_and_logits_keep_their_bits_while_prefetching(make_engine, monkeypatch, placement):
    from conftest import random_prompt

    from pocketlab.layers import decode_attention as da

    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(2, 4, 300, 128, generator=gen).bfloat16().cuda() for _ in range(2))
    q, k, v = (torch.randn(2, n, 128, generator=gen).bfloat16().cuda() for n in (16, 4, 4))
    cos, sin = (torch.randn(2, 128, generator=gen).cuda() for _ in range(2))
    slots, lengths = torch.tensor([1, 0], device="cuda"), torch.tensor([299, 17], device="cuda")
    weight = torch.randn(2048, 2048, generator=gen).bfloat16().cuda()
    args = (q, k, v, k_cache, v_cache, slots, lengths, 300, 128**-0.5, (cos, sin))
    plain = da.decode_attention(*args)
    monkeypatch.setenv("POCKETLAB_ATTN_PREFETCH", placement)
    assert prefetch.mode(q.device) == int(placement)
    assert torch.equal(da.decode_attention(*args, prefetch=weight), plain)

    prompt = random_prompt(40, seed=1)
    monkeypatch.setenv("POCKETLAB_ATTN_PREFETCH", "0")
    e = make_engine("tiny-qwen3", prefix_cache=False)
    want = [e.decode_step(e.prefill(prompt).next_token).logits for _ in range(1)]
    monkeypatch.setenv("POCKETLAB_ATTN_PREFETCH", placement)
    e = make_engine("tiny-qwen3", prefix_cache=False)
    got = [e.decode_step(e.prefill(prompt).next_token).logits for _ in range(1)]
    assert torch.equal(want[0], got[0])
