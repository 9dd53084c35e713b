"""In-place Gated DeltaNet decode kernels against our torch reference (GPU, or Triton's CPU interpreter)."""

import os

import pytest
import torch
import torch.nn.functional as F

from pocketlab.layers import gated_delta as gd
from pocketlab.layers import linear_decode as ld

on_gpu = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    ld.triton is None or not (on_gpu or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton on a GPU (or TRITON_INTERPRET=1)",
)
DEV = "cuda" if on_gpu else "cpu"


def randn(*shape, gen):
    return torch.randn(*shape, generator=gen).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_step_matches_causal_conv1d_and_touches_only_its_slots(dtype):
    gen = torch.Generator().manual_seed(1)
    C, K, slots = 300, 4, torch.tensor([3, 0, 2], device=DEV)
    state = randn(5, C, K - 1, gen=gen).to(dtype)
    x, w = randn(3, C, gen=gen).to(dtype), randn(C, K, gen=gen).to(dtype)
    y_ref, new_ref = gd.causal_conv1d(x[:, None], state[slots], w)
    before = state.clone()
    y = ld.conv_step(x, state, w, slots)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (y.float() - y_ref[:, 0].float()).abs().max() <= tol * max(1.0, y_ref.abs().max().item())
    assert torch.equal(state[slots], new_ref)
    others = [s for s in range(5) if s not in slots.tolist()]
    assert torch.equal(state[others], before[others])


@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 16, 16), (2, 2, 32, 64)])
def test_recurrent_step_matches_the_reference_rule(hk, hv, dk, dv):
    gen = torch.Generator().manual_seed(hv + dv)
    B, slots = 3, torch.tensor([1, 4, 0], device=DEV)
    state = randn(5, hv, dk, dv, gen=gen)
    q, k = randn(B, hk, dk, gen=gen), randn(B, hk, dk, gen=gen)
    v = randn(B, dv, hv, gen=gen).transpose(1, 2)  # as the conv output hands it over in a prompt: dims strided
    g = -F.softplus(randn(B, hv, gen=gen))
    beta = randn(B, hv, gen=gen).sigmoid()
    group = hv // hk
    o_ref, s_ref = gd.recurrent_gated_delta_rule(
        q[:, None].repeat_interleave(group, 2),
        k[:, None].repeat_interleave(group, 2),
        v[:, None],
        g[:, None],
        beta[:, None],
        state[slots],
    )
    before = state.clone()
    o = ld.recurrent_step(q, k, v, g, beta, state, slots, gd.L2_EPS)
    assert (o - o_ref[:, 0]).abs().max() < 1e-5 and (state[slots] - s_ref).abs().max() < 1e-5
    others = [s for s in range(5) if s not in slots.tolist()]
    assert torch.equal(state[others], before[others])


def test_engine_decodes_the_same_either_way(make_engine):
    """Interleaved slots through batch_decode_step: in-place kernels vs the gather / rule / scatter path."""
    from conftest import DTYPE, LOGIT_TOL, random_prompt

    from pocketlab import BatchedRequest

    runs = {}
    for kind in ("triton", "torch"):
        engine = make_engine("tiny-qwen3_5", linear_decode=kind, max_slots=3)
        assert all(
            getattr(layer.mixer, "in_place", False) == (kind == "triton")
            for layer in engine.model.layers
            if hasattr(layer.mixer, "conv_weight")
        )
        reqs = [BatchedRequest(i, random_prompt(n, seed=n), slot_id=i) for i, n in enumerate((5, 23, 40))]
        engine.batch_prefill(reqs)
        logits = []
        for step in range(12):
            live = reqs if step % 3 else reqs[1:]  # slot 0 sits out every third step
            logits.append(engine.batch_decode_step(live).logits)
        runs[kind] = ([r.generated_tokens for r in reqs], logits)
    assert runs["triton"][0] == runs["torch"][0]
    scale = 1.0 if DTYPE == "float32" else max(b.abs().max().item() for b in runs["torch"][1])
    assert max((a - b).abs().max().item() for a, b in zip(runs["triton"][1], runs["torch"][1])) <= LOGIT_TOL * scale
