"""Attention over the slot KV cache: write the new K/V, then attend over each slot's live prefix."""
import torch
import torch.nn.functional as F

from ..batch import ForwardBatch
from .decode_attention import decode_attention


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             batch: ForwardBatch, targets: tuple[torch.Tensor, torch.Tensor]) -> None:
    """k, v: [B, T, kv_heads, head_dim] -> cache[slot, :, position]; padding goes to the scratch slot."""
    slots, positions = targets
    k_cache[slots, :, positions] = k
    v_cache[slots, :, positions] = v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           batch: ForwardBatch, ctx: dict, scale: float) -> torch.Tensor:
    """Store the new k, v [B, T, kv_heads, hd] in the cache, then attend: q [B, T, H, hd] -> [B, T, H, hd].

    ctx["mask"] None means one query per sequence on CUDA: the Triton kernel stores the token's K/V and
    reads each slot's live keys in place, in one launch.
    """
    if ctx["mask"] is None:
        out = decode_attention(q[:, 0], k[:, 0], v[:, 0], k_cache, v_cache, batch.slot_ids, ctx["lengths"],
                               batch.kv_len, scale)
        return out[:, None]
    write_kv(k_cache, v_cache, k, v, batch, ctx["targets"])
    return cached_attention(q, k_cache, v_cache, batch, ctx["mask"], scale)


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                     mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, T, H, hd] -> [B, T, H, hd], attending to cache[slot, :, :kv_len] under `mask` [B,1,T,kv_len].

    Grouped-query heads are folded into the query rows ([B, kv_heads, G*T, hd]) so K/V are never
    repeated in memory.
    """
    B, T, H, hd = q.shape
    kvh = k_cache.shape[1]
    G = H // kvh
    k = k_cache[batch.slot_ids, :, :batch.kv_len]
    v = v_cache[batch.slot_ids, :, :batch.kv_len]
    if batch.causal_only:  # a fresh single prompt: no mask tensor, so SDPA can pick its flash kernel
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2)
    qg = q.view(B, T, kvh, G, hd).permute(0, 2, 3, 1, 4).reshape(B, kvh, G * T, hd)
    m = mask.expand(B, 1, T, batch.kv_len).repeat(1, 1, G, 1) if G > 1 else mask
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale)
    return out.view(B, kvh, G, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, H, hd)
