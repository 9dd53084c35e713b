"""One decode token's attention and o_proj (with the residual add) in one launch, for small o_proj weights.

At batch 1 with short prompts the decode attention reads a few hundred KiB and o_proj a few MiB, yet each costs a
launch, a ramp and a drain (reports/performance-history.md: at Qwen3-0.6B's shape about 6 us each). Here program
(kv head, row block) attends with its kv head's query heads over every live key, rounds and gates the heads'
output as layers.decode_attention does, and multiplies it with its rows of o_proj's columns for those heads, which
it loaded before the PDL wait; the last program of a row block to finish adds the kv heads' float32 partials in
kv-head order and the residual. A program's attention is the same for every row block of its kv head: computed
again in each, which costs L2 reads of the keys, so the grid stays at about PROGRAMS programs.

Not batch invariant: o_proj's sum runs in another order than layers.gemv's. The default engine takes it at one
decode row (`takes`); POCKETLAB_ATTEND_PROJECT=0 turns it off, to measure.
"""

from __future__ import annotations

import os

import torch

from .arrivals import arrival_counts
from .decode_attention import triton

PROGRAMS = 64  # the grid: each program reads its kv head's keys from L2, so fewer than the GPU's SMs
MAX_KEYS = 512  # key buckets up to this many: a program walks all of its kv head's keys alone
MAX_TILE_BYTES = 64 << 10  # a program's o_proj tile, held in registers from before the wait
KEY_BLOCK = 64

if triton is not None:  # CPU-only installs: `takes` is False there, the kernel never runs
    import triton.language as tl

    from . import pdl
    from .decode_attention import _attend, _cached_block, _norm_rope, _slot_and_length
    from .invariant.dot import dot, precision
    from .invariant.elementwise import gated
    from .invariant.matmul import finish
    from .pdl import wait_then_release

    @triton.jit
    def _attend_project(q_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, w_ptr, res_ptr, y_ptr, part_ptr,
                        arrived_ptr, gate_ptr, scale, qw_ptr, kw_ptr, cos_ptr, sin_ptr, eps, stride_qh, stride_kh,
                        stride_vh, stride_gh, stride_cs, stride_ch, stride_ct, stride_w, N, G: tl.constexpr,
                        BLOCK_G: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, HAS_NORM: tl.constexpr,
                        OFFSET: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr,
                        BLOCK_H: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        kvh, block = tl.program_id(0), tl.program_id(1)
        kv_heads = tl.num_programs(0)
        dtype = y_ptr.dtype.element_ty
        d, j = tl.arange(0, D), tl.arange(0, G * D)
        rows = block * BLOCK_O + tl.arange(0, BLOCK_O)
        # before the wait, what no kernel of this step writes: o_proj's rows x this kv head's columns, and the first
        # block of cached keys (written by earlier steps; layers.pdl)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_w + kvh * G * D + j[None, :], mask=(rows < N)[:, None],
                    other=0.0)  # fmt: skip
        length, base = _slot_and_length(slot_ptr, len_ptr, 0, kvh, stride_cs, stride_ch)
        last = length - 1  # the new token: its K/V come from kn/vn, not the cache
        n = tl.arange(0, BLOCK_N)
        k_first, v_first = _cached_block(k_ptr, v_ptr, base, n, d, last, stride_ct)
        wait_then_release(PDL)

        g = tl.arange(0, BLOCK_G)
        partner = tl.where(d < ROT, (d + ROT // 2) % ROT, d)
        cos = tl.load(cos_ptr + d, mask=d < ROT, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + d, mask=d < ROT, other=0.0).to(tl.float32)
        heads = kvh * G + g
        q_rows = q_ptr + heads[:, None] * stride_qh
        q = _norm_rope(q_rows + d[None, :], q_rows + partner[None, :], g[:, None] < G, qw_ptr, cos, sin, d, partner,
                       eps, D, ROT, HAS_NORM, OFFSET)  # fmt: skip
        k_row = kn_ptr + kvh * stride_kh + tl.zeros([1], tl.int32)[:, None]
        k_new = _norm_rope(k_row + d[None, :], k_row + partner[None, :], d[None, :] < D, kw_ptr, cos, sin, d, partner,
                           eps, D, ROT, HAS_NORM, OFFSET)  # [1, D]  # fmt: skip
        v_new = tl.load(vn_ptr + kvh * stride_vh + d)[None, :]
        mine = (block + 0 * d[None, :]) == 0  # the first row block stores the new token's K/V
        tl.store(k_ptr + base + last * stride_ct + d[None, :], k_new, mask=mine)
        tl.store(v_ptr + base + last * stride_ct + d[None, :], v_new, mask=mine)

        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        m, l, acc = _attend(q, k_first, v_first, k_new, v_new, n, last, length, m, l, acc, scale, PRECISION)
        for n0 in range(BLOCK_N, length, BLOCK_N):
            keys = n0 + n
            k, v = _cached_block(k_ptr, v_ptr, base, keys, d, last, stride_ct)
            m, l, acc = _attend(q, k, v, k_new, v_new, keys, last, length, m, l, acc, scale, PRECISION)
        out = (acc / l[:, None]).to(dtype).to(tl.float32)  # rounded where decode_attention stores its output
        if GATED:  # Qwen3.5's output gate, as decode_attention applies it
            gate = tl.load(gate_ptr + heads[:, None] * stride_gh + d[None, :], mask=g[:, None] < G, other=0.0)
            out = gated(out, gate.to(tl.float32), dtype).to(tl.float32)
        # o_proj's rows times this kv head's G query heads: row (o, g) of the [BLOCK_O * G, D] view of w dotted with
        # every head's output (out is rounded to the dtype, so exact in it), then column g of it, summed over g
        nothing = tl.zeros((BLOCK_O * G, BLOCK_G), tl.float32)
        heads_out = dot(tl.reshape(w, [BLOCK_O * G, D]), tl.trans(out.to(dtype)), nothing, PRECISION)
        heads_out = tl.reshape(heads_out, [BLOCK_O, G, BLOCK_G])
        own = tl.arange(0, G)[None, :, None] == g[None, None, :]
        partial = tl.sum(tl.sum(tl.where(own, heads_out, 0.0), axis=2), axis=1)
        tl.store(part_ptr + kvh * N + rows, partial, mask=rows < N)

        # the last kv head of this row block to finish sums the partials in kv-head order and adds the residual (the
        # barrier puts every thread's stores before the one thread's atomic)
        tl.debug_barrier()
        arrivals = arrived_ptr + block
        if tl.atomic_add(arrivals, 1, sem="acq_rel") == kv_heads - 1:
            h = tl.arange(0, BLOCK_H)
            live = (h[:, None] < kv_heads) & (rows < N)[None, :]
            parts = tl.load(part_ptr + h[:, None] * N + rows[None, :], mask=live, other=0.0, volatile=True)
            one = tl.arange(0, 1)
            total = tl.sum(parts, axis=0)[None, :]
            y = finish(total, total, y_ptr, res_ptr, one, rows, one < 1, rows < N, 0, dtype, False, 1)
            tl.store(y_ptr + rows[None, :], y, mask=(rows < N)[None, :])
            tl.atomic_xchg(arrivals, 0)  # ready for the next launch


def enabled() -> bool:
    return triton is not None and os.environ.get("POCKETLAB_ATTEND_PROJECT", "1") != "0"


def programs() -> int:
    """PROGRAMS, or POCKETLAB_ATTEND_PROJECT's count where it names one (2 or more), to measure."""
    wanted = int(os.environ.get("POCKETLAB_ATTEND_PROJECT", "1") or 1)
    return wanted if wanted > 1 else PROGRAMS


def takes(batch: int, heads: int, kv_heads: int, head_dim: int, max_len: int, o_weight: torch.Tensor) -> bool:
    """Whether one launch serves this step: one sequence, a key bucket of at most MAX_KEYS, query heads a power of
    two per kv head, and o_proj's tile for a program at most MAX_TILE_BYTES."""
    group = heads // kv_heads
    if not enabled() or batch != 1 or max_len > MAX_KEYS or group & (group - 1) or o_weight.stride(-1) != 1:
        return False
    return _block_rows(o_weight.shape[0], kv_heads) * group * head_dim * o_weight.element_size() <= MAX_TILE_BYTES


def _block_rows(n: int, kv_heads: int) -> int:
    """o_proj rows a program: about PROGRAMS programs in all, a power of two each."""
    per_head = max(1, programs() // kv_heads)
    return 1 << (-(-n // per_head) - 1).bit_length()


def attend_project(q, k, v, k_cache, v_cache, slot_ids, lengths, max_len: int, scale: float, rope, norms,
                   gate, o_weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """residual + o_proj(decode_attention(q, k, v, ...)) for one sequence ([1, H, D] q, [1, kv_heads, D] k/v; the
    arguments as layers.decode_attention takes them) -> [1, N], N = o_weight's rows. The caller checked `takes`."""
    _, H, D = q.shape
    kvh = k_cache.shape[1]
    G, N = H // kvh, o_weight.shape[0]
    block_o = _block_rows(N, kvh)
    blocks = triton.cdiv(N, block_o)
    partials = torch.empty(kvh, N, device=q.device, dtype=torch.float32)
    y = torch.empty(1, N, device=q.device, dtype=q.dtype)
    cos, sin = rope
    q_w, k_w, eps, offset = norms if norms is not None else (cos, cos, 0.0, False)  # weights unused without norms
    _attend_project[(kvh, blocks)](
        q, k, v, k_cache, v_cache, slot_ids, lengths, o_weight, residual, y, partials,
        arrival_counts(q.device, blocks), y if gate is None else gate, scale, q_w, k_w, cos, sin, eps, q.stride(1),
        k.stride(1), v.stride(1), 0 if gate is None else gate.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), o_weight.stride(0), N, G=G, BLOCK_G=max(triton.next_power_of_2(G), 16), D=D,
        ROT=cos.shape[-1], HAS_NORM=norms is not None, OFFSET=bool(offset), GATED=gate is not None,
        BLOCK_N=KEY_BLOCK, BLOCK_O=block_o, BLOCK_H=max(triton.next_power_of_2(kvh), 2),
        PRECISION=precision(q.dtype, q.device), num_warps=8, **pdl.launch(q.device),
    )  # fmt: skip
    return y
