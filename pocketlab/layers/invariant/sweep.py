"""Which launches of the invariant matmul are fast, and which keep the bits: python -m pocketlab.layers.invariant.sweep

On CUDA, for every Qwen3-8B and Qwen3.5-9B weight shape: (1) decode rows (M < MANY_ROWS) for each split
count and tile width, to choose the order's split; (2) every candidate launch of the chosen order at few and
many rows, checked bitwise against the default launch's rows; cuBLAS beside each. Times are medians of
CUDA-graph replays cycling over enough weight copies that every call reads its weight from HBM.
"""

import argparse
import functools
import itertools
import statistics
from collections.abc import Sequence

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
       Tiles(64, 64, 4, 6, LAST_SUMS), Tiles(64, 128, 4, 4, LAST_SUMS), Tiles(16, 64, 4, 4, LAST_SUMS),
       Tiles(32, 64, 4, 4, LAST_SUMS), Tiles(32, 32, 4, 4, LAST_SUMS), Tiles(32, 64, 4, 3, LAST_SUMS)]  # fmt: skip
MANY = [Tiles(128, 128, 8, 3, IN_PROGRAM), Tiles(128, 256, 8, 2, IN_PROGRAM), Tiles(128, 128, 4, 3, IN_PROGRAM),
        Tiles(64, 128, 4, 4, IN_PROGRAM), Tiles(128, 64, 4, 4, IN_PROGRAM)]  # fmt: skip


def graph_ms(fn, weights: Sequence[object], runs: int = 15) -> float:
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


def launch_ms(x: torch.Tensor, weights: list[torch.Tensor], o: Order, t: Tiles) -> float:
    y = torch.empty(x.shape[0], weights[0].shape[0], device=x.device, dtype=x.dtype)
    return graph_ms(lambda w: matmul.launch(x, w, None, y, o, t), weights)


def describe(o: Order, t: Tiles) -> tuple[str, str]:
    mode = "in-program" if t.mode == IN_PROGRAM else "last-sums"
    tile = f"{t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages} {mode}"
    return f"{o.block_k}, {o.split_k}, {o.k_per_split}", tile


def split_order(o: Order, K: int, split: int) -> Order:
    """`o` with K cut into `split` slices (as many as whole block_k steps allow)."""
    k_blocks = -(-K // o.block_k)
    kps = -(-k_blocks // split) * o.block_k
    return Order(o.block_k, -(-K // kps), kps)


def sweep_shape(name: str, N: int, K: int, x: torch.Tensor, few, many, splits) -> None:
    """Print one line per (order, launch, M): time, cuBLAS's time, ratio, bits against the default launch."""
    copies = max(1, min(8, (400 * 2**20) // (N * K * 2)))
    weights = [torch.randn(N, K, device=x.device, dtype=x.dtype) * K**-0.5 for _ in range(copies)]
    chosen = matmul.order(N, K, x.dtype)
    xs = {M: x[:M, :K].contiguous() for M in few + many}
    cublas = {M: graph_ms(lambda w, xm=xm: F.linear(xm, w), weights) for M, xm in xs.items()}

    def line(M, o, t, ms, bits=""):
        ords, tile = describe(o, t)
        ords += " *" if o == chosen else ""
        tqdm.write(f"{name:<12}{M:>6}  {ords:<28}{tile:<34}{ms:>8.4f}{cublas[M]:>8.4f}{ms / cublas[M]:>7.2f}  {bits}")

    k_blocks = -(-K // chosen.block_k)
    for split in (s for s in splits if s <= k_blocks):  # candidate orders, timed at decode rows
        o = split_order(chosen, K, split)
        for t in (FEW[0], FEW[1], FEW[4]):
            for M in few:
                line(M, o, t, launch_ms(xs[M], weights, o, t))
    # the chosen order: every launch against the default launch's bits on the first 64 rows
    ref = matmul.launch(x[:64, :K].contiguous(), weights[0], None, torch.empty(64, N, device=x.device, dtype=x.dtype),
                        chosen, matmul.tiles(64, N, x.dtype, x.device))  # fmt: skip
    for t in FEW + MANY:
        for M in few if t.mode == LAST_SUMS else many:
            y = matmul.launch(xs[M], weights[0], None, torch.empty(M, N, device=x.device, dtype=x.dtype), chosen, t)
            bits = "equal" if torch.equal(y[: min(M, 64)], ref[: min(M, 64)]) else "DIFFER"
            line(M, chosen, t, launch_ms(xs[M], weights, chosen, t), bits)


FUSED_SHAPES = {  # (N, K, the epilogue) at the Qwen3-0.6B, Qwen3.5-0.8B and Qwen3-8B decode shapes
    "0.6b o+res": (1024, 2048, "residual"), "0.6b gate_up+swiglu": (3072, 1024, "swiglu"),
    "0.6b down+res": (1024, 3072, "residual"), "8b o+res": (4096, 4096, "residual"),
    "8b gate_up+swiglu": (12288, 4096, "swiglu"), "8b down+res": (4096, 12288, "residual"),
    # the plain projections cuBLAS runs today: whether the Triton kernel should take them at decode rows too
    "0.6b qkv": (4096, 1024, "plain"), "0.8b gdn in": (8224, 1024, "plain"), "8b qkv": (6144, 4096, "plain"),
    "9b gdn in": (12352, 4096, "plain"),
}  # fmt: skip
EPILOGUE_OF = {"plain": matmul.PLAIN, "residual": matmul.RESIDUAL, "swiglu": matmul.SWIGLU}
FUSED_FEW = [Tiles(16, 32, 4, 4, LAST_SUMS), Tiles(16, 64, 4, 4, LAST_SUMS), Tiles(16, 32, 4, 2, LAST_SUMS),
             Tiles(16, 64, 8, 4, LAST_SUMS), Tiles(32, 64, 4, 4, LAST_SUMS), Tiles(32, 32, 4, 4, LAST_SUMS),
             Tiles(32, 64, 4, 3, LAST_SUMS), Tiles(32, 32, 4, 3, LAST_SUMS),
             Tiles(64, 32, 4, 3, LAST_SUMS)]  # fmt: skip


def fused_weights(rows: int, K: int) -> list[torch.Tensor]:
    """bf16 copies of a [rows, K] weight, up to 16 and 800 MiB: cycling over them, every call reads from HBM."""
    copies = max(1, min(16, (800 * 2**20) // (rows * K * 2)))
    return [torch.randn(rows, K, device="cuda", dtype=torch.bfloat16) * K**-0.5 for _ in range(copies)]


def sweep_fused(rows: list[int], splits: list[int]) -> None:
    """The fused kernel (residual add or SwiGLU after the matmul) per order and launch at decode rows, as weight-read
    bandwidth, against cuBLAS's bare matmul of the same weight (which fuses nothing); '*' marks the order in use,
    whose launches are checked bitwise against its default launch."""
    print(f"{'shape':<20}{'M':>4}  {'order':<18}{'launch':<24}{'ms':>8}{'TB/s':>7}{'cuBLAS':>8}{'TB/s':>7}  bits")
    for name, (N, K, extra) in FUSED_SHAPES.items():
        rows_w = 2 * N if extra == "swiglu" else N
        weights = fused_weights(rows_w, K)
        chosen, tb = matmul.order(N, K, torch.bfloat16), rows_w * K * 2 / 1e9
        orders = {split_order(chosen, K, s) for s in splits}
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) if extra == "residual" else None
            fused = matmul.Fused(res, EPILOGUE_OF[extra])
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            cublas = graph_ms(lambda w, x=x: F.linear(x, w), weights)
            ref = matmul.launch(x, weights[0], None, y.clone(), chosen, matmul.tiles(M, N, x.dtype, x.device), fused)
            for o in sorted(orders, key=lambda o: o.split_k):
                for t in FUSED_FEW:
                    ms = graph_ms(lambda w, a=(x, y, o, t, fused): matmul.launch(a[0], w, None, *a[1:]), weights)
                    bits = ""
                    if o == chosen:
                        same = torch.equal(matmul.launch(x, weights[0], None, y, o, t, fused), ref)
                        bits = "equal" if same else "DIFFER"
                    ords, launch = describe(o, t)
                    ords += " *" if o == chosen else ""
                    print(
                        f"{name:<20}{M:>4}  {ords:<18}{launch:<24}{ms:>8.4f}{tb / ms:>7.2f}{cublas:>8.4f}"
                        f"{tb / cublas:>7.2f}  {bits}"
                    )
        del weights
        torch.cuda.empty_cache()


TMA_RINGS = tuple(f"{bn}:{stages}:{ahead}" for bn in (64, 128) for stages in (3, 4, 6) for ahead in (0, 2))


def tma_line(name, M, tb, cublas, ref, what, ms, got) -> None:
    diff = (got.float() - ref.float()).abs().max().item()
    print(f"{name:<20}{M:>4}  {what:<30}{ms:>8.4f}{tb / ms:>7.2f}{cublas:>8.4f}{tb / cublas:>7.2f}  {diff:.3g}")


def named(names, spec: str) -> list[str]:
    """The names holding any of `spec`'s comma-separated parts (`_` for a space); every name for an empty spec."""
    parts = [part.replace("_", " ") for part in spec.split(",") if part]
    return [s for s in names if not parts or any(part in s for part in parts)]


def sweep_tma(rows: list[int], shapes: Sequence[str] = tuple(FUSED_SHAPES), rings: Sequence[str] = TMA_RINGS,
              splits: Sequence[int] = ()) -> None:  # fmt: skip
    """layers.matmul_tma's `rings` ("block_n:stages:prefetch", W @ x^T through TMA) against the fused kernel's
    default launch and cuBLAS's bare matmul, at decode rows, as weight-read bandwidth, for the FUSED_SHAPES named
    `shapes`, each ring at its order's split and at `splits` (other bits: another order); the largest difference
    from the default launch's output."""
    from .. import gemv_tma, matmul_tma

    rings_ = [gemv_tma.launch_of(spec, matmul_tma.Ring) for spec in rings]
    print(f"{'shape':<20}{'M':>4}  {'launch':<30}{'ms':>8}{'TB/s':>7}{'cuBLAS':>8}{'TB/s':>7}  max diff")
    for name in shapes:
        N, K, extra = FUSED_SHAPES[name]
        rows_w = 2 * N if extra == "swiglu" else N
        weights = fused_weights(rows_w, K)
        tb = rows_w * K * 2 / 1e9
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) if extra == "residual" else None
            fused = matmul.Fused(res, EPILOGUE_OF[extra])
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            o, t = matmul.order(N, K, x.dtype), matmul.tiles(M, N, x.dtype, x.device, extra == "swiglu")
            cublas = graph_ms(lambda w, x=x: F.linear(x, w), weights)
            ref = matmul.launch(x, weights[0], None, y.clone(), o, t, fused)

            line = functools.partial(tma_line, name, M, tb, cublas, ref)
            line(
                f"fused {describe(o, t)[1]}",
                graph_ms(lambda w, a=(x, y, o, t, fused): matmul.launch(a[0], w, None, *a[1:]), weights),
                ref,
            )
            for r, cut in itertools.product(rings_, dict.fromkeys([o, *(split_order(o, K, s) for s in splits)])):
                what = f"tma {r.block_n} s{r.stages} p{r.prefetch}" + (f" split {cut.split_k}" if cut != o else "")
                run = functools.partial(matmul_tma.launch, fused=fused, o=cut, ring=r)
                try:
                    ms = graph_ms(lambda w, a=(x, y), run=run: run(a[0], w, None, a[1]), weights)
                except Exception as e:  # a ring past the shared memory: say so, go on
                    print(f"{name:<20}{M:>4}  {what}: {str(e)[:60]}")
                    continue
                line(what, ms, run(x, weights[0], None, y.clone()))
        del weights
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--few", default="1,8,32")
    ap.add_argument("--many", default="128,4096")
    ap.add_argument("--splits", default="1,2,4,8")
    ap.add_argument("--fused", action="store_true", help="the fused kernel's launches at the --few rows instead")
    ap.add_argument("--tma", action="store_true", help="layers.matmul_tma's rings at the --few rows instead")
    ap.add_argument("--shapes", default="", help="--tma: names holding any of these, comma-separated, _ for a space")
    ap.add_argument("--rings", default=",".join(TMA_RINGS), help="--tma: block_n:stages:prefetch, comma-separated")
    ap.add_argument("--tma-splits", default="", help="--tma: split counts besides each order's own (other bits)")
    a = ap.parse_args(argv)
    if a.tma:
        splits = [int(v) for v in a.tma_splits.split(",") if v]
        return sweep_tma([int(v) for v in a.few.split(",")], named(FUSED_SHAPES, a.shapes), a.rings.split(","), splits)
    if a.fused:
        return sweep_fused([int(v) for v in a.few.split(",")], [int(v) for v in a.splits.split(",")])
    few, many, splits = ([int(v) for v in s.split(",")] for s in (a.few, a.many, a.splits))
    x = torch.randn(max(many), 12288, device="cuda", dtype=torch.bfloat16)
    head = f"{'shape':<12}{'M':>6}  {'order (bk, split, k/split)':<28}{'launch':<34}{'ms':>8}{'cuBLAS':>8}{'ratio':>7}"
    print(head + "  bits")
    for name, (N, K) in tqdm(SHAPES.items(), desc="shapes"):
        sweep_shape(name, N, K, x, few, many, splits)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
