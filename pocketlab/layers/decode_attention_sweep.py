"""How many programs the decode attention should split into, and how to launch them:
python -m pocketlab.layers.decode_attention_sweep [--launches 0:4:2:0,0:4:2:1,256:8:1:1@8] [--shapes 0.6b,8b]

On CUDA, at the Qwen3-0.6B (16 query heads, 8 kv heads, head_dim 128, w*x q/k norms), Qwen3-8B (32, 8, 128) and
Qwen3.5-9B (16, 4, 256, (1+w)*x) attention shapes, for batches of 1 to 64 sequences of a few live lengths, each in its
graph's key bucket (graphs.key_buckets): the kernel's time for each PROGRAMS_WANTED (the split count follows from it,
split_length), or with --launches for each decode_attention.Launch ("block_n:num_warps:num_stages:early", early 0 never,
1 always, 2 the default's rule, `reads_early`) at the default count or at the one after "@", and the live K/V it reads
per microsecond. Times are medians of CUDA-graph replays cycling over cache copies (invariant.sweep.graph_ms), so each
call reads its keys from HBM as a decode step does and, with PDL, starts while the call before it ends.
"""

from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from ..graphs import key_buckets
from . import decode_attention as da
from . import gemv_tma
from .invariant.sweep import graph_ms

# heads, kv heads, head_dim, (1+w)*x norms
SHAPES = {"0.6b": (16, 8, 128, False), "8b": (32, 8, 128, False), "9b": (16, 4, 256, True)}
TARGETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def bucket(length: int) -> int:
    """The key bucket a graphed step of this many keys replays, in an engine whose longest context is far beyond."""
    return next(size for size in key_buckets(2 * max(length, 128)) if size >= length)


def case_us(shape: str, batch: int, length: int, target: int, launch: da.Launch, copies: int = 3) -> float:
    heads, kv_heads, dim, offset = SHAPES[shape]
    keys, dev, dt = bucket(length), torch.device("cuda"), torch.bfloat16
    caches = [
        tuple(torch.randn(batch, kv_heads, keys, dim, device=dev, dtype=dt) for _ in range(2)) for _ in range(copies)
    ]
    q = torch.randn(batch, heads, dim, device=dev, dtype=dt)
    k, v = (torch.randn(batch, kv_heads, dim, device=dev, dtype=dt) for _ in range(2))
    rope = tuple(torch.randn(batch, dim, device=dev) for _ in range(2))
    norms = (torch.randn(dim, device=dev, dtype=dt), torch.randn(dim, device=dev, dtype=dt), 1e-6, offset)
    slots = torch.arange(batch, device=dev)
    lengths = torch.full((batch,), length, device=dev, dtype=torch.int32)
    before = da.PROGRAMS_WANTED, da.DEFAULT_LAUNCH
    da.PROGRAMS_WANTED, da.DEFAULT_LAUNCH = target, launch
    try:
        run = lambda kv: da.decode_attention(  # type: ignore[call-arg]  # mypy: *kv may fill all  # noqa: E731
            q, k, v, *kv, slots, lengths, keys, dim**-0.5, rope, norms
        )
        return graph_ms(run, caches) * 1e3
    finally:
        da.PROGRAMS_WANTED, da.DEFAULT_LAUNCH = before


def columns(launches: str) -> list[tuple[str, int, da.Launch]]:
    """(header, PROGRAMS_WANTED, Launch) of each column: TARGETS at the default launch, or `launches` (comma-separated
    "block_n:num_warps:num_stages:early", each at the default program count or "@programs")."""
    if not launches:
        return [(f"{t} progs", t, da.DEFAULT_LAUNCH) for t in TARGETS]
    cols = []
    for spec in launches.split(","):
        launch, _, programs = spec.partition("@")
        cols.append((spec, int(programs or da.PROGRAMS_WANTED), gemv_tma.launch_of(launch, da.Launch)))
    return cols


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pocketlab.layers.decode_attention_sweep", description=__doc__)
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--lengths", default="150,1100,4000")
    p.add_argument("--launches", default="", help="block_n:num_warps:num_stages:early[@programs],... (default: counts)")
    p.add_argument("--shapes", default="8b,9b", help=f"of {', '.join(SHAPES)}")
    a = p.parse_args(argv)
    cases = [
        (s, int(b), int(n))
        for s in a.shapes.split(",")
        for b in a.batches.split(",")
        for n in a.lengths.split(",")
        if b and n
    ]
    cols = columns(a.launches)
    print(f"{'shape':<6}{'B':>4}{'keys':>6}{'bucket':>7}  " + "".join(f"{h:>12}" for h, _, _ in cols)
          + "   best  (us; GB/s of live K/V at the best)")  # fmt: skip
    for shape, batch, length in tqdm(cases, desc="cases"):
        _, kv_heads, dim, _ = SHAPES[shape]
        times = [case_us(shape, batch, length, target, launch) for _, target, launch in cols]
        best = min(range(len(cols)), key=times.__getitem__)
        live_bytes = 2 * batch * kv_heads * length * dim * 2
        print(f"{shape:<6}{batch:>4}{length:>6}{bucket(length):>7}  " + "".join(f"{t:>12.2f}" for t in times)
              + f"   {cols[best][0]:>9}  ({live_bytes / times[best] / 1e3:.0f})")  # fmt: skip


if __name__ == "__main__":
    main()
