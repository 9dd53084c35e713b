"""acc + a @ b with each element's products summed in the same order on the GPU and in Triton's interpreter.

On the GPU an element of tl.dot is one chain of MMA steps, whatever its row's place in the tile. The CPU
interpreter hands tl.dot to numpy's BLAS, whose micro-kernels may sum a row in another order at another place
in the tile (seen with OpenBLAS's Haswell kernels), which would make the CPU tests judge the BLAS, not our
kernels: there the products are summed over k by elementwise adds instead. (Triton 3.9's interpreter also
multiplies bf16 tiles as their raw 16-bit integers, numpy having no bf16: float32 operands avoid that too.)
"""

import torch
import triton
import triton.language as tl


def precision(dtype: torch.dtype, device: torch.device) -> str:
    """The PRECISION constexpr for `dot`: "in_order" in the interpreter, IEEE float32 dots, else tensor cores."""
    if device.type == "cpu":
        return "in_order"
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a [M, K] @ b [K, N] in fp32 (the interpreter: inputs as fp32, summed one k after another)."""
    if PRECISION == "in_order":
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)
