"""generate(): more prompts than slots, continuous batching, each output equal to its solo run."""

from conftest import greedy_run, random_prompt

from pocketlab import SamplingParams


def test_generate_equals_solo_runs(make_engine):
    engine = make_engine("tiny-qwen3", max_slots=2)
    prompts = [random_prompt(3 + 4 * i, seed=i) for i in range(5)]
    lengths = [6, 2, 9, 4, 1]
    params = [SamplingParams(max_new_tokens=n) for n in lengths]
    expected = []
    for p, n in zip(prompts, lengths, strict=True):
        engine.reset()
        expected.append(greedy_run(engine, p, n - 1)[0])
    engine.reset()
    before = engine.forward_count
    assert engine.generate(prompts, params) == expected
    assert engine.forward_count - before < sum(lengths)  # slots advanced together, not one by one
    assert engine.free_slots() == [0, 1]


def test_stop_tokens_end_a_request(make_engine):
    engine = make_engine("tiny-qwen3")
    prompt = random_prompt(5, seed=1)
    full = engine.generate([prompt], SamplingParams(max_new_tokens=8))[0]
    stop = full[3]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)))[0]
    assert out == full[: full.index(stop) + 1]


def test_arrivals_replay_a_trace_with_the_same_outputs(make_engine):
    """Requests submitted over time (arrivals): none starts before it arrives, an idle engine waits for the next,
    and every output equals the all-at-once run's; bad traces are refused before any slot changes."""
    import time

    import pytest

    from pocketlab.generate import stream_tokens

    engine = make_engine("tiny-qwen3", max_slots=2)
    prompts = [random_prompt(4 + i, seed=70 + i) for i in range(3)]
    params = [SamplingParams(max_new_tokens=n) for n in (3, 5, 2)]
    want = engine.generate(prompts, params)
    start, first_seen, outputs = time.perf_counter(), {}, [[], [], []]
    for step in stream_tokens(engine, prompts, params, arrivals=[0.0, 0.0, 0.4]):
        first_seen.setdefault(step.index, time.perf_counter() - start)
        outputs[step.index] += step.tokens
    assert outputs == want and first_seen[2] >= 0.4 > first_seen[1]
    for bad in ([0.0, 0.5, 0.1], [0.0, 0.1], [-1.0, 0.0, 0.0]):
        with pytest.raises(ValueError, match="nondecreasing"):
            engine.generate(prompts, params, arrivals=bad)
    assert engine.free_slots() == [0, 1]
