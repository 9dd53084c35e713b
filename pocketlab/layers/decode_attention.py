"""Decode attention straight from the slot KV cache (Triton, split over keys, CUDA only).

One query token per sequence. Each program reads only the live keys of its own slot
(cache[slot, kv_head, :length]) in blocks, so there is no gather copy, no mask tensor, and a
padded key bucket costs nothing. The new token's K/V arrive in registers: the program whose split
holds the last position uses them and stores them into the cache, so no separate write kernel runs.
Splits over the key axis keep the GPU busy at batch 1; a short epilogue merges the partial softmaxes.
"""
import torch

from .fused import cuda_compiled

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine uses SDPA there
    triton = None

if triton is not None:
    @triton.jit
    def _partial_attention(q_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, o_ptr, lse_ptr, scale,
                           stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                           stride_cs, stride_ch, stride_ct, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                           G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                           BLOCK_N: tl.constexpr, SPLIT_LEN: tl.constexpr, PRECISION: tl.constexpr):
        b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        length = tl.load(len_ptr + b)
        last = length - 1  # the new token: its K/V come from kn/vn, not the cache
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        heads = kvh * G + g
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=g[:, None] < G, other=0.0)
        k_new = tl.load(kn_ptr + b * stride_kb + kvh * stride_kh + d)
        v_new = tl.load(vn_ptr + b * stride_vb + kvh * stride_vh + d)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        base = slot * stride_cs + kvh * stride_ch
        start = split * SPLIT_LEN
        at = last + 0 * d  # [D] copies of the new token's position: this split stores it if it holds it
        mine = (at >= start) & (at < start + SPLIT_LEN)
        tl.store(k_ptr + base + last * stride_ct + d, k_new, mask=mine)
        tl.store(v_ptr + base + last * stride_ct + d, v_new, mask=mine)
        for n0 in range(0, SPLIT_LEN, BLOCK_N):  # masked loads past `length` move no memory
            n = start + n0 + tl.arange(0, BLOCK_N)
            cached = n < last
            k = tl.load(k_ptr + base + n[:, None] * stride_ct + d[None, :], mask=cached[:, None], other=0.0)
            v = tl.load(v_ptr + base + n[:, None] * stride_ct + d[None, :], mask=cached[:, None], other=0.0)
            is_new = (n == last)[:, None]
            k = tl.where(is_new, k_new[None, :], k)
            v = tl.where(is_new, v_new[None, :], v)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_N]
            s = tl.where((n < length)[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / tl.where(l == 0, 1.0, l)[:, None]
        lse = tl.where(l == 0, float("-inf"), m + tl.log(l))
        o_off = b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
        tl.store(o_ptr + o_off, out, mask=g[:, None] < G)
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g < G)


def available(device) -> bool:
    return triton is not None and torch.device(device).type == "cuda"


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_ids: torch.Tensor, lengths: torch.Tensor, max_len: int,
                     scale: float) -> torch.Tensor:
    """q [B, H, D], new k/v [B, kv_heads, D] -> [B, H, D]: stores k/v at cache[slot, :, length - 1], then
    attends over cache[slot_ids[b], :, :lengths[b]].

    `max_len` (a bound on every length, e.g. the key bucket) fixes the grid, so CUDA graphs can replay it.
    """
    B, H, D = q.shape
    kvh = k_cache.shape[1]
    # K and V tiles of 16 KiB each keep two pipeline stages well inside shared memory (fp32, head_dim 256 too)
    block_n = max(16, min(64, 16384 // (D * k_cache.element_size())))
    split_len = split_length(B * kvh, max_len, block_n)
    splits = triton.cdiv(max_len, split_len)
    o = torch.empty(B, H, splits, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, H, splits, device=q.device, dtype=torch.float32)
    G = H // kvh
    _partial_attention[(B, kvh, splits)](
        q, k, v, k_cache, v_cache, slot_ids, lengths, o, lse, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), o.stride(0), o.stride(1), o.stride(2),
        lse.stride(0), lse.stride(1),
        G=G, BLOCK_G=max(triton.next_power_of_2(G), 16), D=D, BLOCK_N=block_n, SPLIT_LEN=split_len,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_stages=2)
    return merge_splits(o, lse, q)


def split_length(programs: int, max_len: int, block_n: int, target: int = 256) -> int:
    """Keys per split: enough splits that (sequences x kv heads x splits) reaches ~`target` programs (two
    waves on an H200's 132 SMs), each a whole number of key blocks and at most 64 splits to merge."""
    want = max(1, min(64, target // programs))
    per_split = triton.cdiv(max_len, want)
    return max(block_n, triton.next_power_of_2(per_split))


@cuda_compiled
def merge_splits(o: torch.Tensor, lse: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Combine the per-split softmaxes [B, H, S, D] by their log-sum-exps (one kernel on CUDA)."""
    weights = torch.softmax(lse, dim=-1).nan_to_num(0.0)  # splits past the end have lse = -inf
    return (o * weights[..., None]).sum(dim=2).to(like.dtype)
