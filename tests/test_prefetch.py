"""The L2 prefetch of the next projection's weight from the decode attention and state step kernels
(layers.prefetch): their programs cover the weight once in whole 16-byte pieces, the span refuses what the bulk
prefetch cannot take or what it would slow, the sm_90 check compiles the prefetching form, and (on a GPU)
attention, the Gated DeltaNet state step and the logits keep their bits."""

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


def test_the_span_is_a_small_weight_whole_at_one_row():
    w = torch.empty(64, 40, dtype=torch.bfloat16)
    assert prefetch.span(w, rows=1) == 64 * 40 * 2
    assert prefetch.span(w, rows=2) == 0  # batch 32 was slower
    assert prefetch.span(torch.empty(3, 3, dtype=torch.bfloat16), rows=1) == 16  # 18 bytes: whole pieces only
    assert prefetch.span(torch.empty(prefetch.MAX_BYTES // 2 + 1, dtype=torch.bfloat16), rows=1) == 0  # too large
    assert prefetch.span(w[:, :8], rows=1) == 0  # not contiguous
    assert prefetch.span(w.view(-1)[1:], rows=1) == 0  # not 16-byte aligned


def test_the_cpu_never_prefetches(monkeypatch):
    monkeypatch.setenv("POCKETLAB_L2_PREFETCH", "1")
    assert not prefetch.enabled(torch.device("cpu"))


def test_the_sm90_check_compiles_the_prefetching_form():
    from sm90 import gpu_variants

    launch = dict(module="m", name="k", signature={}, constants=dict(PREFETCH=False, PDL=False), options={})
    plain, pdl, prefetching = gpu_variants(launch)
    assert plain is launch and pdl["constants"] == dict(PREFETCH=False, PDL=True)
    assert prefetching["constants"] == dict(PREFETCH=True, PDL=True) and prefetching["options"]["launch_pdl"]
    assert len(gpu_variants(dict(launch, constants=dict(PDL=False)))) == 2  # a kernel without the prefetch


@pytest.mark.skipif(DEVICE != "cuda", reason="the bulk prefetch runs on sm_90 GPUs")
def test_attention_state_step_and_logits_keep_their_bits_while_prefetching(make_engine, monkeypatch):
    from conftest import random_prompt

    from pocketlab.layers import decode_attention as da
    from pocketlab.layers.linear_decode import recurrent_step

    assert prefetch.enabled(torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(2, 4, 300, 128, generator=gen).bfloat16().cuda() for _ in range(2))
    q, k, v = (torch.randn(1, n, 128, generator=gen).bfloat16().cuda() for n in (16, 4, 4))
    cos, sin = (torch.randn(1, 128, generator=gen).cuda() for _ in range(2))
    slots, lengths = torch.tensor([1], device="cuda"), torch.tensor([299], device="cuda")
    weight = torch.randn(2048, 1024, generator=gen).bfloat16().cuda()
    assert prefetch.span(weight, rows=1) > 0
    args = (q, k, v, k_cache, v_cache, slots, lengths, 300, 128**-0.5, (cos, sin))
    plain = da.decode_attention(*args)
    assert torch.equal(da.decode_attention(*args, prefetch=weight), plain)

    state = torch.randn(3, 8, 128, 128, generator=gen).cuda()
    qs, ks = (torch.randn(1, 4, 128, generator=gen).bfloat16().cuda() for _ in range(2))
    vs = torch.randn(1, 8, 128, generator=gen).bfloat16().cuda()
    g, beta = (torch.rand(1, 8, generator=gen).cuda() for _ in range(2))
    steps = [state.clone() for _ in range(2)]
    outs = [
        recurrent_step(qs, ks, vs, g, beta, s, slots, 1e-6, prefetch=w)
        for s, w in zip(steps, (None, weight), strict=True)
    ]
    assert torch.equal(*outs) and torch.equal(*steps)

    prompt = random_prompt(40, seed=1)
    for preset in ("tiny-qwen3", "tiny-qwen3_5"):
        logits = []
        for switch in ("0", "1"):
            monkeypatch.setenv("POCKETLAB_L2_PREFETCH", switch)
            e = make_engine(preset, prefix_cache=False)
            logits.append(e.decode_step(e.prefill(prompt).next_token).logits)
        assert torch.equal(*logits)
