"""Gated DeltaNet math (pocketlab.layers.gated_delta) against the HF torch reference and against itself.

fp32 everywhere unless a test says otherwise; agreement bound 1e-5 (max abs diff)."""

import math
from itertools import accumulate, pairwise

import pytest
import torch
import torch.nn.functional as F
from conftest import random_prompt
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from pocketlab import BatchedRequest
from pocketlab.layers import gated_delta as gd
from pocketlab.layers.gated_delta import (
    backend_name,
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_delta_rule,
    recurrent_gated_delta_rule,
)

TOL = 1e-5
B, H, DK, DV = 2, 4, 16, 16
C, K = 24, 4  # conv channels, kernel


def maxdiff(a, b):
    return (a.float() - b.float()).abs().max().item()


def make_inputs(batch, T, seed, dtype=torch.float32):
    """Random inputs shaped like the model's: g from the real gate formula (strong and weak decays), beta a
    sigmoid, and a nonzero incoming state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, T, H, DK, generator=gen)
    k = torch.randn(batch, T, H, DK, generator=gen)
    v = torch.randn(batch, T, H, DV, generator=gen)
    A = torch.empty(H).uniform_(0.01, 16, generator=gen)
    g = -A * F.softplus(torch.randn(batch, T, H, generator=gen) - 2.0)
    beta = torch.randn(batch, T, H, generator=gen).sigmoid()
    s0 = torch.randn(batch, H, DK, DV, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), s0


def _torch_only(fn):
    """HF swaps in fla when it is installed (GPU machine); the reference here is HF's own torch code."""
    return getattr(fn, "__wrapped__", fn)


def hf_chunk(q, k, v, g, beta, s0):
    return _torch_only(hf.torch_chunk_gated_delta_rule)(
        q, k, v, g=g, beta=beta, initial_state=s0.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
    )


def hf_recurrent(q, k, v, g, beta, s0):
    return _torch_only(hf.torch_recurrent_gated_delta_rule)(
        q, k, v, g=g, beta=beta, initial_state=s0.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
    )


def with_garbage(x, lengths, value=float("nan")):
    """x with every padding position overwritten, to prove padding never reaches real outputs or states."""
    x = x.clone()
    for b, n in enumerate(lengths.tolist()):
        x[b, n:] = value
    return x


# ------------------------------------------------------------------------------------------------ delta rule vs HF


@pytest.mark.parametrize("T", [1, 63, 64, 65, 150])
def test_matches_hf(T):
    q, k, v, g, beta, s0 = make_inputs(B, T, seed=T)
    o_hc, s_hc = hf_chunk(q, k, v, g, beta, s0)
    o_hr, s_hr = hf_recurrent(q, k, v, g, beta, s0)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, s0)

    assert o_c.shape == (B, T, H, DV) and s_c.shape == (B, H, DK, DV)
    assert s_c.dtype == torch.float32 and s_r.dtype == torch.float32
    for name, (a, b) in {
        "chunk/hf_chunk o": (o_c, o_hc),
        "chunk/hf_chunk S": (s_c, s_hc),
        "chunk/hf_recurrent o": (o_c, o_hr),
        "chunk/hf_recurrent S": (s_c, s_hr),
        "recurrent/hf_recurrent o": (o_r, o_hr),
        "recurrent/hf_recurrent S": (s_r, s_hr),
        "chunk/recurrent o": (o_c, o_r),
        "chunk/recurrent S": (s_c, s_r),
    }.items():
        assert maxdiff(a, b) <= TOL, (name, maxdiff(a, b))


@pytest.mark.parametrize("chunk_size", [16, 32, 128])
def test_chunk_size_does_not_change_result(chunk_size):
    q, k, v, g, beta, s0 = make_inputs(B, 150, seed=7)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=chunk_size)
    assert maxdiff(o_c, o_r) <= TOL and maxdiff(s_c, s_r) <= TOL


def test_no_initial_state_means_zeros_and_caller_state_untouched():
    q, k, v, g, beta, s0 = make_inputs(B, 40, seed=3)
    keep = s0.clone()
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule, gated_delta_rule):
        o_none, s_none = fn(q, k, v, g, beta, None)
        o_zero, s_zero = fn(q, k, v, g, beta, torch.zeros_like(s0))
        assert maxdiff(o_none, o_zero) == 0 and maxdiff(s_none, s_zero) == 0
        fn(q, k, v, g, beta, s0)
        assert torch.equal(s0, keep), fn.__name__


def test_extreme_decay_is_finite():
    """g down to -1e4 per token (exp underflows) and g = 0 (no decay) must both stay finite and agree."""
    q, k, v, g, beta, s0 = make_inputs(B, 100, seed=11)
    g = g.clone()
    g[:, ::7] = -1e4
    g[:, 3::7] = 0.0
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    assert maxdiff(o_c, o_r) <= TOL and maxdiff(s_c, s_r) <= TOL


def test_bf16_inputs():
    q, k, v, g, beta, s0 = make_inputs(B, 70, seed=5, dtype=torch.bfloat16)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    assert o_c.dtype == torch.bfloat16 and s_c.dtype == torch.float32
    o_ref, s_ref = recurrent_gated_delta_rule(q.float(), k.float(), v.float(), g, beta.float(), s0)
    assert maxdiff(o_c, o_ref) < 2e-2 and maxdiff(s_c, s_ref) < 1e-5


# ------------------------------------------------------------------------------------------------ padding, chaining


@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, recurrent_gated_delta_rule, gated_delta_rule])
@pytest.mark.parametrize("short", [3, 65])
def test_ragged_batch_equals_each_sequence_alone(fn, short):
    T = 70
    q, k, v, g, beta, s0 = make_inputs(B, T, seed=short)
    lengths = torch.tensor([T, short])
    args = [with_garbage(x, lengths) for x in (q, k, v, g, beta)]
    o, s = fn(*args, s0, lengths)
    for b, n in enumerate(lengths.tolist()):
        o_b, s_b = fn(
            q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n], g[b : b + 1, :n], beta[b : b + 1, :n], s0[b : b + 1]
        )
        assert maxdiff(o[b, :n], o_b[0]) <= TOL, (b, maxdiff(o[b, :n], o_b[0]))
        assert maxdiff(s[b], s_b[0]) <= TOL, (b, maxdiff(s[b], s_b[0]))


def test_ragged_decode_step_freezes_finished_rows():
    """A T=1 step where one row is padding (length 0 is not allowed, so model it as T=2 with lengths [2, 1])."""
    q, k, v, g, beta, s0 = make_inputs(B, 2, seed=21)
    lengths = torch.tensor([2, 1])
    _, s = gated_delta_rule(*[with_garbage(x, lengths, 1e4) for x in (q, k, v, g, beta)], s0, lengths)
    _, s1 = recurrent_gated_delta_rule(q[1:, :1], k[1:, :1], v[1:, :1], g[1:, :1], beta[1:, :1], s0[1:])
    assert maxdiff(s[1], s1[0]) <= TOL


@pytest.mark.parametrize("split", [1, 64, 70])
def test_chaining_equals_one_call(split):
    T = 150
    q, k, v, g, beta, s0 = make_inputs(B, T, seed=split)
    o_all, s_all = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    parts = [(0, split), (split, T)]
    s, outs = s0, []
    for a, b in parts:
        o, s = gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], s)
        outs.append(o)
    assert maxdiff(torch.cat(outs, 1), o_all) <= TOL and maxdiff(s, s_all) <= TOL


def test_prefill_then_token_by_token_decode():
    T, P = 90, 67
    q, k, v, g, beta, s0 = make_inputs(B, T, seed=9)
    o_all, s_all = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o, s = gated_delta_rule(q[:, :P], k[:, :P], v[:, :P], g[:, :P], beta[:, :P], s0)
    outs = [o]
    for t in range(P, T):
        o, s = gated_delta_rule(
            q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1], beta[:, t : t + 1], s
        )
        outs.append(o)
    assert maxdiff(torch.cat(outs, 1), o_all) <= TOL and maxdiff(s, s_all) <= TOL


# ------------------------------------------------------------------------------------------------ dispatcher


def test_dispatcher_on_cpu_uses_torch():
    assert backend_name("cpu") == "torch"
    assert backend_name(torch.device("cpu")) == "torch"
    q, k, v, g, beta, s0 = make_inputs(B, 65, seed=1)
    o, s = gated_delta_rule(q, k, v, g, beta, s0)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    assert torch.equal(o, o_c) and torch.equal(s, s_c)
    o, s = gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], s0)
    o_r, s_r = recurrent_gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], s0)
    assert torch.equal(o, o_r) and torch.equal(s, s_r)


def fla_chunk_stand_in(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, **packing):
    """What fla 0.6's chunk entry point computes for a sequence-packed call: each sequence [cu[i], cu[i+1]) of
    the one batch row on its own, from its own initial state, its chunks listed in chunk_indices."""
    cu, chunks, size = packing.pop("cu_seqlens"), packing.pop("chunk_indices"), packing.pop("chunk_size")
    assert not packing and q.shape[0] == 1 and output_final_state is True
    lens = (cu[1:] - cu[:-1]).tolist()
    assert initial_state.dtype == torch.float32 and initial_state.shape == (len(lens), H, DK, DV)
    assert chunks.tolist() == [[i, c] for i, n in enumerate(lens) for c in range(-(-n // size))]
    assert math.isclose(scale, q.shape[-1] ** -0.5)
    assert torch.isfinite(q).all() and torch.isfinite(g).all() and torch.isfinite(beta).all()
    if not use_qk_l2norm_in_kernel:  # normalised by the caller (padding is zero): the stand-in must not do it again
        norms = torch.cat([q, k]).float().norm(dim=-1)
        assert ((norms - 1).abs() < 1e-2).logical_or(norms == 0).all()
    outs, states = [], []
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        o, s = _torch_only(hf.torch_chunk_gated_delta_rule)(
            *(x[:, lo:hi] for x in (q, k, v)),
            g=g[:, lo:hi],
            beta=beta[:, lo:hi],
            initial_state=initial_state[i : i + 1].clone(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            chunk_size=size,
        )
        outs.append(o)
        states.append(s)
    return torch.cat(outs, dim=1), torch.cat(states)


def fla_recurrent_stand_in(*, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    assert use_qk_l2norm_in_kernel is True and output_final_state is True and math.isclose(scale, DK**-0.5)
    assert initial_state.dtype == torch.float32 and initial_state.shape == (q.shape[0], H, DK, DV)
    return hf_recurrent(q, k, v, g, beta, initial_state)


@pytest.mark.parametrize("l2norm_rows", [gd.FLA_L2NORM_ROWS, 8])
def test_fla_call_contract(monkeypatch, l2norm_rows):
    """The fla branch, exercised on CPU with stand-ins that check the arguments fla 0.6 expects and compute what
    fla computes: a prompt batch goes as one sequence-packed call (no kernel sees the batch size), q/k are
    normalised in fla's kernel up to FLA_L2NORM_ROWS head vectors and by us past it, the state is [B, H, dk, dv]
    float32."""
    calls = []

    def counted(name, fn):
        return lambda **kw: calls.append(name) or fn(**kw)

    monkeypatch.setattr(gd, "FLA_L2NORM_ROWS", l2norm_rows)
    monkeypatch.setattr(
        gd,
        "_fla_ops",
        lambda device: (counted("chunk", fla_chunk_stand_in), counted("recurrent", fla_recurrent_stand_in)),
    )
    assert backend_name("cpu") == "fla"

    T = 70
    q, k, v, g, beta, s0 = make_inputs(B, T, seed=2)
    lengths = torch.tensor([T, 3])
    o1, s1 = gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], s0)
    gated_delta_rule(q, k, v, g, beta, s0, lengths)
    assert calls == ["recurrent"]  # float32 prompts take our chunk code (fla's would multiply in TF32)
    q16, k16, v16, beta16 = q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16()
    o16, s16 = gated_delta_rule(*[with_garbage(x, lengths) for x in (q16, k16, v16, g, beta16)], s0, lengths)
    assert calls == ["recurrent", "chunk"] and o16.dtype == torch.bfloat16 and s16.dtype == torch.float32
    monkeypatch.undo()

    o_ref, s_ref = chunk_gated_delta_rule(q16.float(), k16.float(), v16.float(), g, beta16.float(), s0, lengths)
    for b, n in enumerate(lengths.tolist()):
        assert maxdiff(o16[b, :n], o_ref[b, :n]) <= 2e-2 * o_ref.abs().max(), b
    assert maxdiff(s16, s_ref) <= 2e-2 * s_ref.abs().max()
    o1_ref, s1_ref = recurrent_gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], s0)
    assert maxdiff(o1, o1_ref) <= TOL and maxdiff(s1, s1_ref) <= TOL


class FlaPartsStandIn:
    """fla's chunk forward in pieces, as `_fla_segments` composes them, with what each piece means computed by our
    token-by-token rule: `states` hands the state entering every chunk of every sequence (h) and leaving each
    sequence, `outputs` runs each chunk from its h. The WY solve passes v and beta through (in u), the cumsum
    passes g through. Each piece checks the packing arguments it is given."""

    log2e = 0.5

    @staticmethod
    def l2norm(x):
        return x, None  # the stand-ins' rule normalises q and k itself

    def cumsum(self, g, chunk_size, scale, cu_seqlens, chunk_indices):
        assert scale == self.log2e and chunk_size == gd.FLA_CHUNK
        self.check(cu_seqlens, chunk_indices)
        return g

    def intra(self, k, v, g, beta, cu_seqlens, chunk_indices, chunk_size):
        return k, torch.cat([v, beta[..., None].to(v.dtype)], dim=-1), None

    def chunks(self, cu_seqlens, chunk_indices):
        """[(first, end)) token range of each listed chunk."""
        cu = cu_seqlens.tolist()
        return [
            (cu[i] + c * gd.FLA_CHUNK, min(cu[i] + (c + 1) * gd.FLA_CHUNK, cu[i + 1]))
            for i, c in chunk_indices.tolist()
        ]

    def check(self, cu_seqlens, chunk_indices):
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        assert chunk_indices.tolist() == [[i, c] for i, n in enumerate(lens) for c in range(-(-n // gd.FLA_CHUNK))]

    def run(self, q, k, u, g, state, lo, hi):
        v, beta = u[:, lo:hi, :, :-1], u[:, lo:hi, :, -1].float()
        return recurrent_gated_delta_rule(q[:, lo:hi], k[:, lo:hi], v, g[:, lo:hi], beta, state[None])

    def states(self, k, w, u, g, initial_state, output_final_state, cu_seqlens, chunk_indices, chunk_offsets,
               chunk_size):  # fmt: skip
        self.check(cu_seqlens, chunk_indices)
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        assert chunk_offsets.tolist() == [0, *accumulate(-(-n // gd.FLA_CHUNK) for n in lens)]
        assert output_final_state and initial_state.shape[0] == len(lens) and torch.equal(w, k)
        h, final = [], initial_state.clone()
        for (lo, hi), (i, _) in zip(self.chunks(cu_seqlens, chunk_indices), chunk_indices.tolist(), strict=True):
            h.append(final[i].clone())
            final[i] = self.run(k, k, u, g, final[i], lo, hi)[1][0]
        return torch.stack(h)[None], u, final

    def outputs(self, q, k, v, h, g, scale, cu_seqlens, chunk_indices, chunk_size):
        self.check(cu_seqlens, chunk_indices)
        assert math.isclose(scale, q.shape[-1] ** -0.5) and h.shape[1] == len(chunk_indices)
        o = torch.full_like(v[..., :-1], float("nan"))
        for j, (lo, hi) in enumerate(self.chunks(cu_seqlens, chunk_indices)):
            o[:, lo:hi] = self.run(q, k, v, g, h[0, j], lo, hi)[0]
        return o


@pytest.mark.parametrize("rows", [1, B])
@pytest.mark.parametrize("ends", [[150], [64, 150], [1, 70, 128, 129, 150]])
def test_fla_segments_compose_fla_parts(monkeypatch, ends, rows):
    """The one-pass segments (`_fla_segments`, the packing, the per-segment state recurrence, the outputs put back
    in rows) on CPU with stand-ins for fla's pieces: bf16 outputs and every segment's end state equal the rule
    run token by token over whole rows, padding rows included."""
    monkeypatch.setattr(gd, "_fla_ops", lambda device: ("chunk", "recurrent"))
    monkeypatch.setattr(gd, "_fla_parts", FlaPartsStandIn)
    T = ends[-1]
    q, k, v, g, beta, s0 = make_inputs(rows, T, seed=3, dtype=torch.bfloat16)
    lengths = torch.tensor([T, 100][:rows])
    inputs = [with_garbage(x, lengths) for x in (q, k, v, g, beta)]
    o, states = gd.gated_delta_rule_segments(*inputs, s0, lengths, ends)
    assert o.dtype == torch.bfloat16 and len(states) == len(ends)
    for b, n in enumerate(lengths.tolist()):
        row = [x[b : b + 1, :n] for x in (q, k, v, g, beta)]
        o_ref = recurrent_gated_delta_rule(*row, s0[b : b + 1])[0]
        assert torch.equal(o[b, :n], o_ref[0]), b
        for end, state in zip(ends, states, strict=True):
            at = [x[:, : min(end, n)] for x in row]
            assert torch.equal(state[b], recurrent_gated_delta_rule(*at, s0[b : b + 1])[1][0]), (b, end)


def test_fla_pieces_with_other_arguments_are_not_used():
    """An fla whose pieces no longer take the keywords the one pass passes is not used for it (segments then run as
    calls of their own) rather than failing inside a prefill."""
    parts = FlaPartsStandIn()
    assert gd.takes_our_arguments(parts)
    renamed = FlaPartsStandIn()
    renamed.states = lambda k, w, u, g, initial_state, output_final_state, cu_seqlens, chunk_indices, chunk_size: None
    assert not gd.takes_our_arguments(renamed)  # no chunk_offsets


def fla_chunk_by_tokens(*, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                        cu_seqlens, chunk_indices, chunk_size):  # fmt: skip
    """fla's chunk entry point at any shape, computed by our token-by-token rule per packed sequence."""
    outs, states = [], []
    for i, (lo, hi) in enumerate(pairwise(cu_seqlens.tolist())):
        o, s = recurrent_gated_delta_rule(*(x[:, lo:hi] for x in (q, k, v, g, beta)), initial_state[i : i + 1])
        outs.append(o)
        states.append(s)
    return torch.cat(outs, dim=1), torch.cat(states)


def fla_recurrent_by_tokens(*, q, k, v, g, beta, initial_state, **_):
    return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state)


def test_engine_prefill_takes_the_one_pass(monkeypatch, make_engine):
    """Through the engine: a bf16 hybrid prefill of two padded prompts with prefix-cache checkpoints inside the
    forward takes the one pass (CPU stand-ins for fla), and its tokens, logits and checkpoint states, and those of a
    prompt resumed from a checkpoint, match the engine on our torch code."""
    opts = dict(dtype="bfloat16", checkpoint_stride=8, prefill_chunk=32, prefix_block=4)
    prompts = [random_prompt(29, seed=1), random_prompt(19, seed=2)]
    resumed = prompts[0][:24] + random_prompt(12, seed=3)  # its forward [24, 36) is cut at 32

    def run(eng):
        first = eng.batch_prefill([BatchedRequest(i, p, slot_id=i) for i, p in enumerate(prompts)]).results
        step = eng.decode_step(first[1].next_token, slot_id=1)  # from the padded row's state
        again = eng.prefill(resumed, slot_id=2)
        assert again.reused_tokens == 24
        states = [eng.prefix.slots[0].states[t] for t in (8, 16, 24)] + [eng.prefix.slots[1].states[16]]
        results = (*first, step, again)
        return [r.next_token for r in results], [r.logits for r in results], states

    monkeypatch.setattr(gd, "_fla_ops", lambda device: None)  # our torch code, also where fla is installed (CUDA)
    tokens, logits, states = run(make_engine("tiny-qwen3_5", **opts))
    parts, passes = FlaPartsStandIn(), []
    real_states = parts.states
    monkeypatch.setattr(parts, "states", lambda **kw: passes.append(len(kw["cu_seqlens"]) - 1) or real_states(**kw))
    monkeypatch.setattr(gd, "_fla_ops", lambda device: (fla_chunk_by_tokens, fla_recurrent_by_tokens))
    monkeypatch.setattr(gd, "_fla_parts", lambda: parts)
    fla = make_engine("tiny-qwen3_5", **opts)
    fla_tokens, fla_logits, fla_states = run(fla)
    layers = sum(t == "linear_attention" for t in fla.cfg.layer_types)
    assert passes == [2] * 4 * layers + [1] * 2 * layers  # both rows cut at 8, 16, 24, 29; the resumed one at 32, 36
    assert tokens == fla_tokens
    for a, b in zip(logits, fla_logits, strict=True):
        assert maxdiff(a, b) <= 0.05 * b.abs().max()
    for a, b in zip(states, fla_states, strict=True):
        assert a.keys() == b.keys()
        assert all(maxdiff(a[key], b[key]) <= 2e-2 * b[key].abs().max() for key in a)


@pytest.mark.skipif(backend_name("cuda") != "fla", reason="needs CUDA and flash-linear-attention")
@pytest.mark.parametrize("rows", [1, B])
@pytest.mark.parametrize("ends", [[300], [64, 128, 300], [1, 70, 256, 257, 300]])
def test_fla_segments_equal_one_fla_call_each(ends, rows):
    """On the GPU the one pass gives the bits of one call of fla's chunk entry point per segment: every output and
    every segment's end state, with a padding row. It fails, rather than skips, where this fla's pieces are not
    usable: prefill would then quietly run one call per segment."""
    assert gd._fla_parts() is not None, "fla is installed but its chunk pieces are not usable by the one pass"
    q, k, v, g, beta, s0 = (x.cuda() for x in make_inputs(rows, ends[-1], seed=5, dtype=torch.bfloat16))
    lengths = torch.tensor([ends[-1], 100][:rows], device="cuda")
    o, states = gd.gated_delta_rule_segments(q, k, v, g, beta, s0, lengths, ends)
    state = s0
    for lo, hi in pairwise([0, *ends]):
        seg = (lengths - lo).clamp(0, hi - lo)
        args = gd._fla_inputs(*(x[:, lo:hi] for x in (q, k, v, g, beta)), state, seg)
        o_ref, state = gd._fla_chunk_packed(gd._fla_ops("cuda")[0], *args, DK**-0.5)
        assert torch.equal(o[:, lo:hi], o_ref), (lo, hi)
        assert torch.equal(states[ends.index(hi)], state), hi


# ------------------------------------------------------------------------------------------------ causal conv1d


def conv_inputs(T, seed, batch=B):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, T, C, generator=gen)
    w = torch.randn(C, K, generator=gen) * 0.5
    state = torch.randn(batch, C, K - 1, generator=gen)
    return x, w, state


def hf_conv_full(x, w):
    return _torch_only(hf.causal_conv1d_fn)(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)


def test_conv_full_sequence_matches_hf():
    x, w, _ = conv_inputs(20, seed=0)
    y, st = causal_conv1d(x, torch.zeros(B, C, K - 1), w, torch.full((B,), 20))
    assert maxdiff(y, hf_conv_full(x, w)) <= TOL
    assert torch.equal(st, x[:, -(K - 1) :].transpose(1, 2))


def test_conv_token_by_token_matches_hf_update():
    T = 12
    x, w, state = conv_inputs(T, seed=1)
    hf_state = state.clone()
    ours = state
    for t in range(T):
        y_hf = hf.causal_conv1d_update(x[:, t : t + 1].transpose(1, 2), hf_state, w, None, "silu").transpose(1, 2)
        y, ours = causal_conv1d(x[:, t : t + 1], ours, w, torch.ones(B, dtype=torch.long))
        assert maxdiff(y, y_hf) <= TOL, t
        assert torch.equal(ours, hf_state), t


def test_conv_prefill_then_decode_matches_hf_full():
    T = 20
    x, w, _ = conv_inputs(T, seed=2)
    y_hf = hf_conv_full(x, w)
    state, outs, t = torch.zeros(B, C, K - 1), [], 0
    for n in [7, 1, 1, 2, 1, 8]:  # pieces shorter and longer than K-1
        y, state = causal_conv1d(x[:, t : t + n], state, w, torch.full((B,), n))
        outs.append(y)
        t += n
    assert maxdiff(torch.cat(outs, 1), y_hf) <= TOL
    assert torch.equal(state, x[:, -(K - 1) :].transpose(1, 2))


@pytest.mark.parametrize("short", [1, 2, 3, 5])
def test_conv_ragged_equals_each_alone(short):
    T = 9
    x, w, state = conv_inputs(T, seed=short)
    lengths = torch.tensor([T, short])
    y, st = causal_conv1d(with_garbage(x, lengths, 1e6), state, w, lengths)
    for b, n in enumerate(lengths.tolist()):
        y_b, st_b = causal_conv1d(x[b : b + 1, :n], state[b : b + 1], w, torch.tensor([n]))
        assert maxdiff(y[b, :n], y_b[0]) <= TOL
        assert torch.equal(st[b], st_b[0])
    # the short row's state is its old history shifted by `short` real inputs
    hist = torch.cat([state[1], x[1, :short].T], dim=-1)
    assert torch.equal(st[1], hist[:, -(K - 1) :])


def test_conv_ragged_chain_matches_hf_per_sequence():
    """Two ragged calls then a decode step; each row must equal HF on its own concatenated real tokens."""
    x, w, _ = conv_inputs(16, seed=4)
    l1, l2 = torch.tensor([6, 2]), torch.tensor([3, 5])
    state = torch.zeros(B, C, K - 1)
    y1, state = causal_conv1d(with_garbage(x[:, :6], l1, -3e3), state, w, l1)
    y2, state = causal_conv1d(with_garbage(x[:, 6:11], l2, 7e3), state, w, l2)
    y3, state = causal_conv1d(x[:, 11:12], state, w, torch.ones(B, dtype=torch.long))
    for b in range(B):
        n1, n2 = int(l1[b]), int(l2[b])
        real = torch.cat([x[b, :n1], x[b, 6 : 6 + n2], x[b, 11:12]])[None]
        got = torch.cat([y1[b, :n1], y2[b, :n2], y3[b]])[None]
        assert maxdiff(got, hf_conv_full(real, w)) <= TOL, b
        assert torch.equal(state[b], real[0, -(K - 1) :].T)


@pytest.mark.skipif(backend_name("cuda") != "fla", reason="needs CUDA and flash-linear-attention")
@pytest.mark.parametrize("T, l2norm_rows", [(1, gd.FLA_L2NORM_ROWS), (65, gd.FLA_L2NORM_ROWS), (150, 8)])
def test_fla_kernels_match_our_torch_code(T, l2norm_rows, monkeypatch):
    """On the GPU the dispatcher runs fla for bf16 (and for one-token steps): it must agree with our float32
    torch code on the same bf16 inputs, to bf16 rounding of the output (q/k normalised in fla's kernel, or by
    us past its one-block limit); float32 prompts run our code."""
    monkeypatch.setattr(gd, "FLA_L2NORM_ROWS", l2norm_rows)
    q, k, v, g, beta, s0 = (x.cuda() for x in make_inputs(B, T, seed=T, dtype=torch.bfloat16))
    lengths = torch.tensor([T, max(1, T // 3)], device="cuda")
    o, s = gd.gated_delta_rule(q, k, v, g, beta, s0, lengths)
    o_ref, s_ref = chunk_gated_delta_rule(q.float(), k.float(), v.float(), g, beta.float(), s0, lengths)
    assert maxdiff(o.float(), o_ref) < 2e-2 * o_ref.abs().max() and maxdiff(s, s_ref) < 2e-2 * s_ref.abs().max()
    q, k, v, beta = q.float(), k.float(), v.float(), beta.float()
    o32, s32 = gd.gated_delta_rule(q, k, v, g, beta, s0, lengths)
    if T > 1:
        assert torch.equal(o32, chunk_gated_delta_rule(q, k, v, g, beta, s0, lengths)[0])
    else:
        assert maxdiff(o32, o_ref) < 1e-4 * o_ref.abs().max() and maxdiff(s32, s_ref) < 1e-4 * s_ref.abs().max()
