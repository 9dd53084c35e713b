"""generate(): continuous batching over slots.

Waiting prompts take slots as they free up; every running request advances in one batch_decode_step.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from .requests import BatchedRequest
from .sampling import GREEDY, SamplingParams

if TYPE_CHECKING:
    from .engine import QwenEngine


def generate(
    engine: QwenEngine, prompts: list[list[int]], sampling: SamplingParams | list = GREEDY, progress: bool = False
) -> list[list[int]]:
    """Generated tokens per prompt (prompt excluded), in prompt order."""
    params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    for i, p in enumerate(prompts):
        engine.check_tokens(p, f"prompt {i}")
        if len(p) >= engine.options.max_seq_len:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; max_seq_len={engine.options.max_seq_len} leaves no room to generate"
            )
    if prompts and not engine.free_slots():  # nothing could ever be admitted: refuse rather than wait forever
        raise ValueError(f"generate needs a free slot, but all {engine.num_slots} are taken; release one first")
    waiting = deque(
        BatchedRequest(i, list(p), sampling=sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    )
    running: list[BatchedRequest] = []
    outputs: dict[int, list[int]] = {}
    bar = tqdm(total=len(prompts), desc="generate", disable=not progress)

    def retire(done: list[BatchedRequest]):
        for r in done:
            r.generated_tokens = _truncate(r.generated_tokens, r.sampling)
            outputs[r.request_id] = r.generated_tokens
            engine.release_slot(r.slot_id)
            running.remove(r)
            bar.update()

    try:
        while waiting or running:
            admit = [waiting.popleft() for _ in range(min(len(waiting), len(engine.free_slots())))]
            zero = [r for r in admit if r.sampling.max_new_tokens == 0]
            for r in zero:
                outputs[r.request_id] = []
                bar.update()
            admit = [r for r in admit if r.sampling.max_new_tokens > 0]
            if admit:
                engine.batch_prefill(admit)
                running.extend(admit)
                retire([r for r in admit if _finished(engine, r)])
            if running:
                engine.batch_decode_step(running)
                retire([r for r in running if _finished(engine, r)])
    except BaseException:  # an error or a KeyboardInterrupt: the slots this call took are free again
        for r in running:
            engine.release_slot(r.slot_id)
        raise
    finally:
        bar.close()
    return [outputs[i] for i in range(len(prompts))]


def _finished(engine: QwenEngine, r: BatchedRequest) -> bool:
    # a speculative step may add several tokens: a stop token can sit anywhere among them
    return (
        len(r.generated_tokens) >= r.sampling.max_new_tokens
        or any(t in r.sampling.stop_token_ids for t in r.generated_tokens)
        or engine.position(r.slot_id) + 1 >= engine.options.max_seq_len
    )


def _truncate(tokens: list[int], sampling: SamplingParams) -> list[int]:
    """At most max_new_tokens, ending at the first stop token (kept)."""
    tokens = tokens[: sampling.max_new_tokens]
    stops = [i for i, t in enumerate(tokens) if t in sampling.stop_token_ids]
    return tokens[: stops[0] + 1] if stops else tokens
