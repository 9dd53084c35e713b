"""q/k RMSNorm, RoPE and the K/V cache write of every token as one kernel, one program per token.

A program holds all of its token's heads, so a row's arithmetic (the per-head sum of squares in one fixed
[heads, head_dim] tile, the rotation, the rounding) is the same in a decode step, a verify run or a prompt,
whatever else the batch holds. It replaces the dozen small torch kernels per layer that the unfused path
launches (two norms, rotate-half copies, products and sums, two cache scatters). The per-row code is the
default decode kernel's own (`_norm_rope`).
"""

import torch
import triton
import triton.language as tl

from ..decode_attention import _norm_rope, _norm_weights, _token_rows


@triton.jit
def _norm_rotate_store(q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, pos_ptr, qw_ptr, kw_ptr,
                       cos_ptr, sin_ptr, eps, T, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                       stride_vb, stride_vt, stride_vh, stride_kcs, stride_kch, stride_kcp, stride_vcs, stride_vch,
                       stride_vcp, stride_rb, stride_rt, stride_tb,
                       H: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
                       HAS_NORM: tl.constexpr, OFFSET: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_KV: tl.constexpr):  # fmt: skip
    """Token program_id(0) = b * T + t: its q heads normed and rotated into q_out [B*T, H, D], its k heads
    normed, rotated and stored with its v heads at cache[slot, head, position]."""
    tok = tl.program_id(0)
    b, t = tok // T, tok % T
    slot = tl.load(slot_ptr + b * stride_tb + t).to(tl.int64)
    pos = tl.load(pos_ptr + b * stride_tb + t).to(tl.int64)
    d = tl.arange(0, D)
    partner = tl.where(d < ROT, (d + ROT // 2) % ROT, d)
    cos = tl.load(cos_ptr + b * stride_rb + t * stride_rt + d, mask=d < ROT, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + b * stride_rb + t * stride_rt + d, mask=d < ROT, other=0.0).to(tl.float32)

    h = tl.arange(0, BLOCK_H)[:, None]
    q_rows = q_ptr + b * stride_qb + t * stride_qt + h * stride_qh
    q_w, q_wp = _norm_weights(qw_ptr, d, partner, HAS_NORM)
    q, q_partner = _token_rows(q_rows, partner, h < H, d)
    q = _norm_rope(q, q_partner, q_w, q_wp, cos, sin, d, eps, D, ROT, HAS_NORM, OFFSET)
    tl.store(q_out_ptr + tok.to(tl.int64) * H * D + h * D + d[None, :], q, mask=h < H)

    g = tl.arange(0, BLOCK_KV)[:, None]
    k_rows = k_ptr + b * stride_kb + t * stride_kt + g * stride_kh
    k_w, k_wp = _norm_weights(kw_ptr, d, partner, HAS_NORM)
    k, k_partner = _token_rows(k_rows, partner, g < KV_HEADS, d)
    k = _norm_rope(k, k_partner, k_w, k_wp, cos, sin, d, eps, D, ROT, HAS_NORM, OFFSET)
    tl.store(k_cache_ptr + slot * stride_kcs + g * stride_kch + pos * stride_kcp + d[None, :], k, mask=g < KV_HEADS)
    v = tl.load(v_ptr + b * stride_vb + t * stride_vt + g * stride_vh + d[None, :], mask=g < KV_HEADS, other=0.0)
    tl.store(v_cache_ptr + slot * stride_vcs + g * stride_vch + pos * stride_vcp + d[None, :], v, mask=g < KV_HEADS)


def norm_rotate_store(q, k, v, k_cache, v_cache, targets, rope, norms) -> torch.Tensor:
    """q [B, T, H, D], k, v [B, T, KV, D] (head dims contiguous) -> the normed, rotated q [B, T, H, D]; k (normed,
    rotated) and v stored at cache[slot, :, position] for targets (slots, positions) [B, T]. rope: (cos, sin)
    [B, T, 1, rot]; norms: (q_norm, k_norm, eps, offset), or None (Qwen2)."""
    B, T, H, D = q.shape
    kv_heads = k.shape[2]
    if D & (D - 1) or min(t.stride(-1) for t in (q, k, v, k_cache, v_cache)) != 1:
        raise ValueError(f"norm_rotate_store: head_dim {D} must be a power of 2 and every head dim contiguous")
    slots, positions = (t.contiguous() for t in targets)
    cos, sin = rope
    q_norm, k_norm, eps, offset = norms if norms is not None else (q, q, 0.0, False)
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    _norm_rotate_store[(B * T,)](
        q, k, v, out, k_cache, v_cache, slots, positions, q_norm, k_norm, cos, sin, float(eps), T,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), cos.stride(0), cos.stride(1), slots.stride(0),
        H=H, KV_HEADS=kv_heads, D=D, ROT=cos.shape[-1], HAS_NORM=norms is not None, OFFSET=bool(offset),
        BLOCK_H=triton.next_power_of_2(H), BLOCK_KV=triton.next_power_of_2(kv_heads), num_warps=4,
    )  # fmt: skip
    return out
