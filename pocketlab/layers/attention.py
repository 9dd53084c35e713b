"""Attention over the slot KV cache for prompts (the decode kernel covers one token per row): write the new
K/V, then attend over each slot's live prefix."""

import torch
import torch.nn.functional as F

from ..forward import AttentionPath, ForwardContext


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    targets: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """k, v: [B, T, kv_heads, head_dim] -> cache[slot, :, position] at targets (slot, position) [B, T]."""
    slots, positions = targets
    k_cache[slots, :, positions] = k
    v_cache[slots, :, positions] = v


def cached_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: ForwardContext, scale: float
) -> torch.Tensor:
    """q: [B, T, H, hd] -> [B, T, H, hd], attending to cache[slot, :, :kv_len] (causal, or under ctx.mask).

    Grouped-query heads are folded into the query rows ([B, kv_heads, G*T, hd]) so K/V are never
    repeated in memory.
    """
    B, T, H, hd = q.shape
    kvh = k_cache.shape[1]
    G = H // kvh
    k = k_cache[ctx.slot_ids, :, : ctx.kv_len]
    v = v_cache[ctx.slot_ids, :, : ctx.kv_len]
    if ctx.attention is AttentionPath.CAUSAL:  # no mask tensor, so SDPA can pick its flash kernel
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2)
    qg = q.view(B, T, kvh, G, hd).permute(0, 2, 3, 1, 4).reshape(B, kvh, G * T, hd)
    assert ctx.mask is not None  # MASKED: ctx.prepare built the mask
    m = ctx.mask.expand(B, 1, T, ctx.kv_len).repeat(1, 1, G, 1) if G > 1 else ctx.mask
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale)
    return out.view(B, kvh, G, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, H, hd)
