"""What batch invariance costs: the invariant attention and multi-token Gated DeltaNet kernels against the engine's
fast paths, on CUDA. `python -m pocketlab.layers.invariant.attention_bench` prints a table of median times.

Shapes: Qwen3-8B attention (32 query heads, 8 kv heads, head_dim 128) for decode (T = 1) and a 4096-token
prefill; Qwen3.5-9B Gated DeltaNet (16 key heads, 32 value heads, dk = dv = 128, conv kernel 4) for a
4096-token prefill. Importing this module needs neither CUDA nor Triton.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F


def median_us(fn, reps: int = 15, inner: int = 5, graphed: bool = False) -> float:
    """Median over `reps` samples of the mean time of `inner` back-to-back calls, in microseconds. `graphed`:
    the calls are captured once in a CUDA graph and replayed, so microsecond kernels are timed without the
    host's launch overhead (as the engine's graphed decode steps run them)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    sample: Callable[[], object] = lambda: [fn() for _ in range(inner)]  # noqa: E731
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sample()
        sample = graph.replay
    samples = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        sample()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) * 1e3 / inner)
    return statistics.median(samples)


def decode_row(dtype, B, n, heads=32, kv_heads=8, dim=128):
    """One decode token per row over n cached keys, graphed: ours vs the batch-variant split kernel (which also
    norms, rotates and stores the new token; here RoPE is the identity and no norms)."""
    from ..decode_attention import decode_attention
    from .attention import attention

    gen = torch.Generator(device="cuda").manual_seed(n + B)
    k_cache, v_cache = (torch.randn(B + 1, kv_heads, n, dim, device="cuda", generator=gen, dtype=dtype) for _ in "kv")
    q = torch.randn(B, 1, heads, dim, device="cuda", generator=gen, dtype=dtype)
    slots = torch.arange(B, device="cuda")
    start, ones = torch.full((B,), n - 1, device="cuda"), torch.ones(B, dtype=torch.long, device="cuda")
    k_new, v_new = k_cache[slots, :, n - 1], v_cache[slots, :, n - 1]
    rope = (torch.ones(B, dim, device="cuda", dtype=dtype), torch.zeros(B, dim, device="cuda", dtype=dtype))
    lengths = start + 1
    ours = median_us(lambda: attention(q, k_cache, v_cache, slots, start, ones, dim**-0.5, n), graphed=True)
    theirs = median_us(
        lambda: decode_attention(q[:, 0], k_new, v_new, k_cache, v_cache, slots, lengths, n, dim**-0.5, rope),
        graphed=True,
    )
    return f"decode B={B} keys={n}", ours, "decode_attention", theirs


def prefill_row(dtype, T=4096, heads=32, kv_heads=8, dim=128):
    from .attention import attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    k_cache, v_cache = (torch.randn(1, kv_heads, T, dim, device="cuda", generator=gen, dtype=dtype) for _ in "kv")
    q = torch.randn(1, T, heads, dim, device="cuda", generator=gen, dtype=dtype)
    slots, start = torch.zeros(1, dtype=torch.long, device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda")
    lengths = torch.full((1,), T, device="cuda")
    ours = median_us(lambda: attention(q, k_cache, v_cache, slots, start, lengths, dim**-0.5, T), reps=7, inner=2)
    qt = q.transpose(1, 2)
    sdpa = median_us(
        lambda: F.scaled_dot_product_attention(qt, k_cache, v_cache, is_causal=True, scale=dim**-0.5, enable_gqa=True),
        reps=7,
        inner=2,
    )
    return [(f"prefill T={T}", ours, "SDPA causal", sdpa)]


def gated_delta_rows(dtype, T=4096, hk=16, hv=32, dk=128, dv=128, conv_k=4):
    from ..gated_delta import L2_EPS, causal_conv1d, chunk_gated_delta_rule
    from ..linear_decode import conv_steps, recurrent_steps

    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k = (torch.randn(1, T, hk, dk, device="cuda", generator=gen, dtype=dtype) for _ in "qk")
    v = torch.randn(1, T, hv, dv, device="cuda", generator=gen, dtype=dtype)
    g = -F.softplus(torch.randn(1, T, hv, device="cuda", generator=gen))
    beta = torch.randn(1, T, hv, device="cuda", generator=gen).sigmoid().to(dtype)
    state = torch.zeros(2, hv, dk, dv, device="cuda")
    slots, lengths = torch.zeros(1, dtype=torch.long, device="cuda"), torch.full((1,), T, device="cuda")
    ours = median_us(lambda: recurrent_steps(q, k, v, g, beta, state, slots, lengths, L2_EPS), reps=5, inner=1)
    qr, kr = q.repeat_interleave(hv // hk, 2), k.repeat_interleave(hv // hk, 2)
    chunked = median_us(lambda: chunk_gated_delta_rule(qr, kr, v, g, beta, state[:1]), reps=5, inner=1)
    C = 2 * hk * dk + hv * dv
    x = torch.randn(1, T, C, device="cuda", generator=gen, dtype=dtype)
    w = torch.randn(C, conv_k, device="cuda", generator=gen, dtype=dtype)
    window = torch.zeros(2, C, conv_k - 1, device="cuda", dtype=dtype)
    conv_ours = median_us(lambda: conv_steps(x, window, w, slots, lengths))
    conv_torch = median_us(lambda: causal_conv1d(x, window[:1], w, lengths))
    return [
        (f"GDN recurrent T={T}", ours, "torch chunked rule", chunked),
        (f"GDN conv T={T}", conv_ours, "causal_conv1d", conv_torch),
    ]


def benchmark(dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, float, str, float]]:
    """Rows (case, invariant kernel us, baseline name, baseline us), also printed as a table."""
    if not torch.cuda.is_available():
        raise RuntimeError("the kernel benchmark needs a CUDA device")
    from ..decode_attention import triton

    if triton is None:
        raise RuntimeError("the kernel benchmark needs Triton")
    rows = [decode_row(dtype, B, n) for B in (1, 8, 32) for n in (128, 512, 1024, 4096)]
    rows += prefill_row(dtype) + gated_delta_rows(dtype)
    print(f"{'case':<26}{'invariant us':>14}  {'baseline':<20}{'baseline us':>12}{'ratio':>8}")
    for case, ours, name, theirs in rows:
        print(f"{case:<26}{ours:>14.1f}  {name:<20}{theirs:>12.1f}{ours / theirs:>8.2f}")
    return rows


if __name__ == "__main__":
    benchmark()
