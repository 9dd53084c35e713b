"""A decode step's float32 logits and their argmax per row (the greedy tokens) in one launch.

The lm_head leaves the logits in the model's dtype; sampling takes float32, and a graphed step reads its greedy
tokens back ahead of the logits (graphs.StepGraphs.logits). torch does that in two launches: a copy, then an argmax
whose one program per row walks the whole vocabulary. Here each program converts one block of a row and keeps that
block's best (value, index); the last of the row's programs to finish picks among the blocks in order. The token is
torch.argmax's: the first NaN, else the first largest value. A row's token depends on that row alone.
"""

from __future__ import annotations

import torch

from .arrivals import arrival_counts

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch's two launches
    triton = None

BLOCK = 1024  # vocabulary entries a program converts: one program a block, 149 a row at Qwen3's 151,936


def torch_logits_and_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits as float32, their argmax per row [B]), as torch computes them."""
    logits = logits.float()
    return logits, logits.argmax(dim=-1)


if triton is not None:
    from . import pdl
    from .pdl import wait_then_release

    _NO_INDEX = tl.constexpr(2**31 - 1)  # past every index (a constexpr: kernels read it)

    @triton.jit
    def _best(values, index, live):
        """(value, index) of torch.argmax over the live lanes: the first NaN's, else the first largest value's."""
        nan = live & (values != values)
        first_nan = tl.min(tl.where(nan, index, _NO_INDEX), axis=0)
        plain = tl.where(live & (values == values), values, float("-inf"))
        top = tl.max(plain, axis=0)
        first_top = tl.min(tl.where(live & (plain == top), index, _NO_INDEX), axis=0)
        found_nan = first_nan < _NO_INDEX
        return tl.where(found_nan, float("nan"), top), tl.where(found_nan, first_nan, first_top)

    @triton.jit
    def _logits_and_argmax(x_ptr, out_ptr, best_ptr, where_ptr, token_ptr, arrived_ptr, V, stride_x, stride_o,
                           BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        """Program (b, p): row b's entries [p * BLOCK, (p + 1) * BLOCK) as float32, and their best (value, index)
        into slot p of the row's partials; the row's last program to arrive reduces the partials in block order."""
        b, p = tl.program_id(0), tl.program_id(1)
        blocks = tl.num_programs(1)
        wait_then_release(PDL)
        index = p * BLOCK + tl.arange(0, BLOCK)
        live = index < V
        x = tl.load(x_ptr + b.to(tl.int64) * stride_x + index, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + b.to(tl.int64) * stride_o + index, x, mask=live)
        value, where = _best(x, index, live)
        tl.store(best_ptr + b * blocks + p, value)
        tl.store(where_ptr + b * blocks + p, where)
        tl.debug_barrier()  # every thread's stores before the one atomic: the last to arrive sees them all
        if tl.atomic_add(arrived_ptr + b, 1, sem="acq_rel") == blocks - 1:
            q = tl.arange(0, BLOCK_P)
            mine = q < blocks
            values = tl.load(best_ptr + b * blocks + q, mask=mine, other=float("-inf"), volatile=True)
            wheres = tl.load(where_ptr + b * blocks + q, mask=mine, other=_NO_INDEX, volatile=True)
            _, token = _best(values, wheres, mine)  # the blocks' own indices: the lowest of equals is the first
            tl.store(token_ptr + b, token.to(tl.int64))
            tl.atomic_xchg(arrived_ptr + b, 0)  # ready for the next launch


def logits_and_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_logits_and_argmax's (float32 logits [B, V], argmax [B] long) in one Triton launch (on a GPU, or in
    Triton's CPU interpreter)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits_and_argmax: logits {tuple(logits.shape)} should be [rows, vocab], rows whole")
    B, V = logits.shape
    out = torch.empty(B, V, dtype=torch.float32, device=logits.device)
    tokens = torch.empty(B, dtype=torch.long, device=logits.device)
    if not B:
        return out, tokens
    blocks = triton.cdiv(V, BLOCK)
    best = torch.empty(B, blocks, dtype=torch.float32, device=logits.device)
    where = torch.empty(B, blocks, dtype=torch.int32, device=logits.device)
    _logits_and_argmax[(B, blocks)](
        logits, out, best, where, tokens, arrival_counts(logits.device, B), V, logits.stride(0), out.stride(0),
        BLOCK=BLOCK, BLOCK_P=triton.next_power_of_2(blocks), **pdl.launch(logits.device),
    )  # fmt: skip
    return out, tokens
