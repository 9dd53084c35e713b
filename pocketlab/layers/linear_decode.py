"""One decode token of a Gated DeltaNet layer, each slot's conv window and recurrent state updated in place.

Why: the batched torch path gathers every slot's state (the conv window and the fp32 dk x dv matrix per head),
runs the rule on the copies and scatters them back: three passes over the largest per-slot data of a decode
step, and a handful of kernels per layer to do it (on the H200 at Qwen3.5-0.8B, batch 32, about half of the
step). These two Triton kernels read each slot's state where it lives and write it back once. The arithmetic
is that of `gated_delta.recurrent_gated_delta_rule` and `causal_conv1d` for one token, in float32.
"""

import torch

from .decode_attention import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _conv_step(
        x_ptr,
        state_ptr,
        w_ptr,
        slot_ptr,
        y_ptr,
        C,
        stride_xb,
        stride_ss,
        stride_sc,
        stride_yb,
        K: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        """y = silu(sum_j w[c, j] * [window | x][c, j]); the window shifts left by one and takes x."""
        b, cb = tl.program_id(0), tl.program_id(1)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        live = c < C
        x = tl.load(x_ptr + b * stride_xb + c, mask=live, other=0.0)
        acc = tl.load(w_ptr + c * K + (K - 1), mask=live, other=0.0).to(tl.float32) * x.to(tl.float32)
        window = state_ptr + slot * stride_ss + c * stride_sc
        for j in tl.static_range(K - 1):
            s = tl.load(window + j, mask=live, other=0.0)
            acc += tl.load(w_ptr + c * K + j, mask=live, other=0.0).to(tl.float32) * s.to(tl.float32)
            if j > 0:
                tl.store(window + (j - 1), s, mask=live)
        tl.store(window + (K - 2), x.to(state_ptr.dtype.element_ty), mask=live)
        y = acc / (1.0 + tl.exp(-acc))
        tl.store(y_ptr + b * stride_yb + c, y.to(y_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _recurrent_step(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
        state_ptr,
        slot_ptr,
        o_ptr,
        scale,
        eps,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_vb,
        stride_vh,
        stride_gb,
        stride_bb,
        stride_ss,
        stride_sh,
        stride_sk,
        stride_ob,
        stride_oh,
        GROUP: tl.constexpr,
        DK: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """S = S * exp(g); S += k (beta (v - S^T k))^T; o = S^T q, with q, k L2-normalised (q also scaled)."""
        b, hv, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        hk = hv // GROUP  # value head hv reads key head hv // GROUP
        kk = tl.arange(0, DK)
        vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        q = tl.load(q_ptr + b * stride_qb + hk * stride_qh + kk).to(tl.float32)
        k = tl.load(k_ptr + b * stride_kb + hk * stride_kh + kk).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
        v = tl.load(v_ptr + b * stride_vb + hv * stride_vh + vv).to(tl.float32)
        g = tl.load(g_ptr + b * stride_gb + hv).to(tl.float32)
        beta = tl.load(beta_ptr + b * stride_bb + hv).to(tl.float32)
        cells = state_ptr + slot * stride_ss + hv * stride_sh + kk[:, None] * stride_sk + vv[None, :]
        S = tl.load(cells) * tl.exp(g)
        delta = beta * (v - tl.sum(S * k[:, None], 0))
        S = S + k[:, None] * delta[None, :]
        tl.store(cells, S)
        o = tl.sum(S * q[:, None], 0)
        tl.store(o_ptr + b * stride_ob + hv * stride_oh + vv, o.to(o_ptr.dtype.element_ty))


def conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """x [B, C] (one token per row) -> silu(causal conv) [B, C]; conv_state[slot_ids[b]] [C, K-1] moves on by x."""
    B, C = x.shape
    K = weight.shape[-1]
    y = torch.empty_like(x)
    block = 256
    _conv_step[(B, triton.cdiv(C, block))](
        x,
        conv_state,
        weight,
        slot_ids,
        y,
        C,
        x.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        y.stride(0),
        K=K,
        BLOCK_C=block,
    )
    return y


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """q, k [B, Hk, dk] raw; v [B, Hv, dv]; g (log-decay), beta [B, Hv] -> o [B, Hv, dv] in v's dtype, while
    state[slot_ids[b]] ([Hv, dk, dv] float32) advances by one token in place."""
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))  # the kernel reads rows whole
    B, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    o = torch.empty(B, Hv, dv, dtype=v.dtype, device=v.device)
    block_v = min(dv, 32)
    _recurrent_step[(B, Hv, triton.cdiv(dv, block_v))](
        q,
        k,
        v,
        g,
        beta,
        state,
        slot_ids,
        o,
        dk**-0.5,
        eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        state.stride(0),
        state.stride(1),
        state.stride(2),
        o.stride(0),
        o.stride(1),
        GROUP=Hv // Hk,
        DK=dk,
        BLOCK_V=block_v,
    )
    return o
