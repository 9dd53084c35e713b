"""The elementwise steps of the batch-invariant mode, computed by the same code for every element.

torch's CPU kernels compute an element in SIMD lanes or in a scalar tail depending on where it falls in the
tensor, and for softplus, sigmoid and silu the two differ in the last bit, so on the CPU a token's values would
depend on how many tokens share the call. These kernels compute each row alike wherever it sits, on the GPU and
in Triton's CPU interpreter; they round where the torch code they replace rounds.
"""

import torch
import triton
import triton.language as tl

from .rounding import cast

TILE = 1024  # elements per program: [TILE // BLOCK rows, BLOCK columns], BLOCK = N up to TILE


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def softplus(x):
    """log(1 + exp(x)), linear above 20 as torch's."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _tile(M, N, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's [ROWS, BLOCK] tile: row indices [ROWS, 1] (int64), column indices [1, BLOCK], and which
    cells hold data."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    return rows.to(tl.int64), cols, (rows < M) & (cols < N)


@triton.jit(do_not_specialize=["M"])
def _swiglu(x_ptr, y_ptr, M, N, stride_x, stride_y, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """y = silu(gate) * up over rows [gate | up] of width 2N; silu rounded to the dtype, then the product."""
    rows, cols, live = _tile(M, N, ROWS, BLOCK)
    gate = tl.load(x_ptr + rows * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + rows * stride_x + N + cols, mask=live, other=0.0).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    silu = cast(gate * sigmoid(gate), dtype).to(tl.float32)
    tl.store(y_ptr + rows * stride_y + cols, cast(silu * up, dtype), mask=live)


@triton.jit(do_not_specialize=["M"])
def _sigmoid_gate(x_ptr, g_ptr, y_ptr, M, N, stride_x, g_inner, stride_go, stride_gi, stride_y, ROWS: tl.constexpr,
                  BLOCK: tl.constexpr):  # fmt: skip
    """y = x * sigmoid(gate), the sigmoid rounded to the dtype first (Qwen3.5's gated attention output). The gate's
    rows are addressed as [outer, g_inner] (see head_rows)."""
    rows, cols, live = _tile(M, N, ROWS, BLOCK)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + head_row(rows, g_inner, stride_go, stride_gi) + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows * stride_y + cols, gated(x, g, y_ptr.dtype.element_ty), mask=live)


@triton.jit
def gated(x, g, dtype: tl.constexpr):
    """x * sigmoid(g) in `dtype`, x (float32 holding dtype values) times the sigmoid rounded to the dtype first."""
    return cast(x * cast(sigmoid(g), dtype).to(tl.float32), dtype)


@triton.jit(do_not_specialize=["M"])
def _decay_and_beta(
    a_ptr, b_ptr, neg_a_ptr, dt_ptr, g_ptr, beta_ptr, M, N, stride_a, stride_b, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    """g = neg_A * softplus(a + dt_bias) in float32 (softplus linear above 20, as torch's), beta = sigmoid(b)."""
    rows, cols, live = _tile(M, N, ROWS, BLOCK)
    x = tl.load(a_ptr + rows * stride_a + cols, mask=live, other=0.0).to(tl.float32)
    x += tl.load(dt_ptr + cols, mask=cols < N, other=0.0)
    tl.store(g_ptr + rows * N + cols, tl.load(neg_a_ptr + cols, mask=cols < N, other=0.0) * softplus(x), mask=live)
    b = tl.load(b_ptr + rows * stride_b + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(beta_ptr + rows * N + cols, cast(sigmoid(b), beta_ptr.dtype.element_ty), mask=live)


@triton.jit
def head_row(rows, inner, stride_outer, stride_inner):
    """The offset of each row of a [outer, inner, n] tensor (head_rows), rows counted over outer x inner."""
    return (rows // inner) * stride_outer + (rows % inner) * stride_inner


def head_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """t [..., n] as [outer, inner, n] (inner: t's second-to-last dim) with unit stride along n, and inner: a view
    wherever the leading dims fold into one. A per-head slice of a wider projection row (Qwen3.5's attention gate,
    the Gated DeltaNet's z) is one, where as [rows, n] it would be a copy: a kernel of its own in every step."""
    inner = t.shape[-2] if t.dim() >= 2 else 1
    t3 = t.reshape(-1, inner, t.shape[-1])
    return (t3 if t3.stride(-1) == 1 else t3.contiguous()), inner


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., N] as a [rows, N] view (copied only if the last dim is strided)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(kernel, pointers, rows: int, n: int, strides):
    """kernel(*pointers, rows, n, *strides) over [rows, n] in tiles of TILE elements shaped by n alone: short rows
    share a program. Elementwise steps never mix rows, so any tiling gives the same bits; a fixed one keeps
    every call's instructions alike."""
    block = min(triton.next_power_of_2(n), TILE)
    per_program = TILE // block
    grid = (triton.cdiv(rows, per_program), triton.cdiv(n, block))
    kernel[grid](*pointers, rows, n, *strides, ROWS=per_program, BLOCK=block)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2N] = [gate | up] -> silu(gate) * up [..., N], as layers' swiglu."""
    x = _rows(gate_up)
    n = x.shape[1] // 2
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if y.numel():
        _launch(_swiglu, (x, y), x.shape[0], n, (x.stride(0), y.stride(0)))
    return y.view(*gate_up.shape[:-1], n)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) of one dtype, gate [..., N] or [..., 1] (the MoE shared expert's one gate per token: broadcast
    here, as torch broadcasts it, since the kernel reads a gate for every element); a per-head gate is read in place
    (head_rows)."""
    x2, (g3, inner) = _rows(x), head_rows(gate.expand_as(x))
    y = torch.empty_like(x2)
    if y.numel():
        rows, n = x2.shape
        strides = (x2.stride(0), inner, g3.stride(0), g3.stride(1), y.stride(0))
        _launch(_sigmoid_gate, (x2, g3, y), rows, n, strides)
    return y.view(x.shape)


def decay_and_beta(a: torch.Tensor, b: torch.Tensor, neg_A: torch.Tensor, dt_bias: torch.Tensor):
    """The Gated DeltaNet log-decay (float32) and beta (b's dtype), [..., Hv] each, as qwen3_5.decay_and_beta."""
    a2, b2 = _rows(a), _rows(b)
    rows, n = a2.shape
    g = torch.empty(rows, n, dtype=torch.float32, device=a.device)
    beta = torch.empty(rows, n, dtype=b.dtype, device=b.device)
    if rows:
        pointers = (a2, b2, neg_A.float().contiguous(), dt_bias.float().contiguous(), g, beta)
        _launch(_decay_and_beta, pointers, rows, n, (a2.stride(0), b2.stride(0)))
    return g.view(a.shape), beta.view(b.shape)
