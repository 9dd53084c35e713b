"""Warm-up: everything an engine's options let a call compile or capture, done before the first request.

The graphs follow the options: one per (step, batch bucket, key bucket), the batch buckets being
graph_batch_sizes up to max_slots and the key buckets powers of two up to max_seq_len (graphs.key_buckets); with
prefill_graph_tokens also one per token bucket of prompt forwards; with speculation also the verify and draft
steps. Other prompts run eagerly; their kernels specialise on a few properties of a shape (one row or several,
one token or more, a length that is a multiple of 16 or not, a cached prefix or none, a full prefill chunk), so
a handful of prompts covering them compiles every variant. The counts in compile_events say whether anything
was left over.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from tqdm.auto import tqdm

from . import compile_events
from .layers import fused
from .requests import BatchedRequest

if TYPE_CHECKING:
    from .engine import QwenEngine
    from .graphs import StepGraphs


@dataclass
class WarmupReport:
    graphs: int  # graph keys warmed (each of graph_steps once)
    failed: int  # of those, captures that failed (their steps run eagerly)
    prompts: int  # warm-up prompt calls
    seconds: float
    events: dict  # compile_events.since over the warm-up


def graph_steps(engine: QwenEngine) -> list[tuple]:
    """(key, step, after) for every graph the engine's calls can replay."""
    if engine.graphs is None:
        return []
    steps = [("decode", 1, 0, engine.graphs._decode, None)]
    if engine.speculator is not None:
        steps += engine.speculator.graph_steps()
    keys = [(key, step, after) for name, T, beyond, step, after in steps for key in engine.graphs.keys(name, T, beyond)]
    if engine.decodes_ahead:  # a hybrid's steps launched ahead replay graphs of their own
        keys += [(key, engine.graphs._decode_aside, None) for key in engine.graphs.ahead_keys()]
    return keys + [(key, engine.graphs._prefill, None) for key in engine.graphs.prefill_keys()]


def prompt_shapes(engine: QwenEngine) -> list[list[int]]:
    """Prompt lengths of each warm-up call (one list: one prefill; several: one batch_prefill), each call then
    decoding two steps: one token, a multiple of 16 and one past it, a full prefill chunk; a few ragged rows; and
    16 ragged rows (Triton specialises integer arguments that are multiples of 16) long enough that every
    elementwise call runs compiled (twice fused.LARGE per hidden-wide tensor, so that the delta rule's q/k, at
    least as wide, also pass fla's one-block L2 norm), at two lengths (dynamo compiles the dynamic-shape variant
    at the second)."""
    opts, longest = engine.options, engine.options.max_seq_len - 4  # room for the prefix extension and two steps
    sizes = sorted({min(n, longest) for n in (1, 16, 17, 100, opts.prefill_chunk)})
    calls = [[n] for n in sizes]
    if engine.num_slots >= 2:
        calls.append([min(17, longest), min(5, longest)])
    rows = min(16, engine.num_slots)
    if rows >= 4:
        big = -(-2 * fused.LARGE // (rows * engine.cfg.hidden_size))
        for n in dict.fromkeys(min(m, longest, opts.prefill_chunk) for m in (big, big + 17)):
            calls.append([max(1, n - i % 4) for i in range(rows)])
    return calls


def warm_up(engine: QwenEngine, progress: bool = True) -> WarmupReport:
    """Capture every graph and run every prompt shape once, on an engine whose slots are all free; leaves it
    as it was (slots empty, prefix cache empty, counters unchanged)."""
    if len(engine.free_slots()) != engine.num_slots or any(engine.position(s) for s in range(engine.num_slots)):
        raise ValueError("warm up an idle engine: every slot free and empty (warm-up runs its prompts in them)")
    before, start, forwards = compile_events.counts(engine.graphs), time.perf_counter(), engine.forward_count
    graphs, calls = graph_steps(engine), prompt_shapes(engine)
    with tqdm(total=len(graphs) + len(calls), desc="warm-up", disable=not progress) as bar:
        for key, step, after in graphs:
            bar.set_postfix_str(f"{key[0]} b{key[1]} keys {key[3]}")
            assert engine.graphs is not None
            captured = engine.graphs.ensure(key, step)
            if captured is not None and after is not None:
                after(captured.outputs)
            bar.update()
        # eagerly even where prompt graphs would take them: a piece no graph takes runs these kernels
        with engine.graphs.prompts_eager() if engine.graphs is not None else contextlib.nullcontext():
            for lengths in calls:
                bar.set_postfix_str(f"prompts {lengths}")
                _run_prompts(engine, lengths)
                bar.update()
    engine.forward_count = forwards
    if engine.speculator is not None:
        engine.speculator.stats = type(engine.speculator.stats)()
    failed = sum(key in cast("StepGraphs", engine.graphs).failed for key, _, _ in graphs)
    return WarmupReport(
        len(graphs), failed, len(calls), time.perf_counter() - start, compile_events.since(before, engine.graphs)
    )


def _run_prompts(engine: QwenEngine, lengths: list[int]) -> None:
    """Prefill fixed prompts into fresh slots in one call, decode two steps, extend a lone prompt (a cached
    prefix hit), then forget everything."""
    vocab = engine.cfg.vocab_size
    requests = [BatchedRequest(b, [(i + 7 * b) % vocab for i in range(n)]) for b, n in enumerate(lengths)]
    try:
        engine.batch_prefill(requests)
        for _ in range(2):
            engine.batch_decode_step(requests)
        if engine.prefix is not None and len(requests) == 1:
            engine.prefill(requests[0].prompt_tokens + [1, 2, 3], cast(int, requests[0].slot_id))
    finally:
        engine.reset()
        for r in requests:
            if r.slot_id is not None and r.slot_id not in engine.free_slots():
                engine.release_slot(r.slot_id)
