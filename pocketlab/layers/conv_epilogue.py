"""The Gated DeltaNet's decode conv in the epilogue of the projection that produces its input (in_proj): the one
token's causal conv on the first C columns of a GEMV's output, shared by layers.gemv and layers.gemv_tma.

A conv launch of its own costs a graph node for a few KiB of work; here each program convolves the columns it has just
computed, with its taps and its rows' windows loaded ahead (`operands`), and moves the windows on (`apply`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def arguments(conv, y: torch.Tensor) -> tuple[tuple, dict]:
    """The kernels' conv arguments for `conv` (a linear_decode.ConvStep; None: y as every unused pointer):
    (slots, windows, where they go (bank, rows), taps, C, the windows' strides), {CONV_K, TAPS}."""
    if conv is None:
        return (y, y, y, y, y, 0, 0, 0), dict(CONV_K=0, TAPS=1)
    state, width = conv.state, conv.weight.shape[1]
    widths = dict(CONV_K=width, TAPS=triton.next_power_of_2(width))
    return (conv.slot_ids, state, *conv.stored_to(), conv.weight, conv.channels, *state.stride()[:2]), widths


@triton.jit
def operands(m, n, live_m, slot_ptr, conv_ptr, into_ptr, into_row_ptr, cw_ptr, C, stride_cs, stride_cc,
             CONV_K: tl.constexpr, TAPS: tl.constexpr):  # fmt: skip
    """(the conv's taps [BLOCK_N, TAPS], each row's window [ROWS, BLOCK_N, TAPS] of carried inputs, where the moved
    windows go: row into_row_ptr[m] of into_ptr) for the first C columns, loaded before the main loop (layers.gemv_tma:
    before its PDL wait) so the epilogue waits on no load."""
    j = tl.arange(0, TAPS)
    chan = n < C
    taps = tl.load(cw_ptr + n.to(tl.int64)[:, None] * CONV_K + j[None, :], mask=chan[:, None] & (j < CONV_K)[None, :],
                   other=0.0)  # fmt: skip
    slot = tl.load(slot_ptr + m, mask=live_m, other=0).to(tl.int64)
    window = conv_ptr + slot[:, None] * stride_cs + n.to(tl.int64)[None, :] * stride_cc
    live = live_m[:, None] & chan[None, :]
    cells = tl.load(window[:, :, None] + j[None, None, :], mask=live[:, :, None] & (j < CONV_K - 1)[None, None, :],
                    other=0.0)  # fmt: skip
    into = tl.load(into_row_ptr + m, mask=live_m, other=0).to(tl.int64)
    return taps, cells, into_ptr + into[:, None] * stride_cs + n.to(tl.int64)[None, :] * stride_cc


@triton.jit
def apply(y, n, live_m, taps, cells, window, C, CONV_K: tl.constexpr, TAPS: tl.constexpr):
    """The Gated DeltaNet's conv of one token on the first C columns of y [ROWS, BLOCK_N] (dtype), with
    linear_decode._conv_token's arithmetic: silu(w[c, K-1] y + sum_j w[c, j] window[j]) in float32, taps in order;
    each row's window shifts left and takes y (stored at `window`: in place, or aside). Every cell was read before
    the main loop, so nothing here reads what another thread writes."""
    j = tl.arange(0, TAPS)
    live = live_m[:, None] & (n < C)[None, :]
    w = taps.to(tl.float32)
    acc = tl.sum(tl.where(j == CONV_K - 1, w, 0.0), axis=1)[None, :] * y.to(tl.float32)
    for i in tl.static_range(CONV_K - 1):
        s = tl.sum(tl.where(j == i, cells.to(tl.float32), 0.0), axis=2)  # cell i exactly (one term, the rest 0)
        acc += tl.sum(tl.where(j == i, w, 0.0), axis=1)[None, :] * s
        if i > 0:
            tl.store(window + (i - 1), s.to(cells.dtype), mask=live)
    tl.store(window + (CONV_K - 2), y.to(cells.dtype), mask=live)
    return tl.where((n < C)[None, :], (acc / (1.0 + tl.exp(-acc))).to(y.dtype), y)
