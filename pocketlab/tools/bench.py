"""Perf harness: ceilings, pocketlab prefill and decode, the HF peer and the roofline, in ONE run.

Why one run: every figure worth judging is a ratio against something measured alongside it (copy
bandwidth, matmul rate, HF transformers on the same weights), so drift between machines and runs cancels.

    python -m pocketlab.tools.bench --model qwen3-0.6b [--batch-sizes 1,4,16,32,64] [--prompt-lens 512,4096]
                              [--new-tokens 128] [--peer/--no-peer] [--out bench.json]

Writes all raw figures and derived ratios as JSON and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm import tqdm

from ..config import DTYPES
from ..engine import QwenEngine
from . import bench_engine
from .bench_engine import bench_decode, bench_prefill, build
from .bench_peer import bench_peer
from .bench_serving import Trace, bench_serving
from .bench_tables import print_tables
from .cli import ints, option
from .roofline import ModelCost, copy_bandwidth, matmul_rate
from .timing import Clock

SECTIONS = ("prefill", "decode", "latency", "serving", "peer")


@dataclass
class BenchConfig:
    model: str = "tiny-qwen3"
    device: str = "cpu"
    dtype: str = ""  # "" -> bfloat16 on cuda, float32 on cpu
    seed: int = 0
    batch_sizes: tuple[int, ...] = (1, 4, 16, 32, 64)
    prompt_lens: tuple[int, ...] = (512, 4096)
    new_tokens: int = 128  # decode steps timed per repeat; HF peer's new tokens
    decode_prompt: int = 128  # prompt prefilled in every slot before decode is timed
    ragged: int = 4  # prompts in the ragged batch_prefill
    repeats: int = 3
    warmup: int = 2
    peer: bool = True
    peer_modes: tuple[str, ...] = ("eager", "static")
    peer_batch_sizes: tuple[int, ...] = (1, 32)
    peer_eager_new_tokens: int = 0  # 0 -> new_tokens; cap for the slow eager peer (8B: 32)
    decode_repeats: int = 0  # 0 -> repeats; each gives new_tokens step samples
    peer_repeats: int = 0  # 0 -> decode_repeats; HF eager runs are long
    matmul_n: int = 0  # 0 -> 8192 on cuda, 512 on cpu
    copy_mib: int = 0  # 0 -> 1024 MiB per buffer on cuda, 64 on cpu
    prefill_chunk: int = 0  # 0 -> the engine's default
    cuda_graphs: bool = True
    engine_options: dict = field(default_factory=dict)  # any other EngineOptions field, e.g. decode_attention
    threads: int = 0  # CPU: torch intra-op threads for this run (0: leave as is)
    quantile: float = 0.5  # of the timing samples: median; 0.1 is steadier on a shared CPU
    warm: bool = True  # engine.warmup() before the timed tasks (first token is timed cold before it, warm after)
    latency_steps: int = 1000  # decode steps per latency run, from a short prompt across key buckets; 0: none
    latency_batch_sizes: tuple[int, ...] = (1, 32)
    serving_requests: int = 128  # requests in the end-to-end trace; 0: none
    serving_prompt: tuple[int, int] = (32, 512)  # prompt lengths, uniform in [lo, hi]
    serving_new: tuple[int, int] = (128, 512)  # new tokens per request, uniform in [lo, hi]
    serving_rate: float = 100.0  # requests per second (Poisson); 0: all at once
    skip: tuple[str, ...] = ()  # sections not to run (peer: the HF decode peers; --no-peer drops HF everywhere)
    progress: bool = True

    def __post_init__(self):
        cuda = self.device.startswith("cuda")
        self.dtype = self.dtype or ("bfloat16" if cuda else "float32")
        self.matmul_n = self.matmul_n or (8192 if cuda else 512)
        self.copy_mib = self.copy_mib or (1024 if cuda else 64)
        self.peer_eager_new_tokens = self.peer_eager_new_tokens or self.new_tokens
        self.decode_repeats = self.decode_repeats or self.repeats
        self.peer_repeats = self.peer_repeats or self.decode_repeats
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {list(DTYPES)}")
        if self.new_tokens < 2 or self.peer_eager_new_tokens < 2:
            raise ValueError("new tokens must be >= 2: peer decode speed is (N - 1) steps over t(N) - t(1)")
        bad = set(self.peer_modes) - {"eager", "static"}
        if bad:
            raise ValueError(f"unknown peer mode(s) {sorted(bad)}; use eager and/or static")
        if set(self.skip) - set(SECTIONS):
            raise ValueError(f"unknown section(s) {sorted(set(self.skip) - set(SECTIONS))} to skip; any of {SECTIONS}")

    @property
    def max_slots(self) -> int:
        return max((*self.batch_sizes, self.ragged, *self.latency_batch_sizes))

    @property
    def max_seq_len(self) -> int:
        decode = self.decode_prompt + self.warmup + self.new_tokens + 1  # + 1: MoE counts one more step's experts
        serving = self.serving_prompt[1] + self.serving_new[1]
        return max(max(self.prompt_lens, default=0), decode, 100 + self.latency_steps, serving) + 1


# -- one run -----------------------------------------------------------------------------------
def run(cfg: BenchConfig, out: Path | None = None) -> dict:
    """Every measurement, in one process. With `out`, the JSON is rewritten after each task
    ("complete": false until the end), so a run cut short by a time limit still leaves its figures."""
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)  # one thread: other processes cannot stall OpenMP barriers
    try:
        return _run(cfg, out)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: BenchConfig, out: Path | None) -> dict:
    clock = Clock(cfg.device, cfg.quantile)
    gen = torch.Generator().manual_seed(cfg.seed)
    hf, engine = build(cfg)
    cost = ModelCost.of(engine.cfg, torch.finfo(DTYPES[cfg.dtype]).bits // 8)
    result: dict[str, Any] = {
        "meta": meta(cfg, engine, hf),
        "complete": False,
        "ceilings": {},
        "model": asdict(cost),
        "start": {},
        "prefill": [],
        "decode": [],
        "latency": [],
        "serving": {},
        "peer": [],
        "ratios": {},
        "memory": {"after_build": device_memory(cfg)},
    }

    def ceilings():
        result["ceilings"] = {
            "copy": copy_bandwidth(clock, cfg.device, cfg.copy_mib, cfg.repeats),
            "matmul": matmul_rate(clock, cfg.device, DTYPES[cfg.dtype], cfg.matmul_n, cfg.repeats),
        }

    def prefill(lengths, kind):
        matmul = result["ceilings"]["matmul"]["flop_per_s"]
        result["prefill"].append(bench_prefill(engine, clock, cost, matmul, lengths, kind, cfg, gen))

    def decode(b):
        bandwidth = result["ceilings"]["copy"]["bytes_per_s"]
        result["decode"].append(bench_decode(engine, clock, cost, bandwidth, b, cfg, gen))

    def peer(mode, b):
        n = cfg.peer_eager_new_tokens if mode == "eager" else cfg.new_tokens
        try:
            result["peer"].append(bench_peer(hf, clock, mode, b, n, cfg, gen))
        except Exception as e:  # a peer that cannot run (e.g. static cache on a hybrid model) is reported, not fatal
            result["peer"].append(
                {"mode": mode, "batch": b, "new_tokens": n, "error": f"{type(e).__name__}: {e}"[:500]}
            )

    def latency(b):
        result["latency"].append(bench_engine.decode_latency(engine, cfg, b, gen))

    def serving():
        trace = Trace.random(
            cfg.serving_requests, cfg.serving_prompt, cfg.serving_new, cfg.serving_rate, engine.cfg.vocab_size, cfg.seed
        )
        result["serving"] = bench_serving(engine, hf, trace, cfg.peer)

    def start(name, fn):
        return lambda: result["start"].update({name: fn()})

    first_token = lambda: bench_engine.first_token(engine, clock, cfg, gen)  # noqa: E731
    tasks = [("first token, cold", start("first_token_cold", first_token))]
    if cfg.warm:
        tasks += [
            ("warm-up", start("warmup", lambda: bench_engine.warm_up(engine, cfg))),
            ("first token, warm", start("first_token_warm", first_token)),
        ]
    tasks += [("ceilings", ceilings)]
    for n in cfg.prompt_lens if "prefill" not in cfg.skip else ():
        ragged = [max(1, n * (cfg.ragged - i) // cfg.ragged) for i in range(cfg.ragged)]
        tasks += [
            (f"prefill {n}", lambda n=n: prefill([n], "single")),
            (f"ragged prefill {n}", lambda r=ragged: prefill(r, "ragged")),
        ]
    if "decode" not in cfg.skip:
        tasks += [(f"decode b{b}", lambda b=b: decode(b)) for b in cfg.batch_sizes]
    if cfg.latency_steps and "latency" not in cfg.skip:
        tasks += [(f"latency b{b}", lambda b=b: latency(b)) for b in cfg.latency_batch_sizes]
    if cfg.serving_requests and "serving" not in cfg.skip:
        tasks += [("serving", serving)]
    if cfg.peer and "peer" not in cfg.skip:
        tasks += [(f"HF {m} b{b}", lambda m=m, b=b: peer(m, b)) for m in cfg.peer_modes for b in cfg.peer_batch_sizes]
    with tqdm(tasks, desc=cfg.model, disable=not cfg.progress) as bar:
        for name, task in bar:
            bar.set_postfix_str(name)
            task()
            result["ratios"] = ratios(result)
            result["memory"]["after_last_task"] = device_memory(cfg)
            save(result, out)
    result["complete"] = True
    save(result, out)
    return result


def save(result: dict, out: Path | None) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))


def device_memory(cfg: BenchConfig) -> dict:
    """Bytes torch's allocator holds on the GPU now and at the run's peak so far (the CUDA context not counted): what
    an estimate of whether a shape fits is checked against. Nothing on the CPU."""
    if not cfg.device.startswith("cuda"):
        return {}
    return {"allocated": torch.cuda.memory_allocated(cfg.device), "peak": torch.cuda.max_memory_allocated(cfg.device)}


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's: timings compare only on the same card, so each table says which."""
    return torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else platform.processor() or "cpu"


def meta(cfg: BenchConfig, engine: QwenEngine, hf) -> dict:
    cuda = cfg.device.startswith("cuda")
    notes = [
        "copy bytes_per_s counts read + write; the decode roofline divides bytes moved by it",
        "prefill flops count causal attention pairs and last-token logits only (useful work)",
        "decode step times are a quantile of per-step samples, each the host time from one step's tokens to the next's "
        "(pocketlab: batch_decode_step called in a loop; HF: streamer stamps in generate's loop)",
        "HF tokens_per_s_subtract = batch * (N - 1) / (t(generate N new) - t(generate 1 new)), a cross-check",
    ]
    if cfg.peer_eager_new_tokens != cfg.new_tokens:
        notes.append(
            f"HF eager peer capped at {cfg.peer_eager_new_tokens} new tokens (slow); static peer uses {cfg.new_tokens}"
        )
    if "static" in cfg.peer_modes and not cuda:
        notes.append("HF static peer on CPU: static cache without compile (HF only auto-compiles on accelerators)")
    return {
        "config": asdict(cfg),
        "engine_options": {k: v for k, v in asdict(engine.options).items()},
        "device_name": device_name(cfg.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "hf_attn_implementation": getattr(hf.config, "_attn_implementation", None),
        # MoE: HF's routed-experts path (transformers 5 defaults to grouped_mm; eager loops over experts in Python)
        "hf_experts_implementation": getattr(hf.config, "_experts_implementation", None) if engine.cfg.is_moe else None,
        "threads": torch.get_num_threads(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "notes": notes,
    }


def ratios(result: dict) -> dict:
    """Derived figures: pocketlab over each HF peer per batch size, and how step time grows with batch."""
    out = {}
    ours = {d["batch"]: d for d in result["decode"]}
    for p in result["peer"]:
        if "error" not in p and p["batch"] in ours:
            out[f"pocketlab_over_hf_{p['mode']}_b{p['batch']}"] = ours[p["batch"]]["tokens_per_s"] / p["tokens_per_s"]
    if 1 in ours:
        for b, d in ours.items():
            if b != 1:
                out[f"step_b{b}_over_b1"] = d["step_s"] / ours[1]["step_s"]
    for d in result.get("latency", []):
        out[f"latency_max_over_p50_b{d['batch']}"] = d["max_over_p50"]
    for peer in ("hf", "hf_batches"):
        if f"pocketlab_over_{peer}" in result.get("serving", {}):
            out[f"serving_pocketlab_over_{peer}"] = result["serving"][f"pocketlab_over_{peer}"]
    return out


# -- CLI ---------------------------------------------------------------------------------------


def parse_args(argv=None) -> tuple[BenchConfig, Path]:
    p = argparse.ArgumentParser(prog="python -m pocketlab.tools.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-qwen3", help="preset from pocketlab.tools.synthetic.PRESETS")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="", help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-sizes", type=ints, default=(1, 4, 16, 32, 64))
    p.add_argument("--prompt-lens", type=ints, default=(512, 4096))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--decode-prompt", type=int, default=128)
    p.add_argument("--ragged", type=int, default=4, help="prompts in the ragged batch_prefill")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True, help="run the HF peer")
    p.add_argument("--peer-modes", type=lambda s: tuple(x for x in s.split(",") if x), default=("eager", "static"))
    p.add_argument("--peer-batch-sizes", type=ints, default=(1, 32))
    p.add_argument("--peer-eager-new-tokens", type=int, default=0, help="cap for the eager peer (0: --new-tokens)")
    p.add_argument("--decode-repeats", type=int, default=0, help="fresh prefills per decode figure (0: --repeats)")
    p.add_argument("--peer-repeats", type=int, default=0, help="timed HF generate calls (0: --decode-repeats)")
    p.add_argument("--matmul-n", type=int, default=0)
    p.add_argument("--copy-mib", type=int, default=0)
    p.add_argument("--prefill-chunk", type=int, default=0)
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="engine_options",
        help="any other EngineOptions field (Python literal or string), e.g. decode_attention=sdpa",
    )
    p.add_argument("--quantile", type=float, default=0.5, help="of the timing samples (0.1 on a shared CPU)")
    p.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (0: torch default)")
    p.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True, help="engine.warmup() first")
    p.add_argument("--latency-steps", type=int, default=1000, help="decode steps per latency run (0: none)")
    p.add_argument("--latency-batch-sizes", type=ints, default=(1, 32))
    p.add_argument("--serving-requests", type=int, default=128, help="requests in the serving trace (0: none)")
    p.add_argument("--serving-prompt", type=ints, default=(32, 512), help="prompt lengths lo,hi")
    p.add_argument("--serving-new", type=ints, default=(128, 512), help="new tokens lo,hi")
    p.add_argument("--serving-rate", type=float, default=100.0, help="arrivals per second (0: all at once)")
    p.add_argument("--skip", type=lambda s: tuple(x for x in s.split(",") if x), default=(), help=f"any of {SECTIONS}")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", type=Path, default=None, help="default: reports/bench/<device>-<model>.json")
    a = vars(p.parse_args(argv))
    a["engine_options"] = dict(option(kv) for kv in a["engine_options"])
    out = a.pop("out") or Path("reports/bench") / f"{a['device'].split(':')[0]}-{a['model']}.json"
    return BenchConfig(**a), out


def main(argv=None) -> dict:
    cfg, out = parse_args(argv)
    result = run(cfg, out)
    print_tables(result)
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
