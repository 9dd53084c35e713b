"""Batch-invariant kernels against torch at the Qwen3-8B shapes: python -m pocketlab.layers.invariant.bench

On CUDA: one table of median times (torch.cuda.Event, L2 flushed before each run), the ratio ours / torch,
the largest error against torch relative to its output scale, and whether row 0 computed in the batch
equals row 0 computed alone (bitwise). Without CUDA it prints the tile configuration of each matmul shape.
"""

import argparse
import statistics

import torch
import torch.nn.functional as F

from .. import norm as torch_norm
from . import matmul, norm

QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
            "lm_head": (151936, 4096)}  # fmt: skip
HIDDEN, GATED_HEADS, GATED_DIM = 4096, 32, 128  # Qwen3.5-9B's Gated DeltaNet output norm: per value head
EPS = 1e-6


def config_table(dtype: torch.dtype) -> list[str]:
    """The order each shape gets and how many programs a decode step (one program per slice) launches."""
    lines = [f"{'shape':<9}{'N':>8}{'K':>7}  block_k  split  k/split  decode programs"]
    for name, (N, K) in QWEN3_8B.items():
        o = matmul.order(N, K, dtype)
        programs = -(-N // matmul.DECODE_BLOCK_N) * o.split_k
        lines.append(f"{name:<9}{N:>8}{K:>7}  {o.block_k:>7}  {o.split_k:>5}  {o.k_per_split:>7}  {programs:>15}")
    return lines


def median_ms(fn, x: torch.Tensor, runs: int, flush: torch.Tensor) -> float:
    fn(x)  # compile and warm up
    times = []
    for _ in range(runs):
        flush.zero_()  # evict the weights from L2, as the other layers of a real step do
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cases(dtype: torch.dtype):
    """(label, ours(x), torch's eager op(x), x's shape for M tokens) for every matmul and norm shape."""
    dev = "cuda"
    for name, (N, K) in QWEN3_8B.items():
        w = torch.randn(N, K, device=dev, dtype=dtype) * K**-0.5
        yield name, lambda x, w=w: matmul.linear(x, w), lambda x, w=w: F.linear(x, w), (lambda M, K=K: (M, K))
    w = 1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=dtype)
    yield (
        "rms_norm",
        lambda x: norm.rms_norm(x, w, EPS),
        lambda x: torch_norm._rms_norm(x, w, EPS),
        lambda M: (M, HIDDEN),
    )
    wg = 1 + 0.1 * torch.randn(GATED_DIM, device=dev, dtype=dtype)
    yield (
        "gated_norm",
        lambda x: norm.gated_rms_norm(x, x, wg, EPS),
        lambda x: torch_norm.gated_rms_norm(x, x, wg, EPS),
        lambda M: (M * GATED_HEADS, GATED_DIM),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,64,4096", help="batch sizes M, comma-separated")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print("\n".join(config_table(dtype)))
    if not torch.cuda.is_available():
        print("no CUDA device: timings skipped")
        return
    rows = [int(m) for m in args.rows.split(",")]
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # > the H200's 50 MB L2
    print(f"\n{'op':<13}{'M':>6}{'ours ms':>10}{'torch ms':>10}{'ratio':>8}{'max err':>10}  row 0 alone")
    for label, ours, ref, shape in cases(dtype):
        for M in rows:
            x = torch.randn(*shape(M), device="cuda", dtype=dtype)
            t_ours, t_ref = median_ms(ours, x, args.runs, flush), median_ms(ref, x, args.runs, flush)
            y, y_ref = ours(x), ref(x)
            err = ((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item()
            rows_of_one = shape(1)[0]  # the gated norm has several rows per token
            alone = torch.equal(y[:rows_of_one], ours(x[:rows_of_one].clone()))
            print(f"{label:<13}{M:>6}{t_ours:>10.4f}{t_ref:>10.4f}{t_ours / t_ref:>8.2f}{err:>10.2e}  {alone}")


if __name__ == "__main__":
    main()
