"""The next projection's weight pulled into L2 by a kernel that leaves HBM idle, so that projection reads from L2.

At batch 1 the decode attention kernel works for microseconds on a few hundred KB of K/V, bound by the latency of
its chain (norm, RoPE, two dots, the merge), while the o_proj launch right after it streams its weight; so does
the Gated DeltaNet state step before out_proj. Hopper's bulk L2 prefetch (cp.async.bulk.prefetch.L2: fire and
forget, no register, no wait) lets their programs ask for that weight meanwhile, before their PDL wait (as the
kernel before them ends). It pays for a small weight only: larger ones, later placements and batch 32 were slower
(the thirty-first session's A/B in reports/performance-history.md), as was a prefetch from every GEMV of the
weight after it (fifteenth session).

POCKETLAB_L2_PREFETCH=0 turns it off (to measure it).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import pdl

PIECE = 16  # the bulk prefetch takes 16-byte aligned addresses and sizes
MAX_BYTES = 8 << 20  # Qwen3-0.6B's and Qwen3.5-0.8B's o_proj (4 MiB) gain; 16 and 32 MiB ones lose
LANES = tl.constexpr(128)  # one piece per thread of a 4-warp program (a constexpr: kernels read it)


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` prefetch: sm_90 and later, POCKETLAB_L2_PREFETCH not 0."""
    return os.environ.get("POCKETLAB_L2_PREFETCH", "1") != "0" and pdl.sm90(device)


def span(weight: torch.Tensor, rows: int) -> int:
    """How many bytes of `weight` a kernel working on `rows` rows prefetches: all of it (in whole 16-byte pieces)
    at one row and up to MAX_BYTES, else 0; 0 too where it is not contiguous or not 16-byte aligned."""
    nbytes = weight.numel() * weight.element_size()
    if rows != 1 or nbytes > MAX_BYTES or not weight.is_contiguous() or weight.data_ptr() % PIECE:
        return 0
    return nbytes // PIECE * PIECE


def arguments(weight: torch.Tensor | None, rows: int, absent: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """A kernel's (pointer, bytes, PREFETCH) for prefetching `weight` at `rows` rows on `absent`'s device; where
    nothing is prefetched, `absent` (a tensor the kernel has anyway, never read) stands for the pointer."""
    nbytes = span(weight, rows) if weight is not None and enabled(absent.device) else 0
    return (weight if weight is not None and nbytes else absent), nbytes, nbytes > 0


@triton.jit
def pieces(nbytes, program, programs, LANES: tl.constexpr):
    """Program `program` of `programs`: each of its LANES threads' (start, size) within [0, nbytes). The programs
    take the range in order, each thread one piece of a multiple of 16 bytes; a thread past the end gets size 0."""
    piece = tl.cdiv(tl.cdiv(nbytes, programs * LANES), 16) * 16
    start = (program * LANES + tl.arange(0, LANES)).to(tl.int64) * piece
    size = tl.minimum(tl.maximum(nbytes - start, 0), piece).to(tl.int32)
    return start, size


@triton.jit
def prefetch_l2(w_ptr, nbytes, LANES: tl.constexpr):
    """This program asks for its share (as the grid's programs in order divide them) of the first `nbytes` bytes
    at w_ptr in L2."""
    program = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
    programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    start, size = pieces(nbytes, program, programs, LANES)
    bulk_prefetch(w_ptr.to(tl.int64) + start, size)


@triton.jit
def bulk_prefetch(addresses, sizes):
    """Each lane asks L2 for `sizes` bytes (int32, 16-byte multiples; 0: nothing) at `addresses` (int64, 16-byte
    aligned): Hopper's cp.async.bulk.prefetch.L2, fire and forget."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [addresses, sizes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
