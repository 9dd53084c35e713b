"""The next projection's weight pulled into L2 by a kernel that leaves HBM idle, so that projection reads from L2.

At decode's few rows the attention kernel works for microseconds on a few hundred KB of K/V, bound by the latency
of its chain (norm, RoPE, two dots, the merge), while the o_proj launch right after it streams megabytes. Hopper's
bulk L2 prefetch (cp.async.bulk.prefetch.L2: fire and forget, no register, no wait) lets the attention's programs
ask for o_proj's weight in that time. A prefetch from every GEMV of the weight after it was slower at every
distance (fifteenth session, reports/performance-history.md): there HBM was busy already.

POCKETLAB_ATTN_PREFETCH: 0 off, 1 after the kernel's PDL wait, 2 before it (while the previous kernel ends).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import pdl

PIECE = 16  # the bulk prefetch takes 16-byte aligned addresses and sizes
MAX_BYTES = 1 << 30  # the size stays an int32
LANES = tl.constexpr(128)  # one piece per thread of a 4-warp program (a constexpr: kernels read it)


def mode(device: torch.device) -> int:
    """The kernels' PREFETCH constexpr on `device`: POCKETLAB_ATTN_PREFETCH where the bulk prefetch exists
    (sm_90 and later), else 0."""
    wanted = int(os.environ.get("POCKETLAB_ATTN_PREFETCH", "0"))
    if wanted not in (0, 1, 2):
        raise ValueError(f"POCKETLAB_ATTN_PREFETCH is 0, 1 or 2, got {wanted}")
    return wanted if wanted and pdl.sm90(device) else 0


def span(weight: torch.Tensor) -> int:
    """How many bytes of `weight` to prefetch: its first POCKETLAB_ATTN_PREFETCH_MIB MiB (all of it when unset) in
    whole 16-byte pieces, 0 where it is not contiguous or not 16-byte aligned."""
    if not weight.is_contiguous() or weight.data_ptr() % PIECE:
        return 0
    cap = int(float(os.environ.get("POCKETLAB_ATTN_PREFETCH_MIB", "1024")) * (1 << 20))
    return min(weight.numel() * weight.element_size(), MAX_BYTES, cap) // PIECE * PIECE


@triton.jit
def pieces(nbytes, program, programs, LANES: tl.constexpr):
    """Program `program` of `programs`: each of its LANES threads' (start, size) within [0, nbytes). The programs
    take the range in order, each thread one piece of a multiple of 16 bytes; a thread past the end gets size 0."""
    piece = tl.cdiv(tl.cdiv(nbytes, programs * LANES), 16) * 16
    start = (program * LANES + tl.arange(0, LANES)).to(tl.int64) * piece
    size = tl.minimum(tl.maximum(nbytes - start, 0), piece).to(tl.int32)
    return start, size


@triton.jit
def prefetch_l2(w_ptr, nbytes, program, programs, LANES: tl.constexpr):
    """Program `program` of `programs` asks for its share of the first `nbytes` bytes at w_ptr in L2."""
    start, size = pieces(nbytes, program, programs, LANES)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [w_ptr.to(tl.int64) + start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
