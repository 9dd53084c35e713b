"""Decode attention straight from the slot KV cache (Triton, split over keys, CUDA only).

One query token per sequence. Each program reads only the live keys of its own slot
(cache[slot, kv_head, :length]) in blocks, so there is no gather copy, no mask tensor, and a
padded key bucket costs nothing. The new token's raw q/k/v arrive as inputs: each program applies the
per-head RMSNorm and rotary embedding itself, and the program whose split holds the last position stores
the new K/V into the cache, so no separate norm, rotary or write kernel runs. Splits over the key axis keep
the GPU busy at batch 1; the last split of each (sequence, kv head) to finish merges the partial softmaxes in
split order, in the same launch (a lone split, as at batch 32, writes its output as it is).
"""

import os
from dataclasses import dataclass

import torch

from .arrivals import arrival_counts

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine uses SDPA there
    triton = None

if triton is not None:
    from . import gemv_tma, pdl
    from .invariant.dot import dot, precision
    from .invariant.elementwise import gated
    from .pdl import wait_then_release
    from .prefetch import LANES, prefetch_l2
    from .prefetch import arguments as prefetch_arguments

    @triton.jit
    def _token_rows(rows, partner, mask, d):
        """Rows [R, D] of the token's raw q or k and, for each dim, its rotate-half partner: one round trip."""
        return tl.load(rows + d[None, :], mask=mask, other=0.0), tl.load(rows + partner[None, :], mask=mask, other=0.0)

    @triton.jit
    def _norm_weights(w_ptr, d, partner, HAS_NORM: tl.constexpr):
        """The per-head norm's weight at each dim and at its rotate-half partner (without a norm: never read)."""
        if HAS_NORM:
            w, wp = tl.load(w_ptr + d), tl.load(w_ptr + partner)
        else:
            w, wp = d, d
        return w, wp

    @triton.jit
    def _norm_rope(x, xp, w, wp, cos, sin, d, eps, D: tl.constexpr, ROT: tl.constexpr, HAS_NORM: tl.constexpr,
                   OFFSET: tl.constexpr):  # fmt: skip
        """Rows [R, D] of raw q or k (xp: each dim's rotate-half partner; w, wp: the norm's weight at both) ->
        per-row RMSNorm (w * x, or (1 + w) * x for Qwen3.5), then rotate-half RoPE on the first ROT dims; rounded
        to the input dtype where layers.norm and layers.rotary round."""
        dtype = x.dtype
        x, xp = x.to(tl.float32), xp.to(tl.float32)
        if HAS_NORM:
            r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            w, wp = w.to(tl.float32)[None, :], wp.to(tl.float32)[None, :]
            if OFFSET:
                x = (x * r * (1.0 + w)).to(dtype).to(tl.float32)
                xp = (xp * r * (1.0 + wp)).to(dtype).to(tl.float32)
            else:
                x = (w * (x * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                xp = (wp * (xp * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        sign = tl.where(d < ROT // 2, -1.0, 1.0)[None, :]
        rotated = x * cos[None, :] + sign * xp * sin[None, :]
        return tl.where((d < ROT)[None, :], rotated, x).to(dtype)

    @triton.jit
    def _cached_block(k_ptr, v_ptr, base, n, d, last, stride_ct):
        """The cached K and V rows `n` [BLOCK_N, D] of one (slot, kv head) at `base`; zeros from the new token's
        position on (its K/V come from the inputs)."""
        cached = (n < last)[:, None]
        k = tl.load(k_ptr + base + n[:, None] * stride_ct + d[None, :], mask=cached, other=0.0)
        v = tl.load(v_ptr + base + n[:, None] * stride_ct + d[None, :], mask=cached, other=0.0)
        return k, v

    @triton.jit
    def _slot_and_length(slot_ptr, len_ptr, b, kvh, stride_cs, stride_ch):
        """Sequence b's length and the cache offset of its (slot, kv head)."""
        slot = tl.load(slot_ptr + b).to(tl.int64)
        return tl.load(len_ptr + b), slot * stride_cs + kvh * stride_ch

    @triton.jit
    def _attend(q, k, v, k_new, v_new, n, last, length, m, l, acc, scale, PRECISION: tl.constexpr):
        """The keys `n` (cached rows k, v; the new token's own at `last`) into the running softmax (m, l, acc) of
        q's rows; keys from `length` on weigh nothing."""
        is_new = (n == last)[:, None]
        k = tl.where(is_new, k_new, k)
        v = tl.where(is_new, v_new, v)
        nothing = tl.zeros((q.shape[0], k.shape[0]), tl.float32)
        s = dot(q, tl.trans(k), nothing, PRECISION) * scale  # [BLOCK_G, BLOCK_N]
        s = tl.where((n < length)[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, tl.zeros_like(acc), PRECISION)
        return m_new, l, acc

    @triton.jit
    def _gate_rows(gate_ptr, b, heads, live, d, stride_gb, stride_gh, GATED: tl.constexpr):
        """Qwen3.5's output gate (the q projection's) for the kv head's query heads [BLOCK_G, D], float32 (without
        a gate: never read)."""
        gate = 0.0
        if GATED:
            gate = tl.load(gate_ptr + b * stride_gb + heads[:, None] * stride_gh + d[None, :], mask=live, other=0.0)
            gate = gate.to(tl.float32)
        return gate

    @triton.jit
    def _store_heads(out_ptr, b, heads, live, d, stride_yb, stride_yh, x, gate, GATED: tl.constexpr):
        """The heads' attention x [BLOCK_G, D] (float32) into `out` in its dtype, times sigmoid(gate) where GATED, as
        invariant.sigmoid_gate applies it."""
        x = x.to(out_ptr.dtype.element_ty)
        if GATED:
            x = gated(x.to(tl.float32), gate, out_ptr.dtype.element_ty)
        tl.store(out_ptr + b * stride_yb + heads[:, None] * stride_yh + d[None, :], x, mask=live)

    @triton.jit
    def _partial_attention(
        q_ptr,
        kn_ptr,
        vn_ptr,
        k_ptr,
        v_ptr,
        slot_ptr,
        len_ptr,
        o_ptr,
        lse_ptr,
        out_ptr,
        arrived_ptr,
        scale,
        qw_ptr,
        kw_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        stride_pb,
        eps,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_vb,
        stride_vh,
        stride_rb,
        stride_cs,
        stride_ch,
        stride_ct,
        stride_ob,
        stride_oh,
        stride_os,
        stride_lb,
        stride_lh,
        stride_yb,
        stride_yh,
        gate_ptr,
        stride_gb,
        stride_gh,
        pf_ptr,
        pf_bytes,
        G: tl.constexpr,
        BLOCK_G: tl.constexpr,
        D: tl.constexpr,
        ROT: tl.constexpr,
        HAS_NORM: tl.constexpr,
        OFFSET: tl.constexpr,
        GATED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT_LEN: tl.constexpr,
        BLOCK_S: tl.constexpr,
        MERGE: tl.constexpr,
        PRECISION: tl.constexpr,
        PREFETCH: tl.constexpr,
        EARLY: tl.constexpr,
        PDL: tl.constexpr,
    ):
        b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        splits = tl.num_programs(2)
        d = tl.arange(0, D)
        start = split * SPLIT_LEN
        # in flight while the kernel before ends, none of it that kernel's output (layers.pdl): the slot, length and
        # position (written two or more launches back), the token's rows of the rotary tables and the norms' weights
        # (constants), and where EARLY the split's first block of cached K/V
        length, base = _slot_and_length(slot_ptr, len_ptr, b, kvh, stride_cs, stride_ch)
        partner = tl.where(d < ROT, (d + ROT // 2) % ROT, d)
        table_row = tl.load(pos_ptr + b * stride_pb).to(tl.int64) * stride_rb
        cos = tl.load(cos_ptr + table_row + d, mask=d < ROT, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + table_row + d, mask=d < ROT, other=0.0).to(tl.float32)
        q_w, q_wp = _norm_weights(qw_ptr, d, partner, HAS_NORM)
        k_w, k_wp = _norm_weights(kw_ptr, d, partner, HAS_NORM)
        n = start + tl.arange(0, BLOCK_N)  # the split's first block of cached keys
        last = length - 1  # the new token: its K/V come from kn/vn, not the cache
        if EARLY:
            k_first, v_first = _cached_block(k_ptr, v_ptr, base, n, d, last, stride_ct)
        if PREFETCH:  # the next projection's weight into L2 while the kernel before ends (layers.prefetch)
            prefetch_l2(pf_ptr, pf_bytes, LANES)
        wait_then_release(PDL)
        # every read the arithmetic waits on is issued here at once: where not before the wait, the split's first
        # block of cached K/V (first: the compiler keeps this order), and the token's rows (the kernel before's output)
        if not EARLY:
            k_first, v_first = _cached_block(k_ptr, v_ptr, base, n, d, last, stride_ct)
        g = tl.arange(0, BLOCK_G)
        heads = kvh * G + g
        q_raw, q_partner = _token_rows(q_ptr + b * stride_qb + heads[:, None] * stride_qh, partner, g[:, None] < G, d)
        k_row = kn_ptr + b * stride_kb + kvh * stride_kh + tl.zeros([1], tl.int32)[:, None]
        k_raw, k_partner = _token_rows(k_row, partner, d[None, :] < D, d)  # [1, D]
        v_new = tl.load(vn_ptr + b * stride_vb + kvh * stride_vh + d)[None, :]
        q = _norm_rope(q_raw, q_partner, q_w, q_wp, cos, sin, d, eps, D, ROT, HAS_NORM, OFFSET)
        k_new = _norm_rope(k_raw, k_partner, k_w, k_wp, cos, sin, d, eps, D, ROT, HAS_NORM, OFFSET)
        at = last + 0 * d[None, :]  # [1, D] copies of the new token's position: stored by the split holding it
        mine = (at >= start) & (at < start + SPLIT_LEN)
        tl.store(k_ptr + base + last * stride_ct + d[None, :], k_new, mask=mine)
        tl.store(v_ptr + base + last * stride_ct + d[None, :], v_new, mask=mine)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        # a block wholly past `length` leaves m, l and acc exactly as they are: the first block, then the loop over
        # the split's other blocks holding live keys (none at one block a split: a loop of static length)
        m, l, acc = _attend(q, k_first, v_first, k_new, v_new, n, last, length, m, l, acc, scale, PRECISION)
        span = BLOCK_N if SPLIT_LEN == BLOCK_N else tl.minimum(SPLIT_LEN, length - start)
        for n0 in range(BLOCK_N, span, BLOCK_N):
            keys = start + n0 + tl.arange(0, BLOCK_N)
            k, v = _cached_block(k_ptr, v_ptr, base, keys, d, last, stride_ct)
            m, l, acc = _attend(q, k, v, k_new, v_new, keys, last, length, m, l, acc, scale, PRECISION)
        out = acc / tl.where(l == 0, 1.0, l)[:, None]
        live = g[:, None] < G
        if splits == 1:  # nothing to merge: the split's output is the merge's, bit for bit, without its round trips
            gate = _gate_rows(gate_ptr, b, heads, live, d, stride_gb, stride_gh, GATED)
            _store_heads(out_ptr, b, heads, live, d, stride_yb, stride_yh, out, gate, GATED)
        else:
            lse = tl.where(l == 0, float("-inf"), m + tl.log(l))
            o_off = b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
            tl.store(o_ptr + o_off, out, mask=live)
            tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g < G)
            # release our split, acquire the others': the last of (b, kvh)'s splits to finish merges them all (the
            # barrier puts every thread's stores before the one thread's atomic)
            tl.debug_barrier()
            arrivals = arrived_ptr + b * tl.num_programs(1) + kvh
            if tl.atomic_add(arrivals, 1, sem="acq_rel") == splits - 1:
                s_idx = tl.arange(0, BLOCK_S)
                lses = tl.load(lse_ptr + b * stride_lb + heads[:, None] * stride_lh + s_idx[None, :],
                               mask=live & (s_idx[None, :] < splits), other=float("-inf"), volatile=True)  # fmt: skip
                gate = _gate_rows(gate_ptr, b, heads, live, d, stride_gb, stride_gh, GATED)  # read with the rest
                top = tl.max(lses, axis=1)
                top = tl.where(top == float("-inf"), 0.0, top)  # no live key at all: every weight is 0
                weights = tl.exp(lses - top[:, None])
                total = tl.sum(weights, axis=1)
                weights = weights / tl.where(total == 0, 1.0, total)[:, None]
                merged = tl.zeros([BLOCK_G, D], tl.float32)
                for t0 in range(0, splits, MERGE):  # MERGE splits' partials read at once, added in split order
                    for i in tl.static_range(MERGE):  # past `splits`: a weight and a partial of 0, adding +0 exactly
                        t = t0 + i
                        w_t = tl.sum(tl.where(s_idx[None, :] == t, weights, 0.0), axis=1)
                        part = tl.load(o_ptr + b * stride_ob + heads[:, None] * stride_oh + t * stride_os + d[None, :],
                                       mask=g[:, None] < G * (t < splits), other=0.0, volatile=True)  # fmt: skip
                        merged += w_t[:, None] * part
                _store_heads(out_ptr, b, heads, live, d, stride_yb, stride_yh, merged, gate, GATED)
                tl.atomic_xchg(arrivals, 0)  # ready for the next launch


MERGE_AT_ONCE = 4  # partials the merge reads in one round trip
PROGRAMS_WANTED = 256  # two waves on an H200's 132 SMs (reports/gpu/decode-attention-splits-h200.txt)


@dataclass(frozen=True)
class Launch:
    """block_n keys a block (0: as many as make K and V tiles of 16 KiB, at most 64: two pipeline stages stay well
    inside shared memory, float32 and head_dim 256 too), num_warps, the key loop's pipeline stages, and `early`:
    whether each program reads its first block of cached K/V before its PDL wait, as the GEMVs read their first
    weight tiles (a kernel two or more launches back wrote them: layers.pdl): `reads_early`."""

    block_n: int = 0
    num_warps: int = 4  # prefetch.LANES: a piece a thread
    num_stages: int = 2
    early: int = 1


DEFAULT_LAUNCH = Launch()


def reads_early(launch: Launch, split_len: int, block_n: int) -> bool:
    """launch.early 0: never, 1: always (with the reads after the wait issued together, one-block splits gain too:
    reports/gpu/ab-attn-loads-first-*), 2: where a split holds several key blocks (batch 32's splits, and batch 1's
    at long prompts)."""
    return launch.early == 1 or (launch.early == 2 and split_len > block_n)


def launch_for() -> Launch:
    """DEFAULT_LAUNCH (read at each call, so the sweep can vary it), or POCKETLAB_ATTN_LAUNCH's
    "block_n:num_warps:num_stages:early", to measure (tools.ab)."""
    return gemv_tma.ring_from_env("POCKETLAB_ATTN_LAUNCH", DEFAULT_LAUNCH, Launch) or DEFAULT_LAUNCH


def available(device) -> bool:
    return triton is not None and torch.device(device).type == "cuda"


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int,
    scale: float,
    rope: tuple[torch.Tensor, torch.Tensor],
    norms=None,
    gate: torch.Tensor | None = None,
    prefetch: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Raw q [B, H, D] and new k/v [B, kv_heads, D] -> [B, H, D]. q and k get the per-head RMSNorm of `norms`
    ((q_weight, k_weight, eps, offset), or None: Qwen2) and RoPE from `rope` (cos, sin [rows, rotary_dim]);
    k/v are stored at cache[slot, :, length - 1]; then attention over cache[slot_ids[b], :, :lengths[b]], times
    sigmoid(gate) ([B, H, D], Qwen3.5's output gate) where one is given, in the merge. `prefetch`: the weight the
    next kernel reads (o_proj's), pulled into L2 meanwhile where layers.prefetch takes it. `positions` [B]: the row
    of `rope` each token reads (the whole tables, so no gather runs before); None: row b.

    `max_len` (a bound on every length, e.g. the key bucket) fixes the grid, so CUDA graphs can replay it.
    """
    B, H, D = q.shape
    kvh = k_cache.shape[1]
    if gate is not None and (gate.shape != q.shape or gate.stride(-1) != 1):
        raise ValueError(f"decode_attention: gate {tuple(gate.shape)} should be q's shape {tuple(q.shape)}, rows whole")
    launch = launch_for()
    block_n = launch.block_n or max(16, min(64, 16384 // (D * k_cache.element_size())))
    split_len = split_length(B * kvh, max_len, block_n)
    splits = triton.cdiv(max_len, split_len)
    block_s = max(triton.next_power_of_2(splits), 2)  # the merge's lanes, one a split
    o = torch.empty(B, H, splits, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, H, splits, device=q.device, dtype=torch.float32)
    out = torch.empty(B, H, D, device=q.device, dtype=q.dtype)
    arrived = arrival_counts(q.device, B * kvh)
    G = H // kvh
    cos, sin = rope
    if positions is None:
        positions = torch.arange(B, device=q.device)
    pf_ptr, pf_bytes, prefetching = prefetch_arguments(prefetch, B, out)
    q_w, k_w, eps, offset = norms if norms is not None else (cos, cos, 0.0, False)  # weights unused without norms
    _partial_attention[(B, kvh, splits)](
        q,
        k,
        v,
        k_cache,
        v_cache,
        slot_ids,
        lengths,
        o,
        lse,
        out,
        arrived,
        scale,
        q_w,
        k_w,
        cos,
        sin,
        positions,
        positions.stride(0),
        eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        o.stride(0),
        o.stride(1),
        o.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        out if gate is None else gate,  # absent: never read
        0 if gate is None else gate.stride(0),
        0 if gate is None else gate.stride(1),
        pf_ptr,
        pf_bytes,
        G=G,
        BLOCK_G=max(triton.next_power_of_2(G), 16),
        D=D,
        ROT=cos.shape[-1],
        HAS_NORM=norms is not None,
        OFFSET=bool(offset),
        GATED=gate is not None,
        BLOCK_N=block_n,
        SPLIT_LEN=split_len,
        BLOCK_S=block_s,
        MERGE=min(block_s, MERGE_AT_ONCE),
        PRECISION=precision(q.dtype, q.device),  # the interpreter's dots in float32: it has no bf16 matmul
        PREFETCH=prefetching,
        EARLY=reads_early(launch, split_len, block_n),
        num_stages=launch.num_stages,
        num_warps=launch.num_warps,
        **pdl.launch(q.device),
    )
    return out


def split_length(programs: int, max_len: int, block_n: int) -> int:
    """Keys per split: enough splits that (sequences x kv heads x splits) reaches ~PROGRAMS_WANTED programs (read
    at each call, so the sweep can vary it; POCKETLAB_ATTN_PROGRAMS sets it, for tools.ab), each a whole number of
    key blocks and at most 64 splits to merge."""
    wanted = int(os.environ.get("POCKETLAB_ATTN_PROGRAMS") or PROGRAMS_WANTED)
    want = max(1, min(64, wanted // programs))
    per_split = triton.cdiv(max_len, want)
    return max(block_n, triton.next_power_of_2(per_split))
