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


def test_conv_step_may_write_over_its_input():
    """out=x (ConvStep over a projection's output): the bits of a separate output, windows included."""
    gen = torch.Generator().manual_seed(2)
    C, K, slots = 300, 4, torch.tensor([3, 0], device=DEV)
    state = randn(5, C, K - 1, gen=gen).to(torch.bfloat16)
    x, w = randn(2, C, gen=gen).to(torch.bfloat16), randn(C, K, gen=gen).to(torch.bfloat16)
    state2, x2 = state.clone(), x.clone()
    want = ld.conv_step(x, state, w, slots)
    assert ld.conv_step(x2, state2, w, slots, out=x2) is x2
    assert torch.equal(x2, want) and torch.equal(state2, state)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_gemv_runs_the_decode_conv_in_its_epilogue(state_dtype):
    """The Gated DeltaNet in_proj at decode's rows with the conv in its epilogue (layers.gemv, conv=ConvStep): the
    bits of the projection then conv_step on its first C columns, the other columns untouched, each row's window
    moved on and no other slot's, at every row count the GEMV takes (C off its column tiles)."""
    from pocketlab.layers import gemv
    from pocketlab.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(3)
    C, N, K = 45, 61, 4
    H = gemv.CONV_MIN_K + 96 if on_gpu else 96  # rows long enough for the epilogue on the GPU
    for M in range(1, gemv.MAX_ROWS + 1):
        slots = torch.tensor([4, 1, 3, 0][:M], device=DEV)
        x, w = randn(M, H, gen=gen).to(torch.bfloat16), (randn(N, H, gen=gen) * H**-0.5).to(torch.bfloat16)
        norm = RMSNorm(randn(H, gen=gen).to(torch.bfloat16), 1e-6, offset=True)
        taps = randn(C, K, gen=gen).to(torch.bfloat16)
        state = randn(5, C, K - 1, gen=gen).to(state_dtype)
        want_state = state.clone()
        want = gemv.gemv(x, w, norm=norm)
        ld.conv_step(want[:, :C], want_state, taps, slots, out=want[:, :C])
        got = gemv.gemv(x, w, norm=norm, conv=ld.ConvStep(state, taps, slots))
        assert torch.equal(got, want), M
        assert torch.equal(state, want_state), M


@pytest.mark.parametrize("aside", [False, True])
@pytest.mark.parametrize("switched_on", [False, True])
def test_the_one_row_ring_runs_the_decode_conv_in_its_epilogue_unless_switched_off(switched_on, aside, monkeypatch):
    """A one-row in_proj through the TMA ring (layers.gemv_tma) convolves its first C columns in its own epilogue
    by default, no conv launch after it: the bits of the ring's projection then conv_step, the other columns
    untouched, the row's window moved on (in place, or aside: Into) and no other slot's. With POCKETLAB_RING_CONV=0
    the conv runs after the ring, with the same bits."""
    from pocketlab.layers import gemv, gemv_tma
    from pocketlab.layers.norm import RMSNorm

    monkeypatch.setenv("POCKETLAB_GEMV_TMA", "8,64,3")  # the ring, K over several laps of it
    if switched_on:  # the default
        monkeypatch.delenv("POCKETLAB_RING_CONV", raising=False)
    else:
        monkeypatch.setenv("POCKETLAB_RING_CONV", "0")
    rings, convs_after = [], []
    ring, conv_step = gemv_tma.launch, ld.conv_step
    monkeypatch.setattr(gemv_tma, "launch", lambda *a: rings.append(a[-1] is not None) or ring(*a))
    monkeypatch.setattr(ld, "conv_step", lambda *a, **k: convs_after.append(1) or conv_step(*a, **k))
    gen = torch.Generator().manual_seed(5)
    C, N, K, H = 45, 61, 4, 1032
    slots, rows = torch.tensor([2], device=DEV), torch.tensor([1], device=DEV)
    x, w = randn(1, H, gen=gen).to(torch.bfloat16), (randn(N, H, gen=gen) * H**-0.5).to(torch.bfloat16)
    norm = RMSNorm(randn(H, gen=gen).to(torch.bfloat16), 1e-6, offset=True)
    taps, state = randn(C, K, gen=gen).to(torch.bfloat16), randn(5, C, K - 1, gen=gen).to(torch.bfloat16)
    want, want_state = gemv.gemv(x, w, norm=norm), state.clone()
    conv_step(want[:, :C], want_state, taps, slots, out=want[:, :C])
    before = state.clone()
    bank = torch.full((2, C, K - 1), float("nan"), device=DEV, dtype=state.dtype)
    into = ld.Into(bank, rows) if aside else None
    got = gemv.gemv(x, w, norm=norm, conv=ld.ConvStep(state, taps, slots, into))
    assert torch.equal(got, want)
    assert (
        torch.equal(bank[rows], want_state[slots]) and torch.equal(state, before)
        if aside
        else torch.equal(state, want_state)
    )
    assert rings == [False, switched_on] and len(convs_after) == (not switched_on)


@pytest.mark.parametrize("kernel", ["conv_step", "gemv_conv", "recurrent_step"])
def test_a_step_stores_its_states_aside_where_asked(kernel):
    """into=Into(bank, rows) (a decode step launched ahead): the states the in-place step would leave in its slots,
    bit for bit, at the given rows of the bank, the same outputs, and every slot's own state as it was."""
    from pocketlab.layers import gemv

    gen = torch.Generator().manual_seed(11)
    slots, rows = torch.tensor([3, 0], device=DEV), torch.tensor([1, 0], device=DEV)
    if kernel == "recurrent_step":
        hk, hv, dk, dv = 2, 4, 16, 32
        q, k, v = randn(2, hk, dk, gen=gen), randn(2, hk, dk, gen=gen), randn(2, hv, dv, gen=gen)
        a, b, z = randn(2, hv, gen=gen), randn(2, hv, gen=gen), randn(2, hv * dv, gen=gen)
        gates, norm = (-randn(hv, gen=gen).exp(), randn(hv, gen=gen)), (z, randn(dv, gen=gen), 1e-6)
        state = randn(5, hv, dk, dv, gen=gen)

        def step(state, into=None):
            return ld.recurrent_step(q, k, v, a, b, state, slots, gd.L2_EPS, gates, norm, into=into)

    else:
        C, K, H = 45, 4, gemv.CONV_MIN_K + 96 if on_gpu else 96
        x, w = randn(2, H, gen=gen).to(torch.bfloat16), (randn(61, H, gen=gen) * H**-0.5).to(torch.bfloat16)
        taps, state = randn(C, K, gen=gen).to(torch.bfloat16), randn(5, C, K - 1, gen=gen).to(torch.bfloat16)

        def step(state, into=None):
            if kernel == "gemv_conv":
                return gemv.gemv(x, w, conv=ld.ConvStep(state, taps, slots, into))
            return ld.conv_step(x[:, :C].contiguous(), state, taps, slots, into=into)

    in_place, before = state.clone(), state.clone()
    want = step(in_place)
    bank = torch.full((2, *state.shape[1:]), float("nan"), device=DEV, dtype=state.dtype)
    got = step(state, ld.Into(bank, rows))
    assert torch.equal(got, want) and torch.equal(state, before)
    assert torch.equal(bank[rows], in_place[slots])
    with pytest.raises(ValueError, match="laid out as the states"):
        step(state, ld.Into(bank[:, :1], rows))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_step_with_raw_gates_equals_decay_and_beta_first(dtype):
    """The decode step's kernel computing g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) itself gives
    the bits of the separate decay_and_beta kernel followed by the step: outputs and states. a spans softplus's
    linear branch (> 20) too."""
    from pocketlab.layers.invariant import decay_and_beta

    gen = torch.Generator().manual_seed(7)
    B, hk, hv, dk, dv, slots = 3, 2, 4, 16, 32, torch.tensor([2, 0, 3], device=DEV)
    q, k, v = randn(B, hk, dk, gen=gen).to(dtype), randn(B, hk, dk, gen=gen).to(dtype), randn(B, hv, dv, gen=gen)
    ab = (randn(B, 2 * hv + 1, gen=gen) * 12).to(dtype)  # strided halves, as the in_proj output's a and b
    a, b = ab[:, :hv], ab[:, hv : 2 * hv]
    neg_A, dt_bias = -randn(hv, gen=gen).exp(), randn(hv, gen=gen)
    state = randn(4, hv, dk, dv, gen=gen)
    want_state = state.clone()
    want = ld.recurrent_step(q, k, v.to(dtype), *decay_and_beta(a, b, neg_A, dt_bias), want_state, slots, gd.L2_EPS)
    got = ld.recurrent_step(q, k, v.to(dtype), a, b, state, slots, gd.L2_EPS, gates=(neg_A, dt_bias))
    assert torch.equal(got, want) and torch.equal(state, want_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dv", [32, 128])  # one value block a head, four
def test_recurrent_step_runs_the_gated_norm_in_the_heads_last_block(dtype, dv):
    """gated_norm=(z, w, eps): the step's output is gated_rms_norm(o, z, w) of the same step without it (the row
    kernel's and torch's), with every slot's state as without it; z a strided slice, as of the in_proj output.
    Twice in a row: each launch leaves its arrival counts zeroed for the next."""
    from pocketlab.layers import invariant
    from pocketlab.layers.norm import gated_rms_norm

    gen = torch.Generator().manual_seed(11)
    B, hk, hv, dk, slots = 3, 2, 4, 16, torch.tensor([2, 0, 3], device=DEV)
    neg_A, dt_bias = -randn(hv, gen=gen).exp(), randn(hv, gen=gen)
    weight, eps = (1 + randn(dv, gen=gen) / 4).to(dtype), 1e-6
    state = randn(4, hv, dk, dv, gen=gen)
    want_state = state.clone()
    for _ in range(2):
        q, k = randn(B, hk, dk, gen=gen).to(dtype), randn(B, hk, dk, gen=gen).to(dtype)
        v, ab = (randn(B, hv, dv, gen=gen) * 3).to(dtype), (randn(B, 2 * hv, gen=gen) * 2).to(dtype)
        z = (randn(B, hv * dv + 5, gen=gen) * 3).to(dtype)[:, 2 : 2 + hv * dv]
        args = (q, k, v, ab[:, :hv], ab[:, hv:])
        o = ld.recurrent_step(*args, want_state, slots, gd.L2_EPS, gates=(neg_A, dt_bias))
        got = ld.recurrent_step(*args, state, slots, gd.L2_EPS, gates=(neg_A, dt_bias), gated_norm=(z, weight, eps))
        assert torch.equal(state, want_state)
        for norm in (invariant.gated_rms_norm, gated_rms_norm):  # their sums of squares in another order
            want = norm(o, z.view_as(o), weight, eps)
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
            else:  # equal but for a rounding flip here and there
                torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
                assert (got != want).float().mean() < 0.02


def one_token_at_a_time(lengths, T, step):
    """Drive a one-token kernel over ragged rows: step(rows, t) for the rows still inside their lengths."""
    for t in range(T):
        rows = (lengths > t).nonzero()[:, 0]
        if len(rows):
            step(rows, t)


@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_conv_steps_equal_one_token_steps(dtype, state_dtype):
    """T tokens at once == T conv_step calls bit for bit (outputs and windows); ragged rows, a row shorter than
    the window and an empty one; agrees with causal_conv1d; other slots untouched."""
    gen = torch.Generator().manual_seed(3)
    C, K, T = 300, 4, 20  # two channel blocks, two token tiles
    slots, lengths = torch.tensor([3, 0, 2, 4], device=DEV), torch.tensor([20, 2, 0, 13], device=DEV)
    state = randn(6, C, K - 1, gen=gen).to(state_dtype)
    x, w = randn(4, T, C, gen=gen).to(dtype), randn(C, K, gen=gen).to(dtype)
    stepped, before = state.clone(), state.clone()
    y = ld.conv_steps(x, state, w, slots, lengths)
    y_steps = torch.zeros_like(y)

    def step(rows, t):
        y_steps[rows, t] = ld.conv_step(x[rows, t], stepped, w, slots[rows])

    one_token_at_a_time(lengths, T, step)
    real = torch.arange(T, device=DEV)[None, :] < lengths[:, None]
    assert torch.equal(y[real], y_steps[real]) and torch.equal(state, stepped)
    y_ref, window_ref = gd.causal_conv1d(x, before[slots].to(dtype), w, lengths)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (y[real].float() - y_ref[real].float()).abs().max() <= tol * max(1.0, y_ref.abs().max().item())
    assert torch.equal(state[slots].to(dtype), window_ref)  # the reference carries inputs in x's dtype
    assert torch.equal(state[[1, 5]], before[[1, 5]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_steps_equal_one_token_steps(dtype):
    """T tokens at once == T recurrent_step calls bit for bit (outputs, final states, every intermediate state in
    states_out); padding tokens give 0 and keep the state; agrees with recurrent_gated_delta_rule."""
    gen = torch.Generator().manual_seed(5)
    B, T, hk, hv, dk, dv = 3, 6, 2, 4, 16, 64  # two value blocks per head
    slots, lengths = torch.tensor([1, 4, 0], device=DEV), torch.tensor([6, 3, 0], device=DEV)
    state = randn(5, hv, dk, dv, gen=gen)
    qkv = randn(B, T, 2 * hk * dk + hv * dv, gen=gen).to(dtype)  # as the conv output hands them over: strided
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(B, T, hk, dk), k.view(B, T, hk, dk), v.view(B, T, hv, dv)
    g = -F.softplus(randn(B, T, hv, gen=gen))
    beta = randn(B, T, hv, gen=gen).sigmoid()
    before, stepped = state.clone(), state.clone()
    states_out = torch.full((B, T, hv, dk, dv), float("nan"), device=DEV)
    o = ld.recurrent_steps(q, k, v, g, beta, state, slots, lengths, gd.L2_EPS, states_out)
    o_steps, states_steps = torch.zeros_like(o), torch.zeros_like(states_out)

    def step(rows, t):
        args = (q[rows, t], k[rows, t], v[rows, t], g[rows, t], beta[rows, t])
        o_steps[rows, t] = ld.recurrent_step(*args, stepped, slots[rows], gd.L2_EPS)

    def step_and_keep(rows, t):
        step(rows, t)
        states_steps[:, t] = stepped[slots]

    one_token_at_a_time(lengths, T, step_and_keep)
    for t in range(T):  # rows past their length (none left at all, at the end) keep their final state
        states_steps[:, t] = torch.where((lengths > t).view(B, 1, 1, 1), states_steps[:, t], stepped[slots])
    assert torch.equal(o, o_steps) and torch.equal(state, stepped) and torch.equal(states_out, states_steps)
    assert not o[1, 3:].any() and not o[2].any()  # padding
    group = hv // hk
    o_ref, s_ref = gd.recurrent_gated_delta_rule(
        q.repeat_interleave(group, 2), k.repeat_interleave(group, 2), v, g, beta, before[slots], lengths
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (o.float() - o_ref.float()).abs().max() < tol and (state[slots] - s_ref).abs().max() < 1e-5
    assert torch.equal(state[[2, 3]], before[[2, 3]])


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
    assert (
        max((a - b).abs().max().item() for a, b in zip(runs["triton"][1], runs["torch"][1], strict=True))
        <= LOGIT_TOL * scale
    )


@pytest.mark.parametrize("limit", [8, 64])
def test_prompts_token_by_token_match_the_chunked_rule(make_engine, monkeypatch, limit):
    """linear_in_place_tokens: prompt forwards of at most `limit` tokens run the in-place kernels token by token
    (with prefill chunks of 16, limit 8 mixes both paths in one prompt), through ragged rows, prefix-cache
    checkpoints inside a forward and a prompt resumed from one; the same tokens and logits as the chunked torch rule."""
    from conftest import DTYPE, LOGIT_TOL, random_prompt

    from pocketlab import BatchedRequest
    from pocketlab.graphs import SMALLEST_PROMPT_BUCKET
    from pocketlab.models import qwen3_5

    calls = []
    monkeypatch.setattr(qwen3_5, "recurrent_steps", lambda *a: calls.append(a[0].shape[1]) or ld.recurrent_steps(*a))
    runs = {}
    for kind in ("triton", "torch"):
        eager = dict(prefill_graph_tokens=0) if limit < SMALLEST_PROMPT_BUCKET else {}  # graphs pad rows to 16
        engine = make_engine("tiny-qwen3_5", linear_decode=kind, linear_in_place_tokens=limit, max_slots=3,
                             checkpoint_stride=8, **eager)  # fmt: skip
        shared = random_prompt(40, seed=40)
        reqs = [BatchedRequest(0, shared, slot_id=0), BatchedRequest(1, random_prompt(5, seed=5), slot_id=1)]
        engine.batch_prefill(reqs)
        logits = [engine.batch_decode_step(reqs).logits for _ in range(3)]
        resumed = BatchedRequest(2, shared[:35] + random_prompt(6, seed=6), slot_id=2)  # from the checkpoint at 32
        assert engine.batch_prefill([resumed]).results[0].reused_tokens == 32
        logits += [engine.batch_decode_step([*reqs, resumed]).logits for _ in range(3)]
        runs[kind] = ([r.generated_tokens for r in [*reqs, resumed]], logits)
    assert calls and max(calls) <= limit  # the in-place engine took the token-by-token path, only up to the limit
    assert runs["triton"][0] == runs["torch"][0]
    scale = 1.0 if DTYPE == "float32" else max(b.abs().max().item() for b in runs["torch"][1])
    diff = max((a - b).abs().max().item() for a, b in zip(runs["triton"][1], runs["torch"][1], strict=True))
    assert diff <= LOGIT_TOL * scale
