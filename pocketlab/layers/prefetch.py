"""The next projections' weights pulled into L2 while this kernel runs, so HBM never idles between kernels.

A decode step at few rows is a chain of weight reads, and each kernel leaves HBM idle at its start (launch, first
requests in flight) and at its end (the last wave's tail). With the decoder's weights in one buffer in the order
the step reads them (`pack_in_reading_order`, at load), the bytes after a kernel's weight are the next kernel's:
each program asks for its share of the next AHEAD_BYTES with bulk L2 prefetches (Hopper's
cp.async.bulk.prefetch.L2, fire and forget: no register, no wait), and the next kernel finds them in L2.
A weight outside such a buffer has nothing after it: no prefetch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import pdl

ALIGN = 16  # bulk prefetch: 16-byte aligned addresses and sizes
VIEW_ALIGN = 128  # each packed weight starts on a 128-byte boundary, so its loads vectorize as before
AHEAD_BYTES = int(os.environ.get("POCKETLAB_PREFETCH_MIB", "16")) << 20  # how far each launch reads ahead (0: off)
CHUNK_BYTES = 1 << 30  # packing copies one buffer of this size at a time (the extra memory while it runs)


def pack_in_reading_order(modules, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Move the weights each module names in its `streamed` attribute (in the order its forward reads them) into
    buffers of up to `chunk_bytes`, in order, so that the bytes after each weight are the next one read. Returns
    how many buffers. A new buffer starts after a module without `streamed` (it reads weights of its own between,
    such as an MoE block's experts) and at a weight of another dtype or device than the one before it."""
    groups: list[list] = []
    size, cut = 0, True
    for m in modules:
        for name in getattr(m, "streamed", ()):
            w = getattr(m, name)
            nbytes = -(-w.numel() * w.element_size() // VIEW_ALIGN) * VIEW_ALIGN
            last = None if cut else getattr(*groups[-1][-1])
            if last is None or size + nbytes > chunk_bytes or (w.dtype, w.device) != (last.dtype, last.device):
                groups.append([])
                size = 0
            groups[-1].append((m, name))
            size += nbytes
            cut = False
        cut = cut or not hasattr(m, "streamed")
    for group in groups:
        weights = [getattr(m, name) for m, name in group]
        step = VIEW_ALIGN // weights[0].element_size()
        starts = [0]
        for w in weights[:-1]:
            starts.append(starts[-1] + -(-w.numel() // step) * step)
        buffer = torch.empty(starts[-1] + weights[-1].numel(), dtype=weights[0].dtype, device=weights[0].device)
        for (m, name), w, at in zip(group, weights, starts, strict=True):
            setattr(m, name, buffer[at : at + w.numel()].view(w.shape).copy_(w))
    return len(groups)


def enabled(device: torch.device) -> bool:
    """Whether launches on `device` prefetch: CUDA sm_90+ (the bulk prefetch) and a distance above 0."""
    return AHEAD_BYTES > 0 and device.type == "cuda" and pdl.sm90(device)


def ahead_of(weight: torch.Tensor, nbytes: int) -> tuple[int, int]:
    """(address, bytes): up to `nbytes` bytes of `weight`'s storage that follow it, both 16-byte aligned; (0, 0)
    when nothing follows (a weight of its own)."""
    start = -(-(weight.data_ptr() + weight.numel() * weight.element_size()) // ALIGN) * ALIGN
    storage = weight.untyped_storage()
    left = storage.data_ptr() + storage.nbytes() - start
    n = max(0, min(nbytes, left)) // ALIGN * ALIGN
    return (start, n) if n else (0, 0)


@triton.jit
def prefetch_l2(addr, nbytes, program, programs, LANES: tl.constexpr):
    """Program `program` of `programs`: its share of bytes [addr, addr + nbytes) into L2. The programs split the
    range in order and the LANES threads of each split their part, one bulk prefetch each (a multiple of 16 bytes;
    a lane past the end issues none)."""
    per_lane = tl.cdiv(tl.cdiv(nbytes, programs * LANES), 16) * 16
    start = (program * LANES + tl.arange(0, LANES)).to(tl.int64) * per_lane
    size = tl.minimum(tl.maximum(nbytes - start, 0), per_lane).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [addr + start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
