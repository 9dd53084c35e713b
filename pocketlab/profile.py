"""Where one decode step's GPU time goes: a kernel table from torch.profiler, graphs on and off.

Why: decode at batch 1 is bound by kernel count and small-matmul efficiency, not FLOPs; the table
(kernels per step, GPU-busy vs wall time, the costliest kernels) says which of the two to attack.

    python -m pocketlab.profile --model qwen3-0.6b [--batch-sizes 1,32] [--steps 20] [--top 12]
"""
from __future__ import annotations

import argparse
import time

import pandas as pd
import torch
from torch.autograd import DeviceType

from .bench import BenchConfig, build, ints, random_tokens
from .engine import BatchedRequest, QwenEngine


def _device_us(event) -> float:
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def profile_decode(engine: QwenEngine, batch: int, steps: int, prompt: int = 128, seed: int = 0):
    """(summary dict, per-kernel DataFrame) over `steps` batch_decode_steps after a warm-up."""
    gen = torch.Generator().manual_seed(seed)
    reqs = [BatchedRequest(i, random_tokens(prompt, engine.cfg.vocab_size, gen), slot_id=i) for i in range(batch)]
    engine.reset()
    engine.batch_prefill(reqs)
    for _ in range(3):  # captures the graph of this bucket
        engine.batch_decode_step(reqs)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        engine.batch_decode_step(reqs)
    wall = (time.perf_counter() - t) / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.batch_decode_step(reqs)
    rows = [{"kernel": e.key[:90], "per_step": e.count / steps, "us_per_step": _device_us(e) / steps,
             "us_each": _device_us(e) / max(e.count, 1)}
            for e in prof.key_averages() if e.device_type == DeviceType.CUDA and _device_us(e) > 0]
    kernels = pd.DataFrame(rows).sort_values("us_per_step", ascending=False, ignore_index=True)
    summary = {"graphs": engine.graphs is not None, "batch": batch, "wall_us": wall * 1e6,
               "gpu_busy_us": kernels.us_per_step.sum(), "kernels_per_step": kernels.per_step.sum(),
               "tokens_per_s": batch / wall}
    return summary, kernels


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pocketlab.profile", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--batch-sizes", type=ints, default=(1, 32))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args(argv)
    cfg = BenchConfig(model=a.model, device="cuda", batch_sizes=a.batch_sizes, prompt_lens=(128,), peer=False)
    hf, engine = build(cfg)
    del hf
    graphs, summaries = engine.graphs, []
    for use_graphs in (True, False):
        engine.graphs = graphs if use_graphs else None
        for b in a.batch_sizes:
            summary, kernels = profile_decode(engine, b, a.steps)
            summaries.append(summary)
            print(f"\n[{a.model} b{b} graphs={use_graphs}] " + ", ".join(
                f"{k}={v:.1f}" for k, v in summary.items() if isinstance(v, float)))
            print(kernels.head(a.top).to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    print("\n" + pd.DataFrame(summaries).to_string(index=False, float_format=lambda x: f"{x:.1f}"))


if __name__ == "__main__":
    main()
