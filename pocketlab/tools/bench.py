"""Perf harness: ceilings, pocketlab prefill and decode, the HF peer and the roofline, in ONE run.

Why one run: every figure worth judging is a ratio against something measured alongside it (copy
bandwidth, matmul rate, HF transformers on the same weights), so drift between machines and runs cancels.

    python -m pocketlab.bench --model qwen3-0.6b [--batch-sizes 1,4,16,32,64] [--prompt-lens 512,4096]
                              [--new-tokens 128] [--peer/--no-peer] [--out bench.json]

Writes all raw figures and derived ratios as JSON and prints the tables.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import transformers
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

from .config import DTYPES, EngineOptions, ModelConfig
from .engine import QwenEngine
from .loader import expected_shapes
from .requests import BatchedRequest
from .synthetic import build_hf_model


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

    @property
    def max_slots(self) -> int:
        return max(max(self.batch_sizes), self.ragged)

    @property
    def max_seq_len(self) -> int:
        return max(max(self.prompt_lens), self.decode_prompt + self.warmup + self.new_tokens) + 1


# -- timing ------------------------------------------------------------------------------------
class Clock:
    """Seconds taken by fn(): CUDA events on a GPU (synchronised around the call), perf_counter on CPU.

    Figures are a quantile of many samples: the median by default; a low quantile (0.1) on a shared CPU,
    where other processes only ever add time, so the fast samples are the steady ones.
    """

    def __init__(self, device: str, quantile: float = 0.5):
        self.cuda, self.quantile = device.startswith("cuda"), quantile

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn, setup=None) -> float:
        if setup is not None:
            setup()
        self.sync()
        if not self.cuda:
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def pick(self, samples: list[float]) -> float:
        return float(np.quantile(samples, self.quantile))

    def measure(self, fn, repeats: int, warmup: int, setup=None) -> float:
        """`warmup` untimed calls, then the chosen quantile of `repeats` timings; `setup` runs untimed first."""
        for _ in range(warmup):
            if setup is not None:
                setup()
            fn()
        return self.pick([self.time(fn, setup) for _ in range(max(repeats, 1))])


# -- ceilings ----------------------------------------------------------------------------------
@torch.inference_mode()
def copy_bandwidth(clock: Clock, device: str, mib: int, repeats: int) -> dict:
    """Device-to-device copy. bytes_per_s counts bytes read + bytes written, i.e. every byte moved."""
    n = mib * 2**20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = clock.measure(lambda: dst.copy_(src), repeats=max(repeats, 10), warmup=3)
    return {"buffer_bytes": n, "seconds": seconds, "bytes_per_s": 2 * n / seconds}


@torch.inference_mode()
def matmul_rate(clock: Clock, device: str, dtype: torch.dtype, n: int, repeats: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    c = torch.empty_like(a)
    seconds = clock.measure(lambda: torch.mm(a, b, out=c), repeats=max(repeats, 10), warmup=3)
    return {"n": n, "seconds": seconds, "flop_per_s": 2 * n**3 / seconds}


# -- what the model must read and compute --------------------------------------------------------
@dataclass
class ModelCost:
    """Bytes and flops implied by the model shape (never by the implementation)."""

    layer_matmul_params: int  # 2-D weights inside the decoder layers
    head_params: int  # lm_head (vocab x hidden)
    weight_bytes: int  # read once per decode step: all weights except the embedding table
    kv_bytes_per_token: int  # K + V of one position over all full-attention layers
    state_bytes_per_seq: int  # recurrent + conv state of one sequence over all linear layers
    attn_flops_per_pair: int  # one (query, key) pair over all full-attention layers: QK^T + PV
    linear_flops_per_token: int  # Gated DeltaNet state update + readout over all linear layers

    @classmethod
    def of(cls, cfg: ModelConfig, elem_bytes: int) -> ModelCost:
        shapes = {n: s for n, s in expected_shapes(cfg).items() if not n.startswith("mtp.")}
        layer_matmul = sum(math.prod(s) for n, s in shapes.items() if n.startswith("model.layers.") and len(s) == 2)
        head = cfg.vocab_size * cfg.hidden_size
        # The embedding table is only gathered (B rows per step); a tied table is read in full as the lm_head.
        weight_elems = sum(math.prod(s) for n, s in shapes.items() if n != "model.embed_tokens.weight")
        weight_elems += head if cfg.tie_word_embeddings else 0
        n_attn, n_lin = len(cfg.attention_layers), len(cfg.linear_layers)
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_dim = 2 * cfg.linear_num_key_heads * dk + hv * dv
        return cls(
            layer_matmul_params=layer_matmul,
            head_params=head,
            weight_bytes=weight_elems * elem_bytes,
            kv_bytes_per_token=n_attn * 2 * cfg.num_key_value_heads * cfg.head_dim * elem_bytes,
            state_bytes_per_seq=n_lin * (hv * dk * dv * 4 + conv_dim * (cfg.linear_conv_kernel_dim - 1) * elem_bytes),
            attn_flops_per_pair=n_attn * 4 * cfg.num_attention_heads * cfg.head_dim,
            # per token and value head: decay, S^T k, k (x) delta, S^T q ~ three dk x dv products (6 flops/elem)
            linear_flops_per_token=n_lin * 6 * hv * dk * dv,
        )

    def prefill_flops(self, length: int) -> int:
        """Useful flops of prefilling one sequence from empty: causal pairs only, logits for the last token."""
        return (
            2 * self.layer_matmul_params * length
            + 2 * self.head_params
            + self.attn_flops_per_pair * length * (length + 1) // 2
            + self.linear_flops_per_token * length
        )

    def decode_bytes(self, kv_lens: list[int]) -> dict:
        """Minimum bytes one decode step moves, for sequences attending over `kv_lens` positions.

        Weights and K/V are read once; the recurrent state is read AND written (it is rewritten each step).
        """
        kv = self.kv_bytes_per_token * sum(kv_lens)
        state = 2 * self.state_bytes_per_seq * len(kv_lens)
        return {
            "weight_bytes": self.weight_bytes,
            "kv_bytes": kv,
            "state_bytes": state,
            "total_bytes": self.weight_bytes + kv + state,
        }


# -- building --------------------------------------------------------------------------------
def build(cfg: BenchConfig):
    """The random-weight HF model on the device, and a pocketlab engine over the very same tensors."""
    hf = build_hf_model(cfg.model, cfg.seed, cfg.device, DTYPES[cfg.dtype])
    mcfg = ModelConfig.from_dict(hf.config.to_dict())
    weights = dict(hf.state_dict())
    if mcfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # HF's state_dict lists the tied table twice
    extra = dict(cfg.engine_options, **({"prefill_chunk": cfg.prefill_chunk} if cfg.prefill_chunk else {}))
    opts = EngineOptions(
        max_slots=cfg.max_slots,
        max_seq_len=cfg.max_seq_len,
        device=cfg.device,
        dtype=cfg.dtype,
        cuda_graphs=cfg.cuda_graphs,
        **extra,
    )
    return hf, QwenEngine(mcfg, weights, opts)


def random_tokens(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


# -- pocketlab ---------------------------------------------------------------------------------
def bench_prefill(
    engine: QwenEngine,
    clock: Clock,
    cost: ModelCost,
    matmul: float,
    lengths: list[int],
    kind: str,
    cfg: BenchConfig,
    gen: torch.Generator,
) -> dict:
    """One prompt through engine.prefill, or several through ONE ragged batch_prefill."""
    prompts = [random_tokens(n, engine.cfg.vocab_size, gen) for n in lengths]
    if kind == "single":
        run = lambda: engine.prefill(prompts[0], slot_id=0)  # noqa: E731
    else:
        reqs = [BatchedRequest(i, p, slot_id=i) for i, p in enumerate(prompts)]
        run = lambda: engine.batch_prefill(reqs)  # noqa: E731
    seconds = clock.measure(run, cfg.repeats, cfg.warmup, setup=engine.reset)  # reset: no prefix reuse
    tokens, flops = sum(lengths), sum(cost.prefill_flops(n) for n in lengths)
    return {
        "kind": kind,
        "prompt_len": max(lengths),
        "lengths": lengths,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "flop_per_s": flops / seconds,
        "matmul_frac": flops / seconds / matmul,
    }


def bench_decode(
    engine: QwenEngine,
    clock: Clock,
    cost: ModelCost,
    bandwidth: float,
    batch: int,
    cfg: BenchConfig,
    gen: torch.Generator,
) -> dict:
    """`batch` slots prefilled with `decode_prompt` tokens, then `new_tokens` batch_decode_steps, each timed.

    Every repeat starts from a fresh prefill so all repeats decode over the same positions; warm-up steps
    (which may capture CUDA graphs) run before the clock starts. The step time is the chosen quantile of
    all repeats x new_tokens step samples (each step is synchronised: the engine returns host tokens).
    """
    reqs = [
        BatchedRequest(i, random_tokens(cfg.decode_prompt, engine.cfg.vocab_size, gen), slot_id=i) for i in range(batch)
    ]
    step_fn = lambda: engine.batch_decode_step(reqs)  # noqa: E731
    samples = []
    for _ in range(cfg.decode_repeats):
        engine.reset()
        engine.batch_prefill(reqs)
        for _ in range(cfg.warmup):
            step_fn()
        samples += [clock.time(step_fn) for _ in range(cfg.new_tokens)]
    step = clock.pick(samples)
    # The step appending token i (0-based, after warm-up) attends over prompt + warmup + i + 1 positions.
    mean_kv = cfg.decode_prompt + cfg.warmup + 1 + (cfg.new_tokens - 1) / 2
    moved = cost.decode_bytes([mean_kv] * batch)
    # Roofline: every byte the step must move, at the copy rate measured in this run. The copy figure
    # counts read + write bytes, so it is already "bytes moved per second" whatever their direction.
    roofline = moved["total_bytes"] / bandwidth
    return {
        "batch": batch,
        "step_s": step,
        "tokens_per_s": batch / step,
        "mean_kv_len": mean_kv,
        **moved,
        "roofline_step_s": roofline,
        "roofline_frac": roofline / step,
    }


# -- HF peer -----------------------------------------------------------------------------------
class StepStamps(BaseStreamer):
    """Host time at each `put`. HF copies every new token to the host before handing it over (a device
    sync), so the gap between two stamps is one whole step of HF's generate loop, as it runs."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def decode_steps(self) -> list[float]:
        """The first put is the prompt and the second follows the prefill; every later gap is a decode step."""
        return np.diff(self.stamps)[1:].tolist()


def bench_peer(
    hf, clock: Clock, mode: str, batch: int, new_tokens: int, cfg: BenchConfig, gen: torch.Generator
) -> dict:
    """HF `generate` on the same weights, greedy, fixed length (min_new_tokens = max_new_tokens).

    Decode speed comes from per-step stamps (the quantile of the step samples, as for pocketlab), so it
    needs no prefill correction and a shared CPU cannot skew it. Cross-check in `tokens_per_s_subtract`:
    (N - 1) steps over t(generate N new) - t(generate 1 new), which cancels the prefill and generate's
    fixed setup. With the static cache on CUDA, HF compiles the decode step; the untimed warm-up pays it.
    """
    ids = torch.randint(0, hf.config.vocab_size, (batch, cfg.decode_prompt), generator=gen).to(cfg.device)
    mask = torch.ones_like(ids)
    cache = "static" if mode == "static" else None

    def generate(n: int, streamer=None):
        gc = transformers.GenerationConfig(
            do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, cache_implementation=cache
        )
        out = hf.generate(ids, attention_mask=mask, generation_config=gc, streamer=streamer)
        if out.shape[1] != cfg.decode_prompt + n:
            raise RuntimeError(f"HF generate made {out.shape[1] - cfg.decode_prompt} tokens, asked for {n}")

    generate(new_tokens if mode == "static" else min(new_tokens, 4))  # warm-up; the static one compiles
    steps, full = [], []
    for _ in range(cfg.peer_repeats):
        stamps = StepStamps()
        full.append(clock.time(lambda: generate(new_tokens, stamps)))
        steps += stamps.decode_steps()
    one = clock.measure(lambda: generate(1), cfg.peer_repeats, warmup=1)
    step = clock.pick(steps)
    return {
        "mode": mode,
        "batch": batch,
        "new_tokens": new_tokens,
        "compiled": mode == "static" and clock.cuda,
        "seconds_full": clock.pick(full),
        "seconds_one": one,
        "step_s": step,
        "tokens_per_s": batch / step,
        "tokens_per_s_subtract": batch * (new_tokens - 1) / max(clock.pick(full) - one, 1e-9),
    }


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
    result = {
        "meta": meta(cfg, engine, hf),
        "complete": False,
        "ceilings": {},
        "model": asdict(cost),
        "prefill": [],
        "decode": [],
        "peer": [],
        "ratios": {},
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

    tasks = [("ceilings", ceilings)]
    for n in cfg.prompt_lens:
        ragged = [max(1, n * (cfg.ragged - i) // cfg.ragged) for i in range(cfg.ragged)]
        tasks += [
            (f"prefill {n}", lambda n=n: prefill([n], "single")),
            (f"ragged prefill {n}", lambda r=ragged: prefill(r, "ragged")),
        ]
    tasks += [(f"decode b{b}", lambda b=b: decode(b)) for b in cfg.batch_sizes]
    if cfg.peer:
        tasks += [(f"HF {m} b{b}", lambda m=m, b=b: peer(m, b)) for m in cfg.peer_modes for b in cfg.peer_batch_sizes]
    with tqdm(tasks, desc=cfg.model, disable=not cfg.progress) as bar:
        for name, task in bar:
            bar.set_postfix_str(name)
            task()
            result["ratios"] = ratios(result)
            save(result, out)
    result["complete"] = True
    save(result, out)
    return result


def save(result: dict, out: Path | None) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))


def meta(cfg: BenchConfig, engine: QwenEngine, hf) -> dict:
    cuda = cfg.device.startswith("cuda")
    notes = [
        "copy bytes_per_s counts read + write; the decode roofline divides bytes moved by it",
        "prefill flops count causal attention pairs and last-token logits only (useful work)",
        "decode step times are a quantile of per-step samples (pocketlab: timed steps; HF: streamer stamps)",
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
        "device_name": torch.cuda.get_device_name(cfg.device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "hf_attn_implementation": getattr(hf.config, "_attn_implementation", None),
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
    return out


# -- display -----------------------------------------------------------------------------------
def tables(result: dict) -> dict[str, pd.DataFrame]:
    """The result as DataFrames: ceilings, prefill, decode (with the peers beside it), ratios."""
    c = result["ceilings"]
    ceilings = pd.DataFrame(
        [
            {
                "copy GB/s (r+w)": c["copy"]["bytes_per_s"] / 1e9,
                "matmul TFLOP/s": c["matmul"]["flop_per_s"] / 1e12,
                "matmul n": c["matmul"]["n"],
            }
        ]
    )
    prefill = pd.DataFrame(
        [
            {
                "kind": p["kind"],
                "prompt_len": p["prompt_len"],
                "tokens": p["tokens"],
                "ms": p["seconds"] * 1e3,
                "tokens/s": p["tokens_per_s"],
                "TFLOP/s": p["flop_per_s"] / 1e12,
                "of matmul": p["matmul_frac"],
            }
            for p in result["prefill"]
        ]
    )
    decode = pd.DataFrame(
        [
            {
                "batch": d["batch"],
                "step ms": d["step_s"] * 1e3,
                "tokens/s": d["tokens_per_s"],
                "roofline ms": d["roofline_step_s"] * 1e3,
                "roofline frac": d["roofline_frac"],
            }
            for d in result["decode"]
        ]
    )
    peers = pd.DataFrame(
        [
            {
                "mode": p["mode"],
                "batch": p["batch"],
                "new_tokens": p["new_tokens"],
                "tokens/s": p.get("tokens_per_s", float("nan")),
                "error": p.get("error", ""),
            }
            for p in result["peer"]
        ],
        columns=["mode", "batch", "new_tokens", "tokens/s", "error"],
    )
    for mode in sorted(set(peers["mode"])):
        rates = peers[peers["mode"] == mode].set_index("batch")["tokens/s"]
        decode[f"HF {mode} tokens/s"] = decode["batch"].map(rates)
        decode[f"vs HF {mode}"] = decode["tokens/s"] / decode[f"HF {mode} tokens/s"]
    ratio = pd.DataFrame(sorted(result["ratios"].items()), columns=["ratio", "value"])
    return {"ceilings": ceilings, "prefill": prefill, "decode": decode, "peer": peers, "ratios": ratio}


def print_tables(result: dict) -> None:
    m = result["meta"]
    print(
        f"\n{m['config']['model']} on {m['device_name']} ({m['config']['dtype']}, torch {m['torch']}, "
        f"transformers {m['transformers']})"
    )
    with pd.option_context("display.width", 160, "display.max_columns", 20, "display.float_format", "{:.4g}".format):
        for name, df in tables(result).items():
            if len(df):
                print(f"\n[{name}]\n{df.to_string(index=False)}")


# -- CLI ---------------------------------------------------------------------------------------
def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def option(text: str) -> tuple[str, object]:
    """KEY=VALUE from the command line; VALUE as a Python literal where it parses, else the string."""
    key, _, value = text.partition("=")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def parse_args(argv=None) -> tuple[BenchConfig, Path]:
    p = argparse.ArgumentParser(prog="python -m pocketlab.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-qwen3", help="preset from pocketlab.synthetic.PRESETS")
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
