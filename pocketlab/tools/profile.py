"""Where a decode step's (graphs on and off) and a prefill's GPU time goes: kernel tables from torch.profiler.

Why: decode at batch 1 is bound by kernel count and small-matmul efficiency, not FLOPs; the table
(kernels per step, GPU-busy vs wall time, the costliest kernels) says which of the two to attack.
Wall time far above GPU-busy time means host overhead (Python, launches, syncs) or, inside a CUDA graph,
the gaps between many tiny kernels.

    python -m pocketlab.tools.profile --model qwen3-0.6b [--batch-sizes 1,32] [--prefill-lens 512,4096] [--steps 20]

`--host N` adds, per prefill length, the N functions with the most own host time in one prefill (cProfile). Graphed
decode rows also time their graph alone (`graph_once_us`, `graph_us`): the step's wall time beyond it is spent outside
the graph (the host's work, the inputs' and logits' copies, reading the tokens back); `host_*_us` say when, in a step,
the host loaded the graph's inputs, launched it and had the greedy tokens back (tools.host_time.step_timeline);
`--ladder` adds `ladder_*_us`: the step built up piece by piece from its graph alone, at fixed keys
(tools.host_time.step_ladder). Eager rows also list one layer's kernels in launch order, each timed over every layer
(`layer_table`), where the kernel-name table adds a layer's GEMVs of one name together. Every step is profiled from
an idle device, so none is launched ahead (`decode_ahead` off unless an --engine-option asks for it): the loop of calls
that overlaps them is timed by tools.bench and tools.ab.
"""

from __future__ import annotations

import argparse
import time
from typing import cast

import pandas as pd
import torch
from torch.autograd import DeviceType

from ..engine import QwenEngine
from ..graphs import StepGraphs
from ..layers.gated_delta import backend_name
from ..requests import BatchedRequest
from .bench import BenchConfig, device_name
from .bench_engine import build, random_tokens
from .cli import ints, option
from .host_time import profile_call, step_ladder, step_timeline
from .timing import Clock


def _self_us(event, cuda: bool) -> float:
    if not cuda:
        return event.self_cpu_time_total
    return cast(float, getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0))


def kernel_table(prof, cuda: bool = True) -> pd.DataFrame:
    """GPU kernels (on the CPU: operators) of one profiled call: count and self time."""
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    rows = [
        {"kernel": e.key[:90], "count": e.count, "us": _self_us(e, cuda)}
        for e in prof.key_averages()
        if e.device_type == kind and _self_us(e, cuda) > 0
    ]
    return pd.DataFrame(rows, columns=["kernel", "count", "us"])


def ordered_kernels(prof, cuda: bool = True) -> list[tuple[str, float]]:
    """(name, own us) of each GPU kernel of one profiled call (on the CPU: each operator), in the order they started."""
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    events = sorted((e for e in prof.events() if e.device_type == kind), key=lambda e: e.time_range.start)
    return [(e.name[:90], _self_us(e, cuda)) for e in events]


def repeating_block(names: list[str]) -> tuple[int, int, int]:
    """(start, length, repeats) of the block of names repeated back to back over the most names (a decoder layer's
    kernels, or a hybrid stack's period of layers), the shortest such block; (0, 0, 0) when nothing repeats."""
    best = (0, 0, 0)
    for length in range(1, len(names) // 2 + 1):
        for start in range(len(names) - 2 * length + 1):
            block, repeats = names[start : start + length], 1
            while names[start + repeats * length : start + (repeats + 1) * length] == block:
                repeats += 1
            if repeats > 1 and repeats * length > best[1] * best[2]:
                best = (start, length, repeats)
    return best


def layer_table(steps: list[list[tuple[str, float]]]) -> pd.DataFrame:
    """One layer's kernels in launch order, each with its median time over every repeat of the block in every step
    (`steps`: ordered_kernels of each): what a kernel-name table sums away, e.g. which of a layer's three GEMVs is
    slow. Empty unless every step repeats the same block."""
    start, length, repeats = repeating_block([name for name, _ in steps[0]]) if steps else (0, 0, 0)
    block = [name for name, _ in steps[0][start : start + length]] if length else []
    if not block or any([n for n, _ in s[start : start + length]] != block for s in steps):
        return pd.DataFrame(columns=["kernel", "us", "us_min", "us_max"])
    times = pd.DataFrame(
        [(j, us) for s in steps for i in range(repeats) for j, (_, us) in enumerate(s[start + i * length :][:length])],
        columns=["position", "us"],
    )
    table = times.groupby("position")["us"].agg(us="median", us_min="min", us_max="max")
    table.insert(0, "kernel", block)
    table.attrs["repeats"], table.attrs["outside"] = repeats, len(steps[0]) - repeats * length
    return table.reset_index(drop=True)


def span_us(prof, cuda: bool = True) -> float:
    """From the first kernel's start to the last one's end (on the CPU: operators) in one profiled call. Below the
    step's wall time by what the GPU waits for the host (inputs, launches, reading the tokens back); kernels that
    overlap (programmatic dependent launch) count once."""
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    ranges = [e.time_range for e in prof.events() if e.device_type == kind]
    return max(r.end for r in ranges) - min(r.start for r in ranges) if ranges else 0.0


def profile(step, steps: int, batch: int, what: str, setup=None, layers: int = 1):
    """(summary dict, per-kernel DataFrame, layer_table) of `steps` calls of step() after a warm-up: the median step's
    wall time (tokens/s from it) with p90 and max, and the kernels of another `steps` calls under the profiler, with
    the median span from first kernel to last. setup() runs before each call, outside both the wall clock and the
    profiler."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])

    def loop(profiled: bool) -> tuple[list[float], list[pd.DataFrame], list[list[tuple[str, float]]]]:
        """Seconds per step (the wall clock; profiled: first kernel to last) and, profiled, the kernel tables and each
        step's kernels in order."""
        seconds, tables, ordered = [], [], []
        for _ in range(steps):
            if setup is not None:
                setup()
            sync()
            if profiled:
                with torch.profiler.profile(activities=activities) as prof:
                    step()
                    sync()
                tables.append(kernel_table(prof, cuda))
                ordered.append(ordered_kernels(prof, cuda))
                seconds.append(span_us(prof, cuda) / 1e6)
            else:
                t = time.perf_counter()
                step()
                sync()
                seconds.append(time.perf_counter() - t)
        return seconds, tables, ordered

    loop(False)  # warm-up: captures graphs, autotunes kernels
    walls = pd.Series(loop(False)[0])
    wall = walls.median()
    spans, tables, ordered = loop(True)
    kernels = pd.concat(tables).groupby("kernel", as_index=False)[["count", "us"]].sum()
    kernels["per_step"], kernels["us_per_step"] = kernels["count"] / steps, kernels["us"] / steps
    kernels["us_each"] = kernels["us"] / kernels["count"].clip(lower=1)
    kernels = kernels[["kernel", "per_step", "us_per_step", "us_each"]].sort_values(
        "us_per_step", ascending=False, ignore_index=True
    )
    summary = {
        "what": what,
        "batch": batch,
        "wall_us": wall * 1e6,  # the median step; its tail beside it
        "wall_p90_us": walls.quantile(0.9) * 1e6,
        "wall_max_us": walls.max() * 1e6,
        "gpu_span_us": pd.Series(spans).median() * 1e6,  # first kernel to last: wall_us above it is the host's
        "gpu_busy_us": kernels.us_per_step.sum(),
        "kernels_per_step": kernels.per_step.sum(),
        "kernels_per_layer": kernels.per_step.sum() / layers,  # the step's, head and sampling included
        "tokens_per_s": batch / wall,
    }
    return summary, kernels, layer_table(ordered)


def graph_us(graphs: StepGraphs, replays: int) -> tuple[float, float]:
    """The GPU time of the graph replayed last, alone: (the median of `replays` single replays from an idle GPU,
    the mean of `replays` back to back, where the GPU never waits for the host). A step's wall time beyond the
    first is its sampling, copies and the host's work. The replays rerun the same inputs: recurrent states move
    on, so the slots need a reset after."""
    assert graphs.last is not None, "no graph was replayed"
    graph = graphs.last.graph
    single = []
    for _ in range(replays):  # timed as profile() times a step: the host clock from one sync to the next
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        single.append(time.perf_counter() - t)

    def back_to_back() -> None:
        for _ in range(replays):
            graph.replay()

    return float(pd.Series(single).median() * 1e6), Clock("cuda").time(back_to_back) * 1e6 / replays


def prefilled(engine: QwenEngine, batch: int, prompt: int = 128, seed: int = 0) -> list[BatchedRequest]:
    """`batch` requests of `prompt` random tokens each, prefilled into slots 0.. of the engine, reset first."""
    gen = torch.Generator().manual_seed(seed)
    reqs = [BatchedRequest(i, random_tokens(prompt, engine.cfg.vocab_size, gen), slot_id=i) for i in range(batch)]
    engine.reset()
    engine.batch_prefill(reqs)
    return reqs


def decode_step(engine: QwenEngine, batch: int, prompt: int = 128, seed: int = 0):
    """One batch_decode_step over `batch` slots holding `prompt` tokens each."""
    reqs = prefilled(engine, batch, prompt, seed)
    return lambda: engine.batch_decode_step(reqs)


def prefill_call(engine: QwenEngine, length: int, seed: int = 0):
    """One prefill of `length` tokens into slot 0 (profile() resets the slot before each call)."""
    prompt = random_tokens(length, engine.cfg.vocab_size, torch.Generator().manual_seed(seed))
    return lambda: engine.prefill(prompt)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pocketlab.tools.profile", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda", help="cpu: operator tables instead of kernel tables")
    p.add_argument("--batch-sizes", type=ints, default=(1, 32))
    p.add_argument("--prefill-lens", type=ints, default=(512, 4096))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--engine-option", type=option, action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--host", type=int, default=0, help="N: each prefill's top N functions by own host time")
    p.add_argument("--ladder", action="store_true", help="graphed decode rows: ladder_*_us (tools.host_time)")
    a = p.parse_args(argv)
    cfg = BenchConfig(model=a.model, device=a.device, batch_sizes=a.batch_sizes, prompt_lens=a.prefill_lens, peer=False,
                      engine_options=dict(decode_ahead=False) | dict(a.engine_option))  # fmt: skip
    hf, engine = build(cfg)
    del hf
    prompts = f"; Gated DeltaNet prompts through {backend_name(a.device)}" if engine.cfg.is_hybrid else ""
    print(f"[{a.model} on {device_name(a.device)}{prompts}]")  # a profile without fla reads as one with it otherwise
    graphs, summaries = engine.graphs, []
    runs: list[tuple[str, int, bool | None]] = [
        (f"decode graphs={g}", b, g) for g in (True, False) for b in a.batch_sizes
    ]
    runs += [(f"prefill {n}", n, None) for n in a.prefill_lens]
    for what, n, use_graphs in runs:
        if use_graphs is not None:
            engine.graphs = graphs if use_graphs else None
            step = decode_step(engine, n)
            summary, kernels, layer = profile(step, a.steps, n, what, layers=engine.cfg.num_hidden_layers)
            if use_graphs and graphs is not None and graphs.last is not None and a.device == "cuda":
                summary["graph_once_us"], summary["graph_us"] = graph_us(graphs, a.steps)
                summary["beyond_graph_us"] = summary["wall_us"] - summary["graph_once_us"]
                timeline = step_timeline(decode_step(engine, n), a.steps, torch.cuda.synchronize)
                summary |= {f"host_{k}_us": v for k, v in timeline.items()}
                if a.ladder:
                    ladder = step_ladder(engine, prefilled(engine, n), a.steps, torch.cuda.synchronize)
                    summary |= {f"ladder_{k}_us": v for k, v in ladder.items()}
        else:
            summary, kernels, layer = profile(
                prefill_call(engine, n), max(a.steps // 4, 2), n, what, setup=lambda: engine.reset(0)
            )
        summaries.append(summary)
        print(
            f"\n[{a.model} {what} x{n}] "
            + ", ".join(f"{k}={v:.1f}" for k, v in summary.items() if isinstance(v, float))
        )
        print(kernels.head(a.top).to_string(index=False, float_format=lambda x: f"{x:.2f}"))
        if not use_graphs and len(layer):  # in a graph each kernel's time includes its wait for the one before
            print(f"one layer's kernels in launch order, us ({layer.attrs['repeats']} repeats; "
                  f"{layer.attrs['outside']} kernels outside them):")  # fmt: skip
            print(layer.head(40).to_string(float_format=lambda x: f"{x:.2f}"))  # a CPU layer's operators: hundreds
    print("\n" + pd.DataFrame(summaries).to_string(index=False, float_format=lambda x: f"{x:.1f}"))
    for n in a.prefill_lens if a.host else ():
        engine.reset(0)
        seconds, rows = profile_call(prefill_call(engine, n), a.host, key="own_s")
        print(f"\n[{a.model} prefill {n}: host time under cProfile, {seconds * 1e3:.1f} ms]")
        print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.4f}"))


if __name__ == "__main__":
    main()
