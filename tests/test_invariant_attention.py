"""Batch-invariant attention: accuracy against float64 softmax attention, and bitwise invariance of every query
whatever runs beside it (GPU, or Triton's CPU interpreter)."""

import importlib
import os

import pytest
import torch

from pocketlab.layers import decode_attention as da

# the package exports the function `attention`, which hides the submodule of that name from `from ... import`
ia = importlib.import_module("pocketlab.layers.invariant.attention")

on_gpu = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    ia.triton is None or not (on_gpu or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton on a GPU (or TRITON_INTERPRET=1)",
)
DEV = "cuda" if on_gpu else "cpu"


def caches(slots, kv_heads, length, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(slots, kv_heads, length, dim, generator=gen).to(DEV, dtype) for _ in range(2)]


def reference(q, k_cache, v_cache, slots, start, lengths):
    """Float64 masked softmax attention, query by query; padding rows left at 0."""
    B, T, H, D = q.shape
    group = H // k_cache.shape[1]
    out = torch.zeros(B, T, H, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        keys = int(start[b] + lengths[b])
        k = k_cache[slots[b], :, :keys].double().repeat_interleave(group, 0)  # [H, keys, D]
        v = v_cache[slots[b], :, :keys].double().repeat_interleave(group, 0)
        s = torch.einsum("thd,hnd->thn", q[b, : lengths[b]].double(), k) * D**-0.5
        visible = (
            torch.arange(keys, device=q.device)[None, :]
            <= (start[b] + torch.arange(int(lengths[b]), device=q.device))[:, None]
        )
        probs = torch.softmax(s.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
        out[b, : lengths[b]] = torch.einsum("thn,hnd->thd", probs, v)
    return out


@pytest.mark.parametrize(
    "heads,kv_heads,dim,dtype",
    [
        (8, 2, 16, torch.float32),
        (4, 4, 32, torch.float32),
        (6, 2, 16, torch.float32),  # a group of 3: 21 queries per 64-row tile
        (16, 2, 128, torch.float32),
        (8, 2, 128, torch.bfloat16),
    ],
)
def test_matches_float64_attention(heads, kv_heads, dim, dtype):
    """GQA, ragged lengths, start > 0 and a prompt crossing a split; both modes give the same bits. Cache cells
    past each slot's keys and padding queries hold NaN: neither may leak."""
    kc, vc = caches(5, kv_heads, 320, dim, dtype, seed=dim + heads)
    slots = torch.tensor([4, 0, 2], device=DEV)
    start = torch.tensor([300, 0, 250], device=DEV)
    lengths = torch.tensor([5, 3, 9], device=DEV)
    for b in range(3):
        kc[slots[b], :, start[b] + lengths[b] :] = float("nan")
        vc[slots[b], :, start[b] + lengths[b] :] = float("nan")
    q = torch.randn(3, 9, heads, dim, generator=torch.Generator().manual_seed(1)).to(DEV, dtype)
    for b in range(3):
        q[b, lengths[b] :] = float("nan")
    outs = [ia.attention(q, kc, vc, slots, start, lengths, dim**-0.5, 320, split_programs=m) for m in (True, False)]
    assert torch.equal(outs[0], outs[1])
    ref = reference(q, kc, vc, slots, start, lengths)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert (outs[0].double() - ref).abs().max() < tol
    assert outs[0].isfinite().all()  # padding rows come out 0


# ---------------------------------------------------------------------------------------------------------------------
# invariance: one target sequence's queries, computed many ways, must agree bit for bit
# ---------------------------------------------------------------------------------------------------------------------

CACHE, TARGET_SLOT, PROMPT = 640, 3, 270  # the prompt crosses the first 256-key split
DECODE_AT = [0, 63, 64, 255, 256, 269]  # positions checked one token at a time
on_gpu_only = pytest.mark.skipif(not on_gpu, reason="bfloat16 / full size: GPU only")


@pytest.fixture(
    scope="module",
    params=[
        (torch.float32, 4, 1, 32),  # 16 queries per tile
        pytest.param((torch.bfloat16, 32, 8, 128), marks=on_gpu_only),  # Qwen3-8B's heads, tensor-core dots
        pytest.param((torch.float32, 16, 8, 64), marks=on_gpu_only),
    ],
)
def setting(request):
    """(caches, the target's queries by position [PROMPT, H, D], generator) for (dtype, heads, kv_heads, dim)."""
    dtype, heads, kv_heads, dim = request.param
    kc, vc = caches(6, kv_heads, CACHE, dim, dtype, seed=7)
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(PROMPT, heads, dim, generator=gen).to(DEV, dtype)
    return kc, vc, q, gen


def ours(q, kc, vc, slots, start, lengths, max_len, split_programs=None):
    scale = q.shape[-1] ** -0.5
    return ia.attention(q, kc, vc, slots, start, lengths, scale, max_len, split_programs=split_programs)


def with_others(setting, positions, others, row, T, max_len, run, split_programs=None):
    """The target's queries at `positions` (consecutive) at batch row `row`, padded to T, beside `others`
    random rows (other slots, starts, lengths); -> the target's outputs [len(positions), H, D]."""
    kc, vc, q_target, gen = setting
    B = others + 1
    q = torch.randn(B, T, *q_target.shape[1:], generator=gen).to(DEV, q_target.dtype)
    slots = torch.tensor([s for s in range(6) if s != TARGET_SLOT])[torch.randint(0, 5, (others,), generator=gen)]
    lengths = torch.randint(1, T + 1, (others,), generator=gen)
    start = torch.tensor(
        [int(torch.randint(0, max_len - int(n) + 1, (1,), generator=gen)) for n in lengths], dtype=torch.long
    )
    insert = lambda rest, x: torch.cat([rest[:row], torch.tensor([x]), rest[row:]]).to(DEV)  # noqa: E731
    slots, lengths, start = insert(slots, TARGET_SLOT), insert(lengths, len(positions)), insert(start, positions[0])
    q[row, : len(positions)] = q_target[positions[0] : positions[-1] + 1]
    return run(q, kc, vc, slots, start, lengths, max_len, split_programs)[row, : len(positions)]


def decode_one_by_one(setting, run, positions, ways):
    """Each position as a T = 1 decode, in each way (other rows beside it, max_len, mode) -> {position: [H, D]};
    asserts every way agrees with the first."""
    got = {}
    for i, p in enumerate(positions):
        for others, max_len, split_programs in ways:
            out = with_others(setting, [p], others, i % (others + 1), 1, max_len, run, split_programs)[0]
            if p in got:
                assert torch.equal(out, got[p]), f"position {p}: {others + 1} rows, max_len {max_len}"
            got[p] = out
    return got


def test_every_query_is_bitwise_the_same_however_it_is_batched(setting):
    """T = 1 decodes (alone, batched, any key bucket), chunks of several sizes, the whole prompt at once, beside
    other random rows, in either mode and with rows reordered: every query's output, bit for bit."""
    whole = with_others(setting, list(range(PROMPT)), 0, 0, PROMPT, PROMPT, run=ours, split_programs=False)
    ways = [(0, PROMPT, None), (3, CACHE, None), (1, 300, False)]
    for p, out in decode_one_by_one(setting, ours, DECODE_AT, ways).items():
        assert torch.equal(out, whole[p]), f"decode vs prompt at {p}"
    for chunk, others, mode in ((64, 0, None), (37, 1, True), (100, 2, False)):
        for lo in range(0, PROMPT, chunk):
            positions = list(range(lo, min(lo + chunk, PROMPT)))
            got = with_others(setting, positions, others, others // 2, chunk, CACHE, run=ours, split_programs=mode)
            assert torch.equal(got, whole[lo : lo + len(positions)]), f"chunk {chunk} at {lo}"
    # one batch, then its rows reversed: each row's outputs move with it, unchanged
    kc, vc, q_target, gen = setting
    q = torch.randn(4, 6, *q_target.shape[1:], generator=gen).to(DEV, q_target.dtype)
    slots, start = torch.tensor([1, 3, 0, 5], device=DEV), torch.tensor([10, 250, 600, 0], device=DEV)
    lengths = torch.tensor([6, 2, 5, 1], device=DEV)
    out = ours(q, kc, vc, slots, start, lengths, CACHE)
    flip = torch.arange(3, -1, -1, device=DEV)
    assert torch.equal(ours(q[flip], kc, vc, slots[flip], start[flip], lengths[flip], CACHE), out[flip])


def split_count_varies(q, kc, vc, slots, start, lengths, max_len, split_programs=None):
    """The existing decode kernel as an attention over the cache (RoPE and norms the identity, the 'new' K/V the
    cached ones): its split length is sized from the batch, so it is batch-variant."""
    B, T, H, D = q.shape
    assert T == 1
    pos = start + lengths - 1
    k_new, v_new = kc[slots, :, pos], vc[slots, :, pos]
    rope = (torch.ones(B, D, device=DEV, dtype=q.dtype), torch.zeros(B, D, device=DEV, dtype=q.dtype))
    return da.decode_attention(q[:, 0], k_new, v_new, kc, vc, slots, pos + 1, max_len, D**-0.5, rope)[:, None]


def test_the_invariance_check_catches_a_batch_variant_kernel(setting):
    with pytest.raises(AssertionError, match="rows"):
        # alone it takes splits of 64 keys; beside 25 other rows, longer ones (its split length is sized from B)
        decode_one_by_one(setting, split_count_varies, [200], ways=[(0, CACHE, None), (25, CACHE, None)])


@pytest.mark.skipif(not on_gpu, reason="CUDA graphs")
def test_replays_in_a_cuda_graph(setting):
    """No host sync and shapes from B, T and max_len only: capture once, replay with new positions."""
    kc, vc, q_target, gen = setting
    q = torch.randn(4, 3, *q_target.shape[1:], generator=gen).to(DEV, q_target.dtype)
    slots, start = torch.tensor([1, 3, 0, 5], device=DEV), torch.tensor([10, 250, 600, 0], device=DEV)
    lengths = torch.tensor([3, 2, 3, 1], device=DEV)
    for mode in (True, False):
        ours(q, kc, vc, slots, start, lengths, CACHE, mode)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ours(q, kc, vc, slots, start, lengths, CACHE, mode)
        start.copy_(torch.tensor([100, 5, 300, 636], device=DEV))
        lengths.copy_(torch.tensor([1, 3, 2, 3], device=DEV))
        graph.replay()
        assert torch.equal(out, ours(q, kc, vc, slots, start, lengths, CACHE, mode))
