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
