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

from .. import pdl
from ..pdl import wait_then_release
from .elementwise import head_row, head_rows
from .matmul import as_rows
from .rounding import cast

MAX_BLOCK = 8192  # the widest column block; longer rows loop over blocks of this width
TILE = 1024  # elements per program: short rows share one (twice this doubles a bf16 program's registers)


def rows_per_program(block: int) -> int:
    """Rows per program for column blocks of `block`: a function of the row length only, never of the row
    count, so a row's tile, layout and reduction order are the same in every call. Rows of 1024 or more (the
    hidden size of real models) keep a program each."""
    return max(1, TILE // block)


@triton.jit(do_not_specialize=["M"])
def _rms_norm_rows(
    x_ptr,
    w_ptr,
    g_ptr,
    y_ptr,
    M,
    N,
    stride_x,
    g_inner,
    stride_go,
    stride_gi,
    stride_y,
    eps,
    OFFSET: tl.constexpr,
    GATED: tl.constexpr,
    X_DTYPE: tl.constexpr,
    WX_DTYPE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Rows program_id(0) * ROWS + [0, ROWS): y = norm(x) in the flavour the flags pick (see the wrappers).
    WX_DTYPE is the dtype of `w * x` (the two promoted). The gate's rows are addressed as [outer, g_inner]
    (elementwise.head_rows)."""
    wait_then_release(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    real = (rows < M)[:, None]
    rows = rows.to(tl.int64)[:, None]
    x_rows = x_ptr + rows * stride_x
    squares = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)[None, :]
        h = tl.load(x_rows + cols, mask=real & (cols < N), other=0.0).to(tl.float32)
        squares += h * h
    inv_rms = tl.rsqrt(tl.sum(squares, 1) / N + eps)[:, None]
    for c0 in range(0, N, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)[None, :]
        live = real & (cols < N)
        normed = tl.load(x_rows + cols, mask=live, other=0.0).to(tl.float32) * inv_rms
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        if OFFSET:  # Qwen3.5: (x * (1 + w)) in float32, rounded once
            y = normed * (1.0 + w)
        elif GATED:
            g = tl.load(g_ptr + head_row(rows, g_inner, stride_go, stride_gi) + cols, mask=live, other=0.0)
            y = gated_weighted(normed, w, g.to(tl.float32), X_DTYPE, WX_DTYPE)
        else:
            y = weighted(normed, w, X_DTYPE, WX_DTYPE)
        tl.store(y_ptr + rows * stride_y + cols, cast(y, y_ptr.dtype.element_ty), mask=live)


@triton.jit
def weighted(normed, w, X_DTYPE: tl.constexpr, WX_DTYPE: tl.constexpr):
    """w * x: x rounded to its dtype, the product rounded to the common dtype of w and x (as torch rounds them)."""
    return cast(w * cast(normed, X_DTYPE).to(tl.float32), WX_DTYPE).to(tl.float32)


@triton.jit
def gated_weighted(normed, w, g, X_DTYPE: tl.constexpr, WX_DTYPE: tl.constexpr):
    """`weighted` times silu(g) in float32: the Gated DeltaNet output norm after its sum of squares."""
    return weighted(normed, w, X_DTYPE, WX_DTYPE) * (g / (1.0 + tl.exp(-g)))


_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def rounding_dtypes(x_dtype: torch.dtype, weight_dtype: torch.dtype) -> dict:
    """The constexprs of `weighted`: x's dtype and that of `w * x` (the two promoted)."""
    return dict(X_DTYPE=_TL[x_dtype], WX_DTYPE=_TL[torch.promote_types(weight_dtype, x_dtype)])


def _launch(x, weight, gate, eps, offset, out_dtype):
    if x.dtype not in _TL or weight.dtype not in _TL:
        raise ValueError(f"rms_norm supports float32, bfloat16, float16; got {x.dtype} with weight {weight.dtype}")
    N = x.shape[-1]
    if tuple(weight.shape) != (N,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} should be [{N}] for x {tuple(x.shape)}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"rms_norm: gate {tuple(gate.shape)} should have x's shape {tuple(x.shape)}")
    x2 = as_rows(x, N)
    rows = x2.shape[0]
    y = torch.empty(rows, N, dtype=out_dtype, device=x.device)
    g3, inner = head_rows(gate) if gate is not None else (x2[:, None], 1)
    if rows:
        block = min(triton.next_power_of_2(N), MAX_BLOCK)
        per_program = rows_per_program(block)
        _rms_norm_rows[(triton.cdiv(rows, per_program),)](
            x2, weight.contiguous(), g3, y, rows, N, x2.stride(0), inner, g3.stride(0), g3.stride(1), y.stride(0),
            float(eps),
            OFFSET=offset,
            GATED=gate is not None,
            **rounding_dtypes(x.dtype, weight.dtype),
            ROWS=per_program,
            BLOCK=block,
            num_warps=4 if block <= 2048 else 8,
            **pdl.launch(x.device),
        )  # fmt: skip
    return y.reshape(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """pocketlab.layers.norm.rms_norm over the last dim: `w * x` (Qwen2/3) or, with offset, `(1 + w) * x`."""
    out_dtype = x.dtype if offset else torch.promote_types(weight.dtype, x.dtype)
    return _launch(x, weight, None, eps, offset, out_dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """pocketlab.layers.norm.gated_rms_norm: w * norm(x) * silu(gate), rounded to x's dtype."""
    return _launch(x, weight, gate, eps, False, x.dtype)
