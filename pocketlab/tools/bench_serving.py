"""End-to-end serving: one trace of requests arriving over time, replayed through pocketlab's generate() loop and
through HF transformers' continuous batching on the same weights (or, for models it refuses, generate() over
arrival batches); output tokens per second of each.

The trace: ragged prompt lengths and new-token counts, Poisson arrivals. Every request runs to its new-token count
(no stop token), so both sides produce exactly the same number of tokens. Each side is warm before its clock
starts (ours: the bench's engine.warmup() task; HF: its manager's warm-up, or one short generate()); time counts
from the trace's start to the last token.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transformers

from .. import compile_events
from ..generate import stream_tokens
from ..sampling import SamplingParams


@dataclass
class Trace:
    prompts: list[list[int]]
    new_tokens: list[int]
    arrivals: list[float]  # seconds after the start, nondecreasing

    @classmethod
    def random(cls, n: int, prompt: tuple[int, int], new: tuple[int, int], rate: float, vocab: int, seed: int):
        """n requests: prompt lengths and new tokens uniform in [lo, hi], arrivals a Poisson process of `rate`/s."""
        rng = np.random.default_rng(seed)
        lengths = rng.integers(prompt[0], prompt[1] + 1, n)
        return cls(
            prompts=[rng.integers(0, vocab, int(m)).tolist() for m in lengths],
            new_tokens=rng.integers(new[0], new[1] + 1, n).tolist(),
            arrivals=np.cumsum(rng.exponential(1 / rate, n)).tolist() if rate > 0 else [0.0] * n,
        )

    def summary(self) -> dict:
        lengths = [len(p) for p in self.prompts]
        return {
            "requests": len(self.prompts),
            "prompt_tokens": [min(lengths), int(np.median(lengths)), max(lengths)],
            "new_tokens": [min(self.new_tokens), int(np.median(self.new_tokens)), max(self.new_tokens)],
            "output_tokens": sum(self.new_tokens),
            "arrival_span_s": self.arrivals[-1],
        }


def figures(trace: Trace, finished: dict, tokens: dict, seconds: float, first: dict | None = None) -> dict:
    """Throughput and per-request latency (finish - arrival) of one replay, and time to first token (first - arrival)
    where the replay saw first tokens; checks every request ran in full."""
    short = {i: tokens.get(i, 0) for i, n in enumerate(trace.new_tokens) if tokens.get(i, 0) != n}
    if short:
        raise RuntimeError(f"{len(short)} request(s) did not produce their new tokens, e.g. {list(short.items())[:3]}")
    out = {"seconds": seconds, "output_tokens_per_s": sum(trace.new_tokens) / seconds}
    for name, at in (("latency", finished), ("ttft", first)):
        if at is not None:
            waited = [at[i] - a for i, a in enumerate(trace.arrivals)]
            out |= {f"{name}_p50_s": float(np.median(waited)), f"{name}_p99_s": float(np.quantile(waited, 0.99))}
    return out


def serve_pocketlab(engine, trace: Trace) -> dict:
    """The trace through generate()'s loop (stream_tokens, so each request's finish time is seen)."""
    sampling = [SamplingParams(max_new_tokens=n) for n in trace.new_tokens]
    finished: dict[int, float]
    tokens: dict[int, int]
    first: dict[int, float]
    finished, tokens, first = {}, {}, {}
    before = engine.compile_events()
    start = time.perf_counter()
    for step in stream_tokens(engine, trace.prompts, sampling, arrivals=trace.arrivals):
        tokens[step.index] = tokens.get(step.index, 0) + len(step.tokens)
        first.setdefault(step.index, time.perf_counter() - start)
        if step.finished:
            finished[step.index] = time.perf_counter() - start
    out = figures(trace, finished, tokens, time.perf_counter() - start, first)
    return out | {"events": compile_events.since(before, engine.graphs)}


def _hf_manager_options(hf, gc, trace: Trace) -> dict:
    """Keyword arguments for HF's continuous-batching context manager: a paged cache that holds the whole trace
    at once and batches of at most the trace's tokens (its defaults take 90% of the free memory: 75 GB of an H100
    for a tiny model, so an engine beside it ran out), in whichever spelling this transformers version has."""
    accepted = inspect.signature(hf.continuous_batching_context_manager).parameters
    opts = {"generation_config": gc, "timeout": 5}
    if "workload_hints" in accepted:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        longest = max(len(p) for p in trace.prompts)
        opts["workload_hints"] = WorkloadHints(
            max_prompt_length=longest, max_generated_length=max(trace.new_tokens), num_requests=len(trace.prompts)
        )
    config: Any = getattr(transformers, "ContinuousBatchingConfig", None)
    fields = inspect.signature(config).parameters if config is not None else {}
    size = next((name for name in ("page_size", "block_size") if name in fields), None)
    page = 256
    blocks = sum(-(-(len(p) + n) // page) for p, n in zip(trace.prompts, trace.new_tokens, strict=True))
    if size and "num_blocks" in fields and "continuous_batching_config" in accepted:
        sizes = {size: page, "num_blocks": blocks}
        if "max_batch_tokens" in fields:  # no batch holds more than every prompt and one token a request
            sizes["max_batch_tokens"] = sum(len(p) + 1 for p in trace.prompts)
        opts["continuous_batching_config"] = config(**sizes)
    else:  # older versions read the cache size from the generation config
        gc.num_blocks, gc.block_size = blocks, page
    return opts


def serve_hf(hf, trace: Trace, timeout_s: float = 600.0) -> dict:
    """The trace through transformers' continuous batching manager (add_request as each request arrives)."""
    gc = transformers.GenerationConfig(do_sample=False, max_new_tokens=max(trace.new_tokens), pad_token_id=0)
    attention = hf.config._attn_implementation
    try:
        return _serve_hf(hf, trace, timeout_s, gc)
    finally:  # the manager switches the model to paged attention; a refusal may leave it so
        hf.set_attn_implementation(attention)


def _serve_hf(hf, trace: Trace, timeout_s: float, gc) -> dict:
    finished: dict[int, float]
    tokens: dict[int, int]
    finished, tokens, submitted = {}, {}, 0
    with hf.continuous_batching_context_manager(**_hf_manager_options(hf, gc, trace)) as manager:
        start = time.perf_counter()
        while len(finished) < len(trace.prompts):
            now = time.perf_counter() - start
            if now > timeout_s:
                raise TimeoutError(f"HF continuous batching finished {len(finished)} requests in {timeout_s} s")
            while submitted < len(trace.prompts) and trace.arrivals[submitted] <= now:
                n = trace.new_tokens[submitted]
                manager.add_request(trace.prompts[submitted], str(submitted), max_new_tokens=n, eos_token_id=-1)
                submitted += 1
            wait = trace.arrivals[submitted] - now if submitted < len(trace.prompts) else 1.0
            result = manager.get_result(timeout=min(max(wait, 1e-3), 1.0))
            if result is not None and result.is_finished():
                finished[int(result.request_id)] = time.perf_counter() - start
                tokens[int(result.request_id)] = len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("HF's continuous batching thread stopped")
        seconds = time.perf_counter() - start
    return figures(trace, finished, tokens, seconds)


def serve_hf_batches(hf, trace: Trace, timeout_s: float = 600.0) -> dict:
    """The trace through HF's generate() without continuous batching, HF's best for models its manager refuses
    (the hybrid Qwen3.5): whenever the model is free, every request that has arrived goes in one left-padded
    batch, run to the batch's longest new-token count; each request finishes with its batch. A two-request batch
    of a few tokens runs first, off the clock: HF's kernels compile and autotune there (fla's, for the hybrid)."""
    device = next(hf.parameters()).device

    def generate(ids: torch.Tensor, mask: torch.Tensor, new: int) -> torch.Tensor:
        gc = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=new)
        return hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gc)

    warm = torch.tensor([trace.prompts[0][:16]] * 2)
    generate(warm, torch.ones_like(warm), 4)
    finished, tokens, done = {}, {}, 0
    start = time.perf_counter()
    while done < len(trace.prompts):
        now = time.perf_counter() - start
        if now > timeout_s:
            raise TimeoutError(f"HF generate() finished {done} requests in {timeout_s} s")
        if trace.arrivals[done] > now:
            time.sleep(trace.arrivals[done] - now)
            now = time.perf_counter() - start
        batch = [i for i in range(done, len(trace.prompts)) if trace.arrivals[i] <= now]
        width = max(len(trace.prompts[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):
            ids[row, width - len(trace.prompts[i]) :] = torch.tensor(trace.prompts[i])
            mask[row, width - len(trace.prompts[i]) :] = 1
        generated = generate(ids, mask, max(trace.new_tokens[i] for i in batch))
        end = time.perf_counter() - start
        for i in batch:  # each request gets what it asked for; the batch's longer rows were padding work
            finished[i], tokens[i] = end, min(generated.shape[1] - width, trace.new_tokens[i])
        done += len(batch)
    return figures(trace, finished, tokens, time.perf_counter() - start)


def bench_serving(engine, hf, trace: Trace, peer: bool) -> dict:
    """Both replays of one trace, ours first (HF's manager then sizes its paged cache from what is left). Where
    HF's continuous batching refuses the model, HF's peer is generate() over arrival batches."""
    out = {"trace": trace.summary(), "pocketlab": serve_pocketlab(engine, trace)}
    if not peer:
        return out
    ours = out["pocketlab"]["output_tokens_per_s"]
    try:
        out["hf"] = serve_hf(hf, trace)
        out["pocketlab_over_hf"] = ours / out["hf"]["output_tokens_per_s"]
    except Exception as e:  # e.g. a model HF's continuous batching does not serve: reported, not fatal
        out["hf"] = {"error": f"{type(e).__name__}: {e}"[:500]}
        try:
            out["hf_batches"] = serve_hf_batches(hf, trace)
            out["pocketlab_over_hf_batches"] = ours / out["hf_batches"]["output_tokens_per_s"]
        except Exception as e:
            out["hf_batches"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    return out
