"""float32 -> output dtype, rounded to nearest even on the GPU and in Triton's CPU interpreter alike.

The interpreter truncates float32 -> bfloat16 (and its "rtne" mode carries wrongly), which would move every
bf16 result one ulp off torch's on the CPU. Rounding the bits ourselves costs a few integer ops per element
and gives the hardware conversion's result everywhere (NaN stays NaN, overflow goes to inf).
"""

import triton
import triton.language as tl


@triton.jit
def cast(x, dtype: tl.constexpr):
    """x (float32) rounded to `dtype` (float32, float16 or bfloat16) to nearest, ties to even."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, x.to(tl.bfloat16), rounded)
    else:
        return x.to(dtype)
