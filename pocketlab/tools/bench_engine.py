"""pocketlab's side of the bench: the engine over the HF model's own tensors, prefill and decode timed."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import compile_events
from ..config import DTYPES
from ..engine import QwenEngine
from ..layers import moe
from ..requests import BatchedRequest
from .roofline import ModelCost
from .synthetic import build_hf_model
from .timing import Clock

if TYPE_CHECKING:
    from .bench import BenchConfig


def build(cfg: BenchConfig):
    """The random-weight HF model on the device, and a pocketlab engine over the very same tensors (only its fused
    projections are its own), so the weights are on the device once: at the MoE shapes two copies do not fit."""
    hf = build_hf_model(cfg.model, cfg.seed, cfg.device, DTYPES[cfg.dtype])
    return hf, engine_over(hf, cfg)


def engine_over(hf, cfg: BenchConfig, package=None) -> QwenEngine:
    """A pocketlab engine with cfg's options over the tensors of `hf` (build's HF model); `package`: another copy of
    the pocketlab package whose engine to build instead (tools.ab's tree variants: an earlier revision's)."""
    pkg = package or importlib.import_module(__package__.split(".")[0])  # this copy's own package
    mcfg = pkg.ModelConfig.from_dict(hf.config.to_dict())
    weights = dict(hf.state_dict())
    if mcfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # HF's state_dict lists the tied table twice
    extra = dict(cfg.engine_options, **({"prefill_chunk": cfg.prefill_chunk} if cfg.prefill_chunk else {}))
    opts = pkg.EngineOptions(
        max_slots=cfg.max_slots,
        max_seq_len=cfg.max_seq_len,
        device=cfg.device,
        dtype=cfg.dtype,
        cuda_graphs=cfg.cuda_graphs,
        **extra,
    )
    return pkg.QwenEngine(mcfg, weights, opts)


def random_tokens(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


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
    run: Callable[[], object]
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


def experts_read(engine: QwenEngine, reqs: list[BatchedRequest]) -> int:
    """The (layer, expert) pairs one more decode step of `reqs` routes to, counted in an eager step (a replayed
    graph runs no Python): the routed-expert bytes of the measured steps' roofline. Filler rows of a padded graph
    batch are not counted: they are not the model's cost."""
    graphs, engine.graphs = engine.graphs, None
    try:
        with moe.record_routing() as log:
            engine.batch_decode_step(reqs)
    finally:
        engine.graphs = graphs
    return sum(int(ids.unique().numel()) for ids in log)


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
    all repeats x new_tokens step samples, each the host time from one call's return to the next's (the engine
    returns host tokens; a step it launched ahead runs on between calls), as HF's steps are timed.
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
        samples += clock.calls(step_fn, cfg.new_tokens)
    step = clock.pick(samples)
    # The step appending token i (0-based, after warm-up) attends over prompt + warmup + i + 1 positions.
    mean_kv = cfg.decode_prompt + cfg.warmup + 1 + (cfg.new_tokens - 1) / 2
    moved = cost.decode_bytes([mean_kv] * batch, experts_read(engine, reqs) if cost.moe_layers else None)
    # Roofline: every byte the step must move, at the copy rate measured in this run. The copy figure
    # counts read + write bytes, so it is already "bytes moved per second" whatever their direction.
    roofline = moved["total_bytes"] / bandwidth
    return {
        "batch": batch,
        "step_s": step,
        "step_p90_s": float(np.quantile(samples, 0.9)),  # the tail beside the median
        "tokens_per_s": batch / step,
        "mean_kv_len": mean_kv,
        **moved,
        "roofline_step_s": roofline,
        "roofline_frac": roofline / step,
    }


def first_token(engine: QwenEngine, clock: Clock, cfg: BenchConfig, gen: torch.Generator) -> dict:
    """Time to first token (a decode_prompt-token prefill, then one decode step) on the engine as it is, what
    compiled or captured during it, and the slot reset after."""
    prompt = random_tokens(cfg.decode_prompt, engine.cfg.vocab_size, gen)
    before = engine.compile_events()

    def call():
        engine.decode_step(engine.prefill(prompt, slot_id=0).next_token, slot_id=0)

    seconds = clock.time(call)
    engine.reset()
    return {"prompt_len": cfg.decode_prompt, "seconds": seconds, "events": compile_events.since(before, engine.graphs)}


def warm_up(engine: QwenEngine, cfg: BenchConfig) -> dict:
    report = engine.warmup(progress=cfg.progress)
    return {"seconds": report.seconds, "graphs": report.graphs, "failed": report.failed, "events": report.events}


def decode_latency(engine: QwenEngine, cfg: BenchConfig, batch: int, gen: torch.Generator) -> dict:
    """Per-step wall time through the public API over latency_steps batch_decode_steps from a short prompt, so
    the keys cross several graph buckets: percentiles, the worst step, and anything compiled on the way."""
    prompt_len = min(cfg.decode_prompt, 100)
    reqs = [BatchedRequest(i, random_tokens(prompt_len, engine.cfg.vocab_size, gen), slot_id=i) for i in range(batch)]
    engine.reset()
    engine.batch_prefill(reqs)
    before, samples = engine.compile_events(), []
    for _ in range(cfg.latency_steps):
        t = time.perf_counter()
        engine.batch_decode_step(reqs)  # returns host tokens: the step has finished on the device
        samples.append(time.perf_counter() - t)
    engine.reset()
    p50, p90, p99 = np.quantile(samples, [0.5, 0.9, 0.99])
    return {
        "batch": batch,
        "steps": len(samples),
        "positions": [prompt_len, prompt_len + len(samples)],
        "p50_s": float(p50),
        "p90_s": float(p90),
        "p99_s": float(p99),
        "max_s": max(samples),
        "max_over_p50": max(samples) / float(p50),
        "events": compile_events.since(before, engine.graphs),
        "samples_s": samples,
    }
