"""RMSNorms whose rows do not depend on one another: each row is reduced on its own, in an order fixed by the
row length alone.

torch's row reductions split a row over several blocks when rows are few and keep it in one when they are
many, so the sum of squares (and the output) of a row changes with the batch. Here a program holds a tile of
`rows_per_program(BLOCK)` rows x BLOCK columns (both set by N alone) and sums each row's squares along the
tile's columns, over column blocks of width BLOCK, in the same order for any number of rows; rows past the
end are masked. Everything else rounds where `pocketlab.layers.norm` rounds (to the input dtype at the same
points), so the results match those functions to a few ulps: only the order of the sum of squares differs.
"""

import torch
import triton
import triton.language as tl

from .rounding import cast

MAX_BLOCK = 8192  # the widest column block; longer rows loop over blocks of this width
TILE = 1024  # elements per program: short rows share one (twice this doubles a bf16 program's registers)


def rows_per_program(block: int) -> int:
    """Rows per program for column blocks of `block`: a function of the row length only, never of the row
    count, so a row's tile, layout and reduction order are the same in every call. Rows of 1024 or more (the
    hidden size of real models) keep a program each."""
    return max(1, TILE // block)


@triton.jit
def _tile(x_ptrs, u_ptrs, live, ADD: tl.constexpr, H_DTYPE: tl.constexpr):
    """The tile's values as the torch code sees them: x, or x + update rounded to their common dtype."""
    x = tl.load(x_ptrs, mask=live, other=0.0).to(tl.float32)
    if ADD:
        x = cast(x + tl.load(u_ptrs, mask=live, other=0.0).to(tl.float32), H_DTYPE).to(tl.float32)
    return x


@triton.jit(do_not_specialize=["M"])
def _rms_norm_rows(
    x_ptr,
    u_ptr,
    w_ptr,
    g_ptr,
    h_ptr,
    y_ptr,
    M,
    N,
    stride_x,
    stride_u,
    stride_g,
    stride_h,
    stride_y,
    eps,
    ADD: tl.constexpr,
    OFFSET: tl.constexpr,
    GATED: tl.constexpr,
    H_DTYPE: tl.constexpr,
    WX_DTYPE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Rows program_id(0) * ROWS + [0, ROWS): [h = x + u, stored;] y = norm(h) in the flavour the flags pick
    (see the wrappers). H_DTYPE is the dtype torch rounds h (x, or x + u) to; WX_DTYPE that of `w * h` (the two
    promoted)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    real = (rows < M)[:, None]
    rows = rows.to(tl.int64)[:, None]
    x_rows, u_rows = x_ptr + rows * stride_x, u_ptr + rows * stride_u
    squares = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)[None, :]
        live = real & (cols < N)
        h = _tile(x_rows + cols, u_rows + cols, live, ADD, H_DTYPE)
        if ADD:
            tl.store(h_ptr + rows * stride_h + cols, cast(h, H_DTYPE), mask=live)
        squares += h * h
    inv_rms = tl.rsqrt(tl.sum(squares, 1) / N + eps)[:, None]
    for c0 in range(0, N, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)[None, :]
        live = real & (cols < N)
        normed = _tile(x_rows + cols, u_rows + cols, live, ADD, H_DTYPE) * inv_rms
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        if OFFSET:  # Qwen3.5: (x * (1 + w)) in float32, rounded once
            y = normed * (1.0 + w)
        else:  # w * x rounded to h's dtype, the product rounded to the common dtype of w and x
            y = cast(w * cast(normed, H_DTYPE).to(tl.float32), WX_DTYPE).to(tl.float32)
            if GATED:  # that times silu(gate) in float32
                g = tl.load(g_ptr + rows * stride_g + cols, mask=live, other=0.0).to(tl.float32)
                y = y * (g / (1.0 + tl.exp(-g)))
        tl.store(y_ptr + rows * stride_y + cols, cast(y, y_ptr.dtype.element_ty), mask=live)


_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _rows(t: torch.Tensor, N: int) -> torch.Tensor:
    t = t.reshape(-1, N)
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(x, update, weight, gate, eps, offset, out_dtype, h_dtype):
    if x.dtype not in _TL or weight.dtype not in _TL:
        raise ValueError(f"rms_norm supports float32, bfloat16, float16; got {x.dtype} with weight {weight.dtype}")
    N = x.shape[-1]
    if tuple(weight.shape) != (N,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} should be [{N}] for x {tuple(x.shape)}")
    for name, other in (("update", update), ("gate", gate)):
        if other is not None and other.shape != x.shape:
            raise ValueError(f"rms_norm: {name} {tuple(other.shape)} should have x's shape {tuple(x.shape)}")
    x2 = _rows(x, N)
    rows = x2.shape[0]
    y = torch.empty(rows, N, dtype=out_dtype, device=x.device)
    h = torch.empty(rows, N, dtype=h_dtype, device=x.device) if update is not None else y
    u2 = _rows(update, N) if update is not None else x2
    g2 = _rows(gate, N) if gate is not None else x2
    if rows:
        block = min(triton.next_power_of_2(N), MAX_BLOCK)
        per_program = rows_per_program(block)
        _rms_norm_rows[(triton.cdiv(rows, per_program),)](
            x2, u2, weight.contiguous(), g2, h, y, rows, N,
            x2.stride(0), u2.stride(0), g2.stride(0), h.stride(0), y.stride(0), float(eps),
            ADD=update is not None,
            OFFSET=offset,
            GATED=gate is not None,
            H_DTYPE=_TL[h_dtype],
            WX_DTYPE=_TL[torch.promote_types(weight.dtype, h_dtype)],
            ROWS=per_program,
            BLOCK=block,
            num_warps=4 if block <= 2048 else 8,
        )  # fmt: skip
    return h.reshape(x.shape), y.reshape(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """pocketlab.layers.norm.rms_norm over the last dim: `w * x` (Qwen2/3) or, with offset, `(1 + w) * x`."""
    out_dtype = x.dtype if offset else torch.promote_types(weight.dtype, x.dtype)
    return _launch(x, None, weight, None, eps, offset, out_dtype, x.dtype)[1]


def add_rms_norm(
    x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + update, rms_norm of it), as pocketlab.layers.norm.add_rms_norm."""
    h_dtype = torch.promote_types(x.dtype, update.dtype)
    out_dtype = h_dtype if offset else torch.promote_types(weight.dtype, h_dtype)
    return _launch(x, update, weight, None, eps, offset, out_dtype, h_dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """pocketlab.layers.norm.gated_rms_norm: w * norm(x) * silu(gate), rounded to x's dtype."""
    return _launch(x, None, weight, gate, eps, False, x.dtype, x.dtype)[1]
