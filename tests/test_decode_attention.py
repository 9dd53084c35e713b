"""The Triton decode-attention kernel against plain softmax attention (GPU, or Triton's CPU interpreter)."""
import os

import pytest
import torch

from pocketlab.layers import decode_attention as da

on_gpu = torch.cuda.is_available()
interpreted = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(da.triton is None or not (on_gpu or interpreted),
                                reason="needs Triton on a GPU (or TRITON_INTERPRET=1)")


@pytest.mark.parametrize("heads,kv_heads,dim,max_len", [(16, 8, 128, 600), (8, 2, 256, 300), (4, 2, 16, 64)])
def test_matches_reference(heads, kv_heads, dim, max_len):
    dev = "cuda" if on_gpu else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(0)
    k_cache, v_cache = (torch.randn(4, kv_heads, max_len, dim, generator=gen).to(dev) for _ in range(2))
    q = torch.randn(3, heads, dim, generator=gen).to(dev)
    slots, lengths = torch.tensor([2, 0, 3], device=dev), torch.tensor([max_len - 5, 1, 37], device=dev)
    out = da.decode_attention(q, k_cache, v_cache, slots, lengths, max_len, dim ** -0.5, split_len=128)
    for b in range(3):
        k = k_cache[slots[b], :, :lengths[b]].repeat_interleave(heads // kv_heads, 0)
        v = v_cache[slots[b], :, :lengths[b]].repeat_interleave(heads // kv_heads, 0)
        probs = torch.softmax(torch.einsum("hd,hnd->hn", q[b], k) * dim ** -0.5, -1)
        assert (out[b] - torch.einsum("hn,hnd->hd", probs, v)).abs().max() < 1e-5


def test_engine_decodes_the_same_with_either_attention(make_engine):
    from conftest import LOGIT_TOL, greedy_run, random_prompt
    runs = {}
    for kind in ("triton", "sdpa"):
        engine = make_engine("tiny-qwen3", decode_attention=kind)
        runs[kind] = greedy_run(engine, random_prompt(20, seed=1), 12)
    assert runs["triton"][0] == runs["sdpa"][0]
    scale = runs["sdpa"][1].abs().max().item() if runs["sdpa"][1].dtype != torch.float32 else 1.0
    assert (runs["triton"][1] - runs["sdpa"][1]).abs().max() <= LOGIT_TOL * scale
