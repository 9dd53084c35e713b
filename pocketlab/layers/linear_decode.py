"""Gated DeltaNet tokens through Triton kernels that update each slot's conv window and recurrent state in place.

Why: the batched torch path gathers every slot's state (the conv window and the fp32 dk x dv matrix per head),
runs the rule on the copies and scatters them back: three passes over the largest per-slot data of a decode
step, and a handful of kernels per layer to do it. These kernels read each slot's state where it lives and
write it back once. The arithmetic is that of `gated_delta.recurrent_gated_delta_rule` and `causal_conv1d`,
in float32.

The one-token kernels (decode) and the multi-token kernels (prompts, chunks, speculative verify) call the same
per-token helpers, `_conv_token` and `_delta_rule_token`, with the same tile shapes and warps: T tokens at once
give bitwise the states and outputs of T one-token steps, which batch-invariant serving relies on.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .arrivals import arrival_counts
from .decode_attention import triton

CONV_BLOCK_C = 256  # channels per conv program
CONV_BLOCK_T = 16  # tokens per conv tile in conv_steps (tokens are independent given the inputs)
STATE_BLOCK_V = 32  # value columns of the [dk, dv] state per recurrent program (capped at dv)
# one- and multi-token recurrent programs alike: the same layout, so the same reduction order; prefetch.LANES threads
STATE_WARPS = 4


class Into(NamedTuple):
    """Where a one-token step stores the states it advances, instead of in place: row rows[b] of `bank` (a bank
    laid out as the slots' own), for batch row b. A decode step launched ahead writes aside so (cache.SlotCache)."""

    bank: torch.Tensor
    rows: torch.Tensor


def checked_into(into: Into | None, state: torch.Tensor, slot_ids: torch.Tensor) -> Into:
    """(bank, rows) a kernel stores to: the states themselves at slot_ids, or `into`, whose rows must be laid out as
    the states' (the kernels index both with the states' strides)."""
    if into is None:
        return Into(state, slot_ids)
    laid_out = into.bank.shape[1:] == state.shape[1:] and into.bank.stride() == state.stride()
    if not laid_out or into.rows.shape != slot_ids.shape:
        raise ValueError(
            f"states stored aside need a bank laid out as the states ({tuple(state.shape[1:])}, strides "
            f"{state.stride()}) and a row per batch row; got {tuple(into.bank.shape)}, strides {into.bank.stride()}, "
            f"rows {tuple(into.rows.shape)}"
        )
    return into


if triton is not None:
    import triton.language as tl

    from . import pdl
    from .invariant.elementwise import sigmoid, softplus
    from .invariant.norm import gated_weighted, rounding_dtypes
    from .invariant.rounding import cast
    from .pdl import wait_then_release
    from .prefetch import LANES, prefetch_l2
    from .prefetch import arguments as prefetch_arguments

    @triton.jit
    def _conv_token(x_ptr, stride_xt, window_ptr, w_ptr, t, c, chan, live, K: tl.constexpr):
        """silu(w[c, K-1] x[t, c] + sum_{j < K-1} w[c, j] full[t + j, c]) in float32 for tokens t [BT] and
        channels c [BC] (chan: c is a channel; live [BT, BC]: load there) -> [BT, BC], where full = [window (K-1
        carried inputs) | x (new inputs)] along time and window_ptr + i points at carried input i of channel c.
        New inputs pass through the window's dtype, as if they had been carried: one token or many, same bits."""
        x = tl.load(x_ptr + t[:, None] * stride_xt + c[None, :], mask=live, other=0.0)
        acc = tl.load(w_ptr + c * K + (K - 1), mask=chan, other=0.0).to(tl.float32)[None, :] * x.to(tl.float32)
        for j in tl.static_range(K - 1):  # taps in a fixed order
            i = (t + j)[:, None]  # index into full
            carried = i < K - 1
            s_old = tl.load(window_ptr + i, mask=live & carried, other=0.0)
            s_new = tl.load(x_ptr + (i - (K - 1)) * stride_xt + c[None, :], mask=live & ~carried, other=0.0)
            s = tl.where(carried, s_old, s_new.to(window_ptr.dtype.element_ty)).to(tl.float32)
            acc += tl.load(w_ptr + c * K + j, mask=chan, other=0.0).to(tl.float32)[None, :] * s
        return acc / (1.0 + tl.exp(-acc))

    @triton.jit
    def _conv_step(
        x_ptr,
        state_ptr,
        w_ptr,
        slot_ptr,
        y_ptr,
        into_ptr,
        into_row_ptr,
        C,
        stride_xb,
        stride_ss,
        stride_sc,
        stride_yb,
        K: tl.constexpr,
        BLOCK_C: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """y = silu(sum_j w[c, j] * [window | x][c, j]); the window, shifted left by one and taking x, is stored
        at into_row_ptr[b] of into_ptr (its own place, or aside). y may be x itself (ConvStep on a projection's
        output): every read of x comes before the barrier ahead of y's store."""
        wait_then_release(PDL)
        b, cb = tl.program_id(0), tl.program_id(1)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        live = c < C
        window = state_ptr + slot * stride_ss + c * stride_sc
        moved = into_ptr + tl.load(into_row_ptr + b).to(tl.int64) * stride_ss + c * stride_sc
        t = tl.zeros([1], tl.int32)
        y = _conv_token(x_ptr + b * stride_xb, 0, window[None, :], w_ptr, t, c, live, live[None, :], K)
        x = tl.load(x_ptr + b * stride_xb + c, mask=live, other=0.0)
        tl.debug_barrier()  # every thread has read x and the window before any overwrites them
        tl.store(y_ptr + b * stride_yb + c[None, :], y.to(y_ptr.dtype.element_ty), mask=live[None, :])
        for j in tl.static_range(1, K - 1):  # in place, each cell is read before it is overwritten, by one thread
            tl.store(moved + (j - 1), tl.load(window + j, mask=live, other=0.0), mask=live)
        tl.store(moved + (K - 2), x.to(state_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _conv_steps(
        x_ptr,
        state_ptr,
        w_ptr,
        slot_ptr,
        y_ptr,
        T,
        C,
        stride_xb,
        stride_xt,
        stride_ss,
        stride_sc,
        stride_yb,
        stride_yt,
        K: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        """y of BLOCK_T tokens x BLOCK_C channels: given the carried window and the new inputs, tokens are
        independent, so every tile runs in parallel (the window moves on afterwards, in `_conv_advance`)."""
        b, cb, tb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        live = (t < T)[:, None] & (c < C)[None, :]
        window = state_ptr + slot * stride_ss + c * stride_sc
        y = _conv_token(x_ptr + b * stride_xb, stride_xt, window[None, :], w_ptr, t, c, c < C, live, K)
        tl.store(y_ptr + b * stride_yb + t[:, None] * stride_yt + c[None, :], y.to(y_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _conv_advance(
        x_ptr,
        state_ptr,
        slot_ptr,
        len_ptr,
        T,
        C,
        stride_xb,
        stride_xt,
        stride_ss,
        stride_sc,
        K: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        """window[j] = full[length + j], full = [window | x]: the last K-1 inputs of the first lengths[b] tokens.
        Ascending j reads each carried cell before it is overwritten, by the same thread."""
        b, cb = tl.program_id(0), tl.program_id(1)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        length = tl.minimum(tl.load(len_ptr + b), T)
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        live = c < C
        window = state_ptr + slot * stride_ss + c * stride_sc
        for j in tl.static_range(K - 1):
            i = length + j + tl.zeros_like(c)  # per channel: the interpreter cannot mask with scalar & tensor
            s_old = tl.load(window + i, mask=live & (i < K - 1), other=0.0)
            s_new = tl.load(x_ptr + b * stride_xb + (i - (K - 1)) * stride_xt + c, mask=live & (i >= K - 1), other=0.0)
            s = tl.where(i < K - 1, s_old, s_new.to(state_ptr.dtype.element_ty))
            tl.store(window + j, s, mask=live)

    @triton.jit
    def _delta_rule_token(S, q, k, v, g, beta, scale, eps):
        """One token on the state block S [dk, BLOCK_V] (float32, as are the raw q, k [dk], v [BLOCK_V], g, beta):
        S = S * exp(g); S += k (beta (v - S^T k))^T; o = S^T q, with q, k L2-normalised (q also scaled)."""
        q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
        S = S * tl.exp(g)
        delta = beta * (v - tl.sum(S * k[:, None], 0))
        S = S + k[:, None] * delta[None, :]
        return S, tl.sum(S * q[:, None], 0)

    @triton.jit
    def _recurrent_step(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
        state_ptr,
        slot_ptr,
        into_ptr,
        into_row_ptr,
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
        neg_a_ptr,
        dt_ptr,
        z_ptr,
        norm_w_ptr,
        arrived_ptr,
        stride_zb,
        norm_eps,
        pf_ptr,
        pf_bytes,
        GROUP: tl.constexpr,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BLOCK_V: tl.constexpr,
        RAW_GATES: tl.constexpr,
        NORM: tl.constexpr,
        X_DTYPE: tl.constexpr,
        WX_DTYPE: tl.constexpr,
        PREFETCH: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One token per row: the state block of (slot, value head, value block) loaded, advanced, stored at row
        into_row_ptr[b] of into_ptr (its own place, or aside). With RAW_GATES g and beta are computed here from the
        raw a and b, as invariant.decay_and_beta computes them. NORM: the last of a head's value blocks to finish
        runs the gated output norm on the head's whole row (its o as stored, the gate z, the weight), as
        invariant.gated_rms_norm computes it, and writes it over o.
        PREFETCH: out_proj's weight into L2 meanwhile (layers.prefetch)."""
        if PREFETCH:
            prefetch_l2(pf_ptr, pf_bytes, LANES)
        wait_then_release(PDL)
        b, hv, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        hk = hv // GROUP  # value head hv reads key head hv // GROUP
        kk = tl.arange(0, DK)
        vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        q = tl.load(q_ptr + b * stride_qb + hk * stride_qh + kk).to(tl.float32)
        k = tl.load(k_ptr + b * stride_kb + hk * stride_kh + kk).to(tl.float32)
        v = tl.load(v_ptr + b * stride_vb + hv * stride_vh + vv).to(tl.float32)
        g = tl.load(g_ptr + b * stride_gb + hv).to(tl.float32)
        beta = tl.load(beta_ptr + b * stride_bb + hv).to(tl.float32)
        if RAW_GATES:  # g holds a, beta holds b
            g = tl.load(neg_a_ptr + hv) * softplus(g + tl.load(dt_ptr + hv))
            beta = cast(sigmoid(beta), beta_ptr.dtype.element_ty).to(tl.float32)
        block = hv * stride_sh + kk[:, None] * stride_sk + vv[None, :]
        S, o = _delta_rule_token(tl.load(state_ptr + slot * stride_ss + block), q, k, v, g, beta, scale, eps)
        tl.store(into_ptr + tl.load(into_row_ptr + b).to(tl.int64) * stride_ss + block, S)
        tl.store(o_ptr + b * stride_ob + hv * stride_oh + vv, o.to(o_ptr.dtype.element_ty))
        if NORM:  # every thread's store before the one thread's atomic; the last block of the head norms it
            tl.debug_barrier()
            arrivals = arrived_ptr + b * tl.num_programs(1) + hv
            if tl.atomic_add(arrivals, 1, sem="acq_rel") == DV // BLOCK_V - 1:
                d = tl.arange(0, DV)
                row = o_ptr + b * stride_ob + hv * stride_oh + d
                x = tl.load(row, volatile=True).to(tl.float32)
                inv_rms = tl.rsqrt(tl.sum(x * x, 0) / DV + norm_eps)
                z = tl.load(z_ptr + b * stride_zb + hv * DV + d).to(tl.float32)
                w = tl.load(norm_w_ptr + d).to(tl.float32)
                y = gated_weighted(x * inv_rms, w, z, X_DTYPE, WX_DTYPE)
                tl.store(row, cast(y, o_ptr.dtype.element_ty))
                tl.atomic_xchg(arrivals, 0)  # ready for the next launch

    @triton.jit
    def _recurrent_steps(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
        state_ptr,
        slot_ptr,
        len_ptr,
        o_ptr,
        states_ptr,
        scale,
        eps,
        T,
        stride_qb,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_gb,
        stride_gt,
        stride_gh,
        stride_bb,
        stride_bt,
        stride_bh,
        stride_ss,
        stride_sh,
        stride_sk,
        stride_ob,
        stride_ot,
        stride_oh,
        stride_xb,
        stride_xt,
        stride_xh,
        stride_xk,
        GROUP: tl.constexpr,
        DK: tl.constexpr,
        BLOCK_V: tl.constexpr,
        KEEP_STATES: tl.constexpr,
    ):
        """The first lengths[b] tokens of row b with the state block held in registers; padding tokens give o = 0
        and (KEEP_STATES) repeat the final state."""
        b, hv, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        length = tl.minimum(tl.load(len_ptr + b), T)
        hk = hv // GROUP
        kk = tl.arange(0, DK)
        vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        cells = state_ptr + slot * stride_ss + hv * stride_sh + kk[:, None] * stride_sk + vv[None, :]
        kept = states_ptr + b * stride_xb + hv * stride_xh + kk[:, None] * stride_xk + vv[None, :]
        o_row = o_ptr + b * stride_ob + hv * stride_oh + vv
        q_row = q_ptr + b * stride_qb + hk * stride_qh + kk
        k_row = k_ptr + b * stride_kb + hk * stride_kh + kk
        v_row = v_ptr + b * stride_vb + hv * stride_vh + vv
        g_row = g_ptr + b * stride_gb + hv * stride_gh
        beta_row = beta_ptr + b * stride_bb + hv * stride_bh
        S = tl.load(cells)
        q, k, v = tl.load(q_row), tl.load(k_row), tl.load(v_row)
        g, beta = tl.load(g_row), tl.load(beta_row)
        for t in range(0, length):
            ahead = tl.minimum(t + 1, T - 1)  # the next token's inputs load while this one computes
            q_next, k_next = tl.load(q_row + ahead * stride_qt), tl.load(k_row + ahead * stride_kt)
            v_next = tl.load(v_row + ahead * stride_vt)
            g_next, beta_next = tl.load(g_row + ahead * stride_gt), tl.load(beta_row + ahead * stride_bt)
            S, o = _delta_rule_token(
                S, q.to(tl.float32), k.to(tl.float32), v.to(tl.float32), g.to(tl.float32), beta.to(tl.float32),
                scale, eps,
            )  # fmt: skip
            tl.store(o_row + t * stride_ot, o.to(o_ptr.dtype.element_ty))
            if KEEP_STATES:
                tl.store(kept + t * stride_xt, S)
            q, k, v, g, beta = q_next, k_next, v_next, g_next, beta_next
        tl.store(cells, S)
        for t in range(length, T):
            tl.store(o_row + t * stride_ot, tl.zeros([BLOCK_V], tl.float32).to(o_ptr.dtype.element_ty))
            if KEEP_STATES:
                tl.store(kept + t * stride_xt, S)


def conv_step(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slot_ids: torch.Tensor,
    out: torch.Tensor | None = None,
    into: Into | None = None,
) -> torch.Tensor:
    """x [B, C] (one token per row) -> silu(causal conv) [B, C] (into `out`, which may be x); conv_state[slot_ids[b]]
    [C, K-1] moves on by x, stored in place or, with `into`, at into.rows[b] of into.bank."""
    B, C = x.shape
    K = weight.shape[-1]
    y = torch.empty_like(x) if out is None else out
    bank, rows = checked_into(into, conv_state, slot_ids)
    _conv_step[(B, triton.cdiv(C, CONV_BLOCK_C))](
        x,
        conv_state,
        weight,
        slot_ids,
        y,
        bank,
        rows,
        C,
        x.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        y.stride(0),
        K=K,
        BLOCK_C=CONV_BLOCK_C,
        **pdl.launch(x.device),
    )
    return y


@dataclass(frozen=True)
class ConvStep:
    """The causal conv of one token per row on the first `channels` columns of the projection that produces its
    input (the Gated DeltaNet's in_proj: qkv first): handed to that projection as `conv=`, which runs it in its own
    epilogue where it can (layers.gemv), else right after, in place."""

    state: torch.Tensor  # [slots, C, K-1]: every slot's window
    weight: torch.Tensor  # [C, K]
    slot_ids: torch.Tensor  # [B]: the slot of row b
    into: Into | None = None  # where the moved windows go (None: in place)

    @property
    def channels(self) -> int:
        return self.weight.shape[0]

    def stored_to(self) -> Into:
        """(bank, rows) the moved windows go to: the slots' own windows, or `into`'s rows."""
        return checked_into(self.into, self.state, self.slot_ids)

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        """y [B, (1,) N >= channels] with its first `channels` columns convolved in place; the windows move on."""
        y2 = y.view(-1, y.shape[-1])[:, : self.channels]
        conv_step(y2, self.state, self.weight, self.slot_ids, out=y2, into=self.into)
        return y


def conv_steps(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, slot_ids: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """x [B, T, C] -> silu(causal conv) [B, T, C], bitwise as T calls of conv_step; conv_state[slot_ids[b]]
    [C, K-1] moves on by the first lengths[b] tokens of row b (padding tokens leave it alone)."""
    B, T, C = x.shape
    K = weight.shape[-1]
    if weight.shape != (C, K) or conv_state.shape[1:] != (C, K - 1) or K < 2:
        raise ValueError(f"x [B, T, C], weight [C, K >= 2], conv_state [slots, C, K-1]: {x.shape}, {weight.shape}")
    if slot_ids.shape != (B,) or lengths.shape != (B,):
        raise ValueError(f"slot_ids and lengths must each be [{B}]")
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or conv_state.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError("x, weight and conv_state must be contiguous along their last dim (weight entirely)")
    y = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    blocks_c = triton.cdiv(C, CONV_BLOCK_C)
    _conv_steps[(B, blocks_c, triton.cdiv(T, CONV_BLOCK_T))](
        x,
        conv_state,
        weight,
        slot_ids,
        y,
        T,
        C,
        x.stride(0),
        x.stride(1),
        conv_state.stride(0),
        conv_state.stride(1),
        y.stride(0),
        y.stride(1),
        K=K,
        BLOCK_T=CONV_BLOCK_T,
        BLOCK_C=CONV_BLOCK_C,
    )
    _conv_advance[(B, blocks_c)](
        x,
        conv_state,
        slot_ids,
        lengths,
        T,
        C,
        x.stride(0),
        x.stride(1),
        conv_state.stride(0),
        conv_state.stride(1),
        K=K,
        BLOCK_C=CONV_BLOCK_C,
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
    gates: tuple[torch.Tensor, torch.Tensor] | None = None,
    gated_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    prefetch: torch.Tensor | None = None,
    into: Into | None = None,
) -> torch.Tensor:
    """q, k [B, Hk, dk] raw; v [B, Hv, dv]; g (log-decay), beta [B, Hv] -> o [B, Hv, dv] in v's dtype, while
    state[slot_ids[b]] ([Hv, dk, dv] float32) advances by one token, in place or, with `into`, stored at
    into.rows[b] of into.bank. With `gates` = (neg_A, dt_bias) [Hv] float32, g and beta are the raw a and b, and the
    decay and beta are computed in the same kernel (one launch less per layer and step); with `gated_norm` = (z
    [B, Hv * dv] rows, weight [dv], eps), o is gated_rms_norm(o, z, weight, eps) from the same launch (one more less;
    its sum of squares in another order). `prefetch`: the weight the next kernel reads (out_proj's), pulled into L2
    meanwhile where layers.prefetch takes it."""
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))  # the kernel reads rows whole
    B, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    o = torch.empty(B, Hv, dv, dtype=v.dtype, device=v.device)
    block_v = min(dv, STATE_BLOCK_V)
    z, norm_weight, norm_eps = gated_norm if gated_norm is not None else (o.view(B, -1), o, 0.0)  # unread if absent
    if z.stride(-1) != 1 or tuple(z.shape) != (B, Hv * dv) or tuple(norm_weight.shape[-1:]) != (dv,):
        raise ValueError(f"recurrent_step: gate rows {tuple(z.shape)} and norm weight {tuple(norm_weight.shape)} "
                         f"for {B} rows of {Hv} x {dv}")  # fmt: skip
    counts = arrival_counts(v.device, B * Hv) if gated_norm is not None else slot_ids  # unread if absent
    pf_ptr, pf_bytes, prefetching = prefetch_arguments(prefetch, B, o)
    bank, rows = checked_into(into, state, slot_ids)
    _recurrent_step[(B, Hv, triton.cdiv(dv, block_v))](
        q,
        k,
        v,
        g,
        beta,
        state,
        slot_ids,
        bank,
        rows,
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
        *(gates if gates is not None else (g, g)),
        z,
        norm_weight,
        counts,
        z.stride(0),
        float(norm_eps),
        pf_ptr,
        pf_bytes,
        GROUP=Hv // Hk,
        DK=dk,
        DV=dv,
        BLOCK_V=block_v,
        RAW_GATES=gates is not None,
        NORM=gated_norm is not None,
        **rounding_dtypes(o.dtype, norm_weight.dtype),
        PREFETCH=prefetching,
        num_warps=STATE_WARPS,
        **pdl.launch(v.device),
    )
    return o


def recurrent_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    lengths: torch.Tensor,
    eps: float,
    states_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k [B, T, Hk, dk] raw; v [B, T, Hv, dv]; g (log-decay), beta [B, T, Hv] -> o [B, T, Hv, dv] in v's
    dtype, bitwise as T calls of recurrent_step: state[slot_ids[b]] ([Hv, dk, dv] float32) advances in place
    over the first lengths[b] tokens; padding tokens give o = 0 and leave it alone. states_out ([B, T, Hv, dk,
    dv] float32, optional) receives the state after each token (after the last real one, on padding): what a
    speculative verify needs to roll back to any accepted prefix."""
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    B, T, Hk, dk = q.shape
    Hv, dv = v.shape[2], v.shape[3]
    if k.shape != q.shape or v.shape[:2] != (B, T) or g.shape != (B, T, Hv) or beta.shape != (B, T, Hv):
        raise ValueError(f"q, k [B, T, Hk, dk], v [B, T, Hv, dv], g, beta [B, T, Hv]: {q.shape}, {v.shape}, {g.shape}")
    if Hv % Hk or state.shape[1:] != (Hv, dk, dv) or state.dtype != torch.float32 or state.stride(-1) != 1:
        raise ValueError(f"state must be float32 [slots, {Hv}, {dk}, {dv}] with value heads a multiple of key heads")
    if slot_ids.shape != (B,) or lengths.shape != (B,):
        raise ValueError(f"slot_ids and lengths must each be [{B}]")
    if states_out is not None and (
        states_out.shape != (B, T, Hv, dk, dv) or states_out.dtype != torch.float32 or states_out.stride(-1) != 1
    ):
        raise ValueError(f"states_out must be float32 [{B}, {T}, {Hv}, {dk}, {dv}]")
    o = torch.empty(B, T, Hv, dv, dtype=v.dtype, device=v.device)
    if T == 0:
        return o
    kept = states_out if states_out is not None else state  # not touched without states_out
    block_v = min(dv, STATE_BLOCK_V)
    _recurrent_steps[(B, Hv, triton.cdiv(dv, block_v))](
        q,
        k,
        v,
        g,
        beta,
        state,
        slot_ids,
        lengths,
        o,
        kept,
        dk**-0.5,
        eps,
        T,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *g.stride(),
        *beta.stride(),
        *state.stride()[:3],
        *o.stride()[:3],
        *(kept.stride()[:4] if states_out is not None else (0, 0, 0, 0)),
        GROUP=Hv // Hk,
        DK=dk,
        BLOCK_V=block_v,
        KEEP_STATES=states_out is not None,
        num_warps=STATE_WARPS,
    )
    return o
