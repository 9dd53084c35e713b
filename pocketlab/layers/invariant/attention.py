"""Batch-invariant attention over the slot KV cache: one arithmetic path for decode, verify, chunked and whole
prefill, so a query's output is bitwise the same whatever else runs beside it.

Every query (b, t) follows the same fixed sequence of operations, whichever tile, batch or mode it lands in:

- keys are cut into splits of SPLIT_KEYS keys at absolute positions (never sized from B, T or the grid); each
  split is a fixed run of BLOCK_N-key blocks through an online softmax;
- the split partials (max, sum, weighted values) are merged in the order 0, 1, 2, ... by one helper: either
  inside the program (many query tiles: prompts, big batches; no partial buffers) or, when the grid would
  leave the GPU idle, by a merge kernel after one program per split. The merge kernel reloads the exact
  float32 partials, so both modes give the same bits;
- tile rows, block sizes and warps depend only on head_dim and the GQA group, so each row's dot products run
  the same instructions whichever rows share its tile;
- blocks and splits a query cannot see are exact no-ops (see `_split_softmax` and `_merge`), so how far a
  tile's loop runs, set by the other rows in it, changes no bit of this row.
"""

import torch

from ..decode_attention import triton

SPLIT_KEYS = 256  # keys per split: the unit of work of one program and of the ordered merge
SPLIT_PROGRAM_LIMIT = 1024  # fewer (batch x kv head x query tile) programs than this: one program per split
PARTIAL_BYTES_LIMIT = 64 << 20  # ...unless the per-split partials would need more memory than this
MERGE_ROWS = 32  # (query, head) rows per merge program

if triton is not None:
    import triton.language as tl

    from .dot import dot, precision

    @triton.jit
    def _split_softmax(
        q,
        k_base,
        v_base,
        stride_kt,
        stride_vt,
        pos,
        key_end,
        split_start,
        n_keys,
        d,
        scale,
        BLOCK_M: tl.constexpr,
        D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Online softmax of the rows q [BLOCK_M, D] over keys split_start .. split_start + n_keys - 1, key n
        counting for row r iff n <= pos[r] -> unnormalised (max [BLOCK_M], sum [BLOCK_M], values [BLOCK_M, D]).

        A block that row r cannot see is an exact no-op for it: every score is -inf, so p = 0, the max stays m
        and alpha = exp(m - m) = exp(0) = 1 (or, before any visible key, m = -inf and l, acc stay 0): l and acc
        are unchanged bit for bit. That is why a tile may run as many blocks as its furthest row needs."""
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for n0 in range(0, n_keys, BLOCK_N):
            n = split_start + n0 + tl.arange(0, BLOCK_N)
            live = (n < key_end)[:, None]  # keys past the slot's end are never read (garbage, even NaN, there)
            k = tl.load(k_base + n[:, None] * stride_kt + d[None, :], mask=live, other=0.0)
            v = tl.load(v_base + n[:, None] * stride_vt + d[None, :], mask=live, other=0.0)
            s = dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PRECISION) * scale
            s = tl.where(n[None, :] <= pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, tl.zeros([BLOCK_M, D], tl.float32), PRECISION)
            m = m_new
        return m, l, acc

    @triton.jit
    def _merge(m, l, acc, m_split, l_split, acc_split):
        """Running softmax (m, l, acc) absorbs the next split's partial. A split the row cannot see (m_split =
        -inf, l_split = acc_split = 0) is an exact no-op: its weight is exp(-inf) = 0 and the running weight
        exp(m - m) = 1; the first visible split enters exactly (weights 0 and 1)."""
        m_new = tl.maximum(m, m_split)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w_run = tl.exp(m - m_safe)
        w_split = tl.exp(m_split - m_safe)
        return m_new, l * w_run + l_split * w_split, acc * w_run[:, None] + acc_split * w_split[:, None]

    @triton.jit
    def _normalise(l, acc):
        """acc / l; rows that saw no key (padding) give 0."""
        return acc / tl.where(l == 0, 1.0, l)[:, None]

    @triton.jit
    def _attention(
        q_ptr,
        k_ptr,
        v_ptr,
        slot_ptr,
        start_ptr,
        len_ptr,
        o_ptr,
        part_o_ptr,
        part_m_ptr,
        part_l_ptr,
        scale,
        T,
        H,
        S,
        stride_qb,
        stride_qt,
        stride_qh,
        stride_kc,
        stride_kh,
        stride_kt,
        stride_vc,
        stride_vh,
        stride_vt,
        stride_ob,
        stride_ot,
        stride_oh,
        KV_HEADS: tl.constexpr,
        G: tl.constexpr,
        QUERIES: tl.constexpr,
        BLOCK_M: tl.constexpr,
        D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr,
        PRECISION: tl.constexpr,
        SPLIT_PROGRAMS: tl.constexpr,
    ):
        """One program: QUERIES queries x G heads of one kv head of sequence b (row r = query r // G, head
        r % G). SPLIT_PROGRAMS: this program's split -> float32 partials; else every split, merged in order."""
        tile, bh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, kvh = bh // KV_HEADS, bh % KV_HEADS
        slot = tl.load(slot_ptr + b).to(tl.int64)
        first = tl.load(start_ptr + b)
        length = tl.load(len_ptr + b)
        key_end = first + length  # the cache holds keys 0 .. key_end - 1 of this slot
        r = tl.arange(0, BLOCK_M)
        t = tile * QUERIES + r // G
        head = kvh * G + r % G
        row = (r < QUERIES * G) & (t < T)
        real = row & (t < length)
        pos = tl.where(real, first + t, -1)  # padding rows see no key
        d = tl.arange(0, D)
        q = tl.load(
            q_ptr + b * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=real[:, None],
            other=0.0,
        )
        k_base = k_ptr + slot * stride_kc + kvh * stride_kh
        v_base = v_ptr + slot * stride_vc + kvh * stride_vh
        keys = tl.max(pos, axis=0) + 1  # keys 0 .. keys - 1 are seen by some row of this tile
        if SPLIT_PROGRAMS:
            split_start = split * SPLIT
            n_keys = tl.minimum(keys - split_start, SPLIT)
            m, l, acc = _split_softmax(
                q, k_base, v_base, stride_kt, stride_vt, pos, key_end, split_start, n_keys, d, scale,
                BLOCK_M, D, BLOCK_N, PRECISION,
            )  # fmt: skip
            part = ((b * T + t) * H + head) * S + split
            mine = real & (pos >= split_start)  # the merge reads exactly the splits holding keys <= pos
            tl.store(part_m_ptr + part, m, mask=mine)
            tl.store(part_l_ptr + part, l, mask=mine)
            tl.store(part_o_ptr + part[:, None] * D + d[None, :], acc, mask=mine[:, None])
        else:
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
            for split_start in range(0, keys, SPLIT):
                m_split, l_split, acc_split = _split_softmax(
                    q, k_base, v_base, stride_kt, stride_vt, pos, key_end, split_start,
                    tl.minimum(keys - split_start, SPLIT), d, scale, BLOCK_M, D, BLOCK_N, PRECISION,
                )  # fmt: skip
                m, l, acc = _merge(m, l, acc, m_split, l_split, acc_split)
            out = _normalise(l, acc)
            o_rows = o_ptr + b * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh
            tl.store(o_rows + d[None, :], out.to(o_ptr.dtype.element_ty), mask=row[:, None])

    @triton.jit
    def _merge_splits(
        part_o_ptr,
        part_m_ptr,
        part_l_ptr,
        start_ptr,
        len_ptr,
        o_ptr,
        T,
        H,
        S,
        rows,
        stride_ob,
        stride_ot,
        stride_oh,
        SPLIT: tl.constexpr,
        BLOCK_R: tl.constexpr,
        D: tl.constexpr,
    ):
        """BLOCK_R (query, head) rows: each row's split partials merged in order 0, 1, 2, ... by `_merge`, as in
        the program-internal loop. Past a row's last split its loads give (-inf, 0, 0): exact no-ops."""
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        real = r < rows
        bt, h = r // H, r % H
        b, t = bt // T, bt % T
        length = tl.load(len_ptr + b, mask=real, other=0)
        pos = tl.where(t < length, tl.load(start_ptr + b, mask=real, other=0) + t, -1)
        n_splits = tl.minimum((pos + SPLIT) // SPLIT, S)  # splits holding keys 0 .. pos (none for padding)
        d = tl.arange(0, D)
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        for split in range(0, tl.max(n_splits, axis=0)):
            mine = split < n_splits
            part = r.to(tl.int64) * S + split
            m_split = tl.load(part_m_ptr + part, mask=mine, other=float("-inf"))
            l_split = tl.load(part_l_ptr + part, mask=mine, other=0.0)
            acc_split = tl.load(part_o_ptr + part[:, None] * D + d[None, :], mask=mine[:, None], other=0.0)
            m, l, acc = _merge(m, l, acc, m_split, l_split, acc_split)
        out = _normalise(l, acc)
        o_rows = o_ptr + b * stride_ob + t * stride_ot + h * stride_oh
        tl.store(o_rows[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=real[:, None])


def tile_shape(head_dim: int, group: int) -> tuple[int, int, int]:
    """(rows per tile, keys per block, warps): functions of head_dim and the GQA group only, never of the batch,
    so a query's dot products run the same instructions in every call. 64 rows hold G heads of 64 // G queries;
    head_dim 256 takes 8 warps to keep the [64, 256] float32 accumulator in registers."""
    rows = max(64, triton.next_power_of_2(group))
    return rows, 64, 4 if head_dim <= 128 else 8


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    start: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    max_len: int,
    *,
    split_programs: bool | None = None,
) -> torch.Tensor:
    """Causal attention of new queries over the slot cache -> [B, T, H, D] in q's dtype.

    q [B, T, H, D] is already normed and rotated; k_cache / v_cache [slots, kv_heads, max_seq, D] already hold
    every new token's K/V. Query (b, t < lengths[b]) sits at position start[b] + t and attends keys 0 ..
    start[b] + t of slot slot_ids[b]; rows t >= lengths[b] are padding and come out 0. `max_len` (a static
    bound on every start + length, e.g. the CUDA-graph key bucket) only sizes the grid; no bit of the result
    depends on it. `split_programs` picks the mode (None: from the shapes alone); both give the same bits.
    No host sync: safe inside CUDA-graph capture.
    """
    if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q [B, T, H, D] and caches [slots, kv_heads, max_seq, D]: {q.shape}, {k_cache.shape}")
    B, T, H, D = q.shape
    kv_heads, cache_len = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[3] != D or H % kv_heads or D < 16 or D & (D - 1):
        raise ValueError(f"head_dim {D} (a power of two >= 16, the caches' too) and {H} heads over {kv_heads}")
    if any(x.shape != (B,) or x.is_floating_point() for x in (slot_ids, start, lengths)):
        raise ValueError(f"slot_ids, start and lengths must each be [{B}] integers")
    if not 0 < max_len <= cache_len:
        raise ValueError(f"max_len {max_len} must be in 1..{cache_len} (the cache length)")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches must be contiguous along head_dim")
    G = H // kv_heads
    block_m, block_n, warps = tile_shape(D, G)
    queries = block_m // G
    tiles = triton.cdiv(T, queries)
    splits = triton.cdiv(max_len, SPLIT_KEYS)
    if split_programs is None:
        partial_bytes = B * T * H * splits * (D + 2) * 4
        split_programs = (
            splits > 1 and B * kv_heads * tiles < SPLIT_PROGRAM_LIMIT and partial_bytes <= PARTIAL_BYTES_LIMIT
        )
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    if split_programs:
        part_o = torch.empty(B, T, H, splits, D, dtype=torch.float32, device=q.device)
        part_m = torch.empty(B, T, H, splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_o = part_m = part_l = out  # not touched
    _attention[(tiles, B * kv_heads, splits if split_programs else 1)](
        q, k_cache, v_cache, slot_ids, start, lengths, out, part_o, part_m, part_l, scale, T, H, splits,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        KV_HEADS=kv_heads, G=G, QUERIES=queries, BLOCK_M=block_m, D=D, BLOCK_N=block_n, SPLIT=SPLIT_KEYS,
        PRECISION=precision(q.dtype, q.device), SPLIT_PROGRAMS=bool(split_programs),
        num_warps=warps,
    )  # fmt: skip
    if split_programs:
        rows = B * T * H
        _merge_splits[(triton.cdiv(rows, MERGE_ROWS),)](
            part_o, part_m, part_l, start, lengths, out, T, H, splits, rows, out.stride(0), out.stride(1),
            out.stride(2), SPLIT=SPLIT_KEYS, BLOCK_R=MERGE_ROWS, D=D, num_warps=4,
        )  # fmt: skip
    return out
