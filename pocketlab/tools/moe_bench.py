"""The routed experts of one MoE layer alone, each path timed against the device's ceilings in the same run: how
the Triton kernels (layers.moe_kernel; layers.moe_gemv at decode sizes) and torch's grouped_mm (layers.moe)
compare, to choose moe_kernel "auto" and the tokens up to which decode streams its experts' rows.

    python -m pocketlab.tools.moe_bench --model qwen3.5-35b-a3b --device cuda [--tokens 1,2,4,8,16,32,64,4096]
        [--sweep]   (CUDA: each projection's launch tiles at the decode sizes, to choose moe_kernel.tiles, and at
                     one token moe_gemv.tiles and the TMA-ring experiment's rings)

Per token count N: the experts its routing reads (random weights, random router), the step time of each path
(captured in a CUDA graph for N <= 64, as decode runs it; eager beyond, as prefill does), the bytes it must read
(distinct experts x an expert's weights) over the measured copy bandwidth, and its flops over the matmul rate.
The loop path (one matmul per expert hit, host syncs: HF's eager way) runs eagerly as the baseline. On CUDA the
routing itself too: torch's ops (softmax, topk, rescale) against the one-launch kernel; and the TMA-ring experiment
(layers.moe_gemv_tma.experts_tma) beside "gemv": "gemv_tma", its gate_up through a ring.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from ..config import DTYPES, ModelConfig
from ..layers import moe
from .cli import ints
from .roofline import copy_bandwidth, matmul_rate
from .synthetic import hf_config
from .timing import Clock

GRAPH_MAX_TOKENS = 64  # decode batches: the engine replays these from CUDA graphs


def paths(device: str) -> dict:
    out: dict[str, Callable[..., torch.Tensor]] = {"grouped_mm": moe.grouped_experts, "loop": moe.looped_experts}
    if torch.device(device).type == "cuda":
        from ..layers.moe_gemv import gemv_experts
        from ..layers.moe_gemv_tma import experts_tma
        from ..layers.moe_kernel import fused_experts

        gpu = {"triton": fused_experts, "gemv": gemv_experts, "gemv_tma": experts_tma}
        out = cast(dict[str, Callable[..., torch.Tensor]], gpu) | out
    return out


def in_graph(fn, args):
    """fn(*args) captured once in a CUDA graph: the replay, as a decode step runs it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args)  # warm-up (Triton compiles, allocator settles) outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    return graph.replay


@torch.inference_mode()
def bench_layer(
    cfg: ModelConfig, n: int, device: str, dtype: torch.dtype, clock: Clock, repeats: int, ceil: dict, sweep: bool
):
    gen = torch.Generator(device=device).manual_seed(n)
    E, H, I, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    x, router = randn(n, H), randn(E, H, scale=H**-0.5)
    gate_up, down = randn(E, 2 * I, H, scale=H**-0.5), randn(E, H, I, scale=I**-0.5)
    logits = x @ router.T
    weights, ids = moe.route(logits, k, cfg.norm_topk_prob)
    args = (x, gate_up, down, weights, ids)
    hit = int(ids.unique().numel())
    elem = torch.finfo(dtype).bits // 8
    moved = hit * 3 * I * H * elem + n * H * elem * 2  # the experts read, the tokens in and out
    flops = 2 * n * k * 3 * I * H
    row: dict[str, object] = {"tokens": n, "experts_hit": hit, "bytes": moved, "flops": flops}
    reference = moe.looped_experts(*args)
    decode = clock.cuda and n <= GRAPH_MAX_TOKENS  # replayed from a CUDA graph, as the engine's decode steps are
    if decode:
        from ..layers.moe_kernel import route_in_one_launch

        for name, fn in (("route_torch", moe.route), ("route_triton", route_in_one_launch)):
            row[name] = {"seconds": clock.measure(in_graph(fn, (logits, k, cfg.norm_topk_prob)), repeats, warmup=3)}
    for name, fn in paths(device).items():
        if name.startswith("gemv") and not decode:
            row[name] = {"error": "decode sizes only"}
            continue
        try:
            run = in_graph(fn, args) if decode and name != "loop" else functools.partial(fn, *args)
            seconds = clock.measure(run, repeats, warmup=3)
            err = float((fn(*args).float() - reference.float()).abs().max())
        except Exception as exc:  # noqa: BLE001 - a path that cannot run this shape is reported, not fatal
            row[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        row[name] = {
            "seconds": seconds,
            "bandwidth_frac": moved / seconds / ceil["copy"]["bytes_per_s"],
            "matmul_frac": flops / seconds / ceil["matmul"]["flop_per_s"],
            "max_abs_diff_vs_loop": err,
        }
    if sweep and decode:
        row["sweep"] = sweep_tiles(args, clock, repeats)
    if sweep and decode and n == 1:
        row["gemv_sweep"] = sweep_gemv_tiles(args, clock, repeats)
        row["tma_sweep"] = sweep_tma_rings(args, clock, repeats)
    return row


def sweep_tiles(args, clock: Clock, repeats: int) -> list[dict]:
    """The Triton path with each projection's launch varied: columns per program, warps, pipeline stages. Rows per
    block and the K step stay (they fix the layout and a row's sums)."""
    from ..layers.moe_kernel import Launch, fused_experts, tiles

    base = tiles(args[4].numel(), args[0].dtype, args[0].device)
    launches = [Launch(n, w, s) for n in (16, 32, 64, 128) for w in (2, 4) for s in (3, 5)]
    return sweep_launches(fused_experts, args, base, launches, clock, repeats)


def sweep_gemv_tiles(args, clock: Clock, repeats: int) -> list[dict]:
    """layers.moe_gemv with each projection's launch varied: columns per program, K step, warps."""
    from ..layers.moe_gemv import Launch, gemv_experts, tiles

    launches = [Launch(n, k, w) for n in (1, 2, 4, 8) for k in (64, 128, 256) for w in (4, 8)]
    return sweep_launches(gemv_experts, args, tiles(args[0].device), launches, clock, repeats)


def sweep_tma_rings(args, clock: Clock, repeats: int) -> list[dict]:
    """The TMA-ring experiment's gate_up launch at each ring (layers.gemv_sweep.RINGS), moe_gemv's own down after it,
    graphed."""
    from ..layers.gemv_sweep import RINGS
    from ..layers.moe_gemv_tma import experts_tma

    out = []
    for ring in RINGS:
        run = in_graph(functools.partial(experts_tma, ring=ring), args)
        out.append({"projection": "gate_up", **dataclasses.asdict(ring), "seconds": clock.measure(run, repeats, 3)})
    return out


def sweep_launches(experts, args, base, launches, clock: Clock, repeats: int) -> list[dict]:
    """experts(*args, t=...) graphed with each projection's launch varied alone (the other at `base`'s)."""
    out = []
    for proj in ("gate_up", "down"):
        for launch in launches:
            cell = {"projection": proj, **dataclasses.asdict(launch)}
            try:
                t = dataclasses.replace(base, **{proj: launch})
                run = in_graph(functools.partial(experts, *args, t=t), ())
                out.append(cell | {"seconds": clock.measure(run, repeats, 3)})
            except Exception as exc:  # noqa: BLE001 - a launch the compiler refuses is reported, not fatal
                print(f"sweep: {cell} failed: {type(exc).__name__}: {exc}")
    return out


def us(cell: dict) -> str:
    return f"{cell['seconds'] * 1e6:.1f}"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m pocketlab.tools.moe_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3.5-35b-a3b", help="an MoE preset of pocketlab.tools.synthetic")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="")
    ap.add_argument("--tokens", type=ints, default=(1, 2, 4, 8, 16, 32, 64, 4096))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="CUDA: time each projection's launch tiles (decode sizes)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    dtype = DTYPES[a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")]
    cfg = ModelConfig.from_dict(hf_config(a.model).to_dict())
    if not cfg.num_experts:
        raise ValueError(f"{a.model} is not a mixture-of-experts preset")
    clock = Clock(a.device)
    cuda = a.device.startswith("cuda")
    ceil = {
        "copy": copy_bandwidth(clock, a.device, 1024 if cuda else 64, 10),
        "matmul": matmul_rate(clock, a.device, dtype, 8192 if cuda else 512, 10),
    }
    rows = [bench_layer(cfg, n, a.device, dtype, clock, a.repeats, ceil, a.sweep) for n in a.tokens]
    result = {"model": a.model, "device": a.device, "dtype": str(dtype), "ceilings": ceil, "rows": rows}
    print(f"{a.model}: E={cfg.num_experts} top-{cfg.num_experts_per_tok} I={cfg.moe_intermediate_size}, {dtype}")
    print(f"{'tokens':>6} {'experts':>7} " + " ".join(f"{p + ' us':>14} {'bw frac':>7}" for p in paths(a.device)))
    for r in rows:
        cells = []
        for p in paths(a.device):
            c = r[p]
            cells.append(
                f"{'error':>14} {'':>7}" if "error" in c else f"{c['seconds'] * 1e6:14.1f} {c['bandwidth_frac']:7.2f}"
            )
        print(f"{r['tokens']:>6} {r['experts_hit']:>7} " + " ".join(cells))
    for r in (r for r in rows if "route_torch" in r):
        print(f"routing, {r['tokens']} tokens: torch {us(r['route_torch'])}, one launch {us(r['route_triton'])} us")
    sweeps = (
        ("sweep", "triton", "n{block_n} w{num_warps} s{num_stages}"),
        ("gemv_sweep", "gemv", "n{block_n} k{block_k} w{num_warps}"),
        ("tma_sweep", "gemv", "n{block_n} k{block_k} s{stages}"),  # a ring in place of one of its launches
    )
    for key, path, label in sweeps:
        for r in (r for r in rows if key in r):
            for proj in ("gate_up", "down"):
                runs = sorted((c for c in r[key] if c["projection"] == proj), key=lambda c: c["seconds"])
                if not runs:
                    continue
                best = ", ".join(f"{label.format(**c)} {us(c)}" for c in runs[:4])
                print(
                    f"{key.replace('_', ' ')}, {r['tokens']} tokens, {proj}: default {us(r[path])} us; fastest {best}"
                )
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
