"""generate(): continuous batching over slots.

Waiting prompts take slots as they free up; every running request advances in one batch_decode_step.
stream_tokens() is the same loop as an iterator: what each forward produced, per request, as it arrives.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from tqdm.auto import tqdm

from .requests import BatchedRequest
from .sampling import GREEDY, SamplingParams

if TYPE_CHECKING:
    from .engine import QwenEngine


@dataclass
class Step:
    """What one forward gave one request: its new tokens (truncated at a stop token or max_new_tokens) and,
    once it is done, why: "stop" (a stop token, kept) or "length" (max_new_tokens or max_seq_len)."""

    index: int  # the prompt's position in the call
    tokens: list[int]
    finished: str | None = None
    reused_tokens: int = 0  # prompt tokens the prefix cache supplied (prefill step)


def generate(
    engine: QwenEngine,
    prompts: list[list[int]],
    sampling: SamplingParams | list = GREEDY,
    progress: bool = False,
    arrivals: list[float] | None = None,
) -> list[list[int]]:
    """Generated tokens per prompt (prompt excluded), in prompt order."""
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in stream_tokens(engine, prompts, sampling, progress, arrivals):
        outputs[step.index].extend(step.tokens)
    return outputs


def stream_tokens(
    engine: QwenEngine,
    prompts: list[list[int]],
    sampling: SamplingParams | list = GREEDY,
    progress: bool = False,
    arrivals: list[float] | None = None,
) -> Iterator[Step]:
    """The same continuous batching, as an iterator of Steps as tokens arrive. Bad input raises here, before any
    slot changes; a stream left unfinished (closed, or garbage-collected) releases the slots it took.
    arrivals: seconds after the call at which each prompt is submitted (nondecreasing; None: all at once), so a
    trace of requests arriving over time can be replayed."""
    params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    arrivals = [0.0] * len(prompts) if arrivals is None else list(arrivals)
    if len(arrivals) != len(prompts) or any(
        not 0 <= a <= b for a, b in zip(arrivals, arrivals[1:] + [math.inf], strict=True)
    ):
        raise ValueError(f"arrivals must be {len(prompts)} nondecreasing times >= 0 (seconds), one per prompt")
    for i, p in enumerate(prompts):
        engine.check_tokens(p, f"prompt {i}")
        if len(p) >= engine.options.max_seq_len:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; max_seq_len={engine.options.max_seq_len} leaves no room to generate"
            )
    if len(engine.free_slots()) == 0:
        raise ValueError(f"all {engine.num_slots} slots are taken; release one before generating")
    return _run(engine, prompts, params, progress, arrivals)


def _run(engine: QwenEngine, prompts, params, progress, arrivals: list[float]) -> Iterator[Step]:
    waiting = deque(
        BatchedRequest(i, list(p), sampling=sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    )
    due, start = deque(arrivals), time.perf_counter()  # due[i]: when waiting[i] is submitted
    running: list[BatchedRequest] = []
    sent: dict[int, int] = {}  # tokens already yielded per request
    bar = tqdm(total=len(prompts), desc="generate", disable=not progress)

    def advance(batch: list[BatchedRequest], reused: list[int]) -> list[Step]:
        """Steps for `batch` after a forward; finished requests give their slot back first."""
        steps = []
        for r, n in zip(batch, reused, strict=True):
            done = _finished(engine, r)
            tokens = _truncate(r.generated_tokens, r.sampling) if done else r.generated_tokens
            reason = None
            if done:
                reason = "stop" if tokens and tokens[-1] in r.sampling.stop_token_ids else "length"
                engine.release_slot(cast(int, r.slot_id))
                running.remove(r)
                bar.update()
            steps.append(Step(r.request_id, tokens[sent.get(r.request_id, 0) :], reason, n))
            sent[r.request_id] = len(tokens)
        return steps

    try:
        while waiting or running:
            now = time.perf_counter() - start
            if not running and due and due[0] > now:  # idle until the next request arrives
                time.sleep(due[0] - now)
                now = due[0]
            arrived = bisect.bisect_right(due, now)
            admit = [waiting.popleft() for _ in range(min(arrived, len(engine.free_slots())))]
            for _ in admit:
                due.popleft()
            for r in admit:
                if r.sampling.max_new_tokens == 0:
                    bar.update()
                    yield Step(r.request_id, [], "length")
            admit = [r for r in admit if r.sampling.max_new_tokens > 0]
            if admit:
                results = engine.batch_prefill(admit).results
                running.extend(admit)
                yield from advance(admit, [res.reused_tokens for res in results])
            if running:
                batch = list(running)
                # a step after which a request ends by length changes the batch: none is launched ahead of it
                ends = any(len(r.generated_tokens) + 1 >= r.sampling.max_new_tokens for r in batch)
                engine.batch_decode_step(batch, go_on=not ends)
                yield from advance(batch, [0] * len(batch))
    finally:  # normal end: nothing left; a stream abandoned midway frees what it holds
        for r in running:
            engine.release_slot(cast(int, r.slot_id))
        bar.close()


def _finished(engine: QwenEngine, r: BatchedRequest) -> bool:
    # a speculative step may add several tokens: a stop token can sit anywhere among them
    return (
        len(r.generated_tokens) >= r.sampling.max_new_tokens
        or any(t in r.sampling.stop_token_ids for t in r.generated_tokens)
        or engine.position(cast(int, r.slot_id)) + 1 >= engine.options.max_seq_len
    )


def _truncate(tokens: list[int], sampling: SamplingParams) -> list[int]:
    """At most max_new_tokens, ending at the first stop token (kept)."""
    tokens = tokens[: sampling.max_new_tokens]
    stops = [i for i, t in enumerate(tokens) if t in sampling.stop_token_ids]
    return tokens[: stops[0] + 1] if stops else tokens
