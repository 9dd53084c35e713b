"""Which launches of the invariant matmul are fast, and which keep the bits: python -m pocketlab.layers.invariant.sweep

On CUDA, for every Qwen3-8B and Qwen3.5-9B weight shape: (1) decode rows (M < MANY_ROWS) for each split
count and tile width, to choose the order's split; (2) every candidate launch of the chosen order at few and
many rows, checked bitwise against the default launch's rows; cuBLAS beside each. Times are medians of
CUDA-graph replays cycling over enough weight copies that every call reads its weight from HBM.
"""

import argparse
import dataclasses
import statistics

import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import matmul
from .matmul import IN_PROGRAM, LAST_SUMS, Order, Tiles

SHAPES = {
    "8b qkv": (6144, 4096), "8b o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
    "8b lm_head": (151936, 4096), "9b gdn in": (12352, 4096), "9b attn qkv": (10240, 4096),
    "9b lm_head": (248320, 4096),
}  # fmt: skip
FEW = [Tiles(64, 32, 4, 4, LAST_SUMS), Tiles(64, 64, 4, 3, LAST_SUMS), Tiles(64, 64, 4, 4, LAST_SUMS),
       Tiles(64, 64, 4, 6, LAST_SUMS), Tiles(64, 128, 4, 4, LAST_SUMS), Tiles(16, 64, 4, 4, LAST_SUMS)]  # fmt: skip
MANY = [Tiles(128, 128, 8, 3, IN_PROGRAM), Tiles(128, 256, 8, 3, IN_PROGRAM), Tiles(128, 128, 4, 3, IN_PROGRAM),
        Tiles(64, 128, 4, 4, IN_PROGRAM), Tiles(128, 64, 4, 4, IN_PROGRAM)]  # fmt: skip


def graph_ms(fn, weights: list[torch.Tensor], runs: int = 15) -> float:
    """Median time of one fn(w) call, from graphs that call it once per weight copy."""
    for w in weights:
        fn(w)  # compile, allocate
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / len(weights))
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--few", default="1,8,32")
    ap.add_argument("--many", default="128,4096")
    ap.add_argument("--splits", default="1,2,4,8")
    a = ap.parse_args(argv)
    few, many, splits = ([int(v) for v in s.split(",")] for s in (a.few, a.many, a.splits))
    dt, dev = torch.bfloat16, "cuda"
    x = torch.randn(max(many), 12288, device=dev, dtype=dt)
    print(f"{'shape':<12}{'M':>6}  {'order (bk, split, k/split)':<28}{'launch':<34}{'ms':>8}{'cuBLAS':>8}{'ratio':>7}  bits")
    for name, (N, K) in tqdm(SHAPES.items(), desc="shapes"):
        copies = max(1, min(8, (400 * 2**20) // (N * K * 2)))
        weights = [torch.randn(N, K, device=dev, dtype=dt) * K**-0.5 for _ in range(copies)]
        chosen = matmul.order(N, K, dt)

        def run(M, o: Order, t: Tiles, xs=x[:, :K]):
            xm = xs[:M].contiguous()
            y = torch.empty(M, N, device=dev, dtype=dt)
            return graph_ms(lambda w: matmul.launch(xm, w, None, y, o, t), weights), y

        def row(M, o, t, ms, ref_ms, bits):
            tile = f"{t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages} {'in-program' if t.mode == IN_PROGRAM else 'last-sums'}"
            ords = f"{o.block_k}, {o.split_k}, {o.k_per_split}" + (" *" if o == chosen else "")
            tqdm.write(f"{name:<12}{M:>6}  {ords:<28}{tile:<34}{ms:>8.4f}{ref_ms:>8.4f}{ms / ref_ms:>7.2f}  {bits}")

        cublas = {M: graph_ms(lambda w, xm=x[:M, :K].contiguous(): F.linear(xm, w), weights) for M in few + many}
        for split in splits:  # the order's split, at decode rows
            kb = -(-K // chosen.block_k)
            if split > kb:
                continue
            kps = -(-kb // split) * chosen.block_k
            o = Order(chosen.block_k, -(-K // kps), kps)
            for t in FEW[:2] + FEW[4:5]:
                for M in few:
                    row(M, o, t, run(M, o, t)[0], cublas[M], "")
        # the chosen order: every launch against the default launch's rows (the first 64 rows of x)
        ref = matmul.launch(x[:64, :K].contiguous(), weights[0], None, torch.empty(64, N, device=dev, dtype=dt),
                            chosen, matmul.tiles(64, N, dt, x.device))  # fmt: skip
        for t in FEW + MANY:
            for M in few if t.mode == LAST_SUMS else many:
                ms, _ = run(M, chosen, t)
                y = matmul.launch(x[:M, :K].contiguous(), weights[0], None, torch.empty(M, N, device=dev, dtype=dt),
                                  chosen, t)  # fmt: skip
                r = min(M, 64)
                bits = "equal" if torch.equal(y[:r], ref[:r]) else "DIFFER"
                row(M, chosen, dataclasses.replace(t), ms, cublas[M], bits)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
