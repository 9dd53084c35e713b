"""The text API on checkpoints with Qwen's real tokenizer: prompts encode exactly as transformers' tokenizer and
chat template encode them, completions are the token API's tokens decoded, streams add up to the completion
without ever showing half a character, generation_config.json supplies the defaults, and bad input changes nothing."""

import json
import shutil
from dataclasses import replace

import pytest
from conftest import assert_same_state, engine_state

from pocketlab import EngineOptions, QwenEngine, SamplingParams
from pocketlab.generate import stream_tokens
from pocketlab.text import Completion, Detokenizer, _deltas

CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Wie geht's? 你好 🙂"}]
GREEDY8 = dict(temperature=0.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def eng(make_engine):
    return make_engine("tiny-qwen3-text", max_slots=2)


def test_detokenizer_never_splits_a_character(eng):
    tok = eng.tokenizer
    text = "ok 🫠🇫🇷👩‍👩‍👧 𝔘𝔫𝔦 中文 done"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens end inside a character
    d = Detokenizer(tok)
    deltas = [d.push([i]) for i in ids] + [d.flush()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in x for x in deltas)
    assert "" in deltas  # text was held back until its character was complete


def test_text_and_chat_prompts_match_transformers_encoding_and_the_token_api(eng):
    tok = eng.tokenizer
    sp = eng.default_sampling(**GREEDY8)
    out = eng.generate(["The capital of France is", CHAT], sp)
    assert all(isinstance(c, Completion) for c in out)
    assert out[0].prompt_ids == tok("The capital of France is", add_special_tokens=False)["input_ids"]
    assert out[1].prompt_ids == tok.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    for c in out:
        assert c.token_ids == eng.generate([c.prompt_ids], sp)[0]  # the token API, unchanged, gives the same ids
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.finish_reason in ("stop", "length")
    no_think = eng.generate([CHAT], sp, enable_thinking=False)[0].prompt_ids
    assert tok.decode(no_think).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_stream_deltas_add_up_per_request(eng):
    prompts = ["one", "two two", CHAT, "四"]  # more prompts than slots: continuous batching
    sp = eng.default_sampling(**GREEDY8)
    expected = eng.generate(prompts, sp)
    texts, tokens, done = [""] * 4, [[] for _ in prompts], {}
    order = []
    for d in eng.stream(prompts, sp):
        assert d.index not in done
        assert d.done or not d.text.endswith("\ufffd")  # random weights may emit invalid bytes, never half a char
        texts[d.index] += d.text
        tokens[d.index] += d.token_ids
        order.append(d.index)
        if d.done:
            done[d.index] = d.completion
    # the stream finds the prompts `expected` cached (reused_tokens): the rest of each completion is the same
    assert [replace(done[i], reused_tokens=0) for i in range(4)] == [replace(c, reused_tokens=0) for c in expected]
    assert all(done[i].reused_tokens >= c.reused_tokens for i, c in enumerate(expected))
    assert texts == [c.text for c in expected] and tokens == [c.token_ids for c in expected]
    assert order != sorted(order)  # requests advanced together, interleaved
    assert eng.free_slots() == [0, 1]


def test_generation_config_supplies_stop_ids_and_sampling(eng, checkpoint, tmp_path):
    assert eng.default_sampling() == SamplingParams(
        temperature=0.6, top_p=0.95, top_k=20, stop_token_ids=(151645, 151643)
    )
    assert eng.default_sampling(top_k=5).top_k == 5
    first = eng.generate(["Hello"], eng.default_sampling(**GREEDY8))[0]
    path = tmp_path / "eos"
    shutil.copytree(checkpoint("tiny-qwen3-text"), path)
    stop = first.token_ids[2]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop], "do_sample": False}))
    e = QwenEngine.from_pretrained(path, EngineOptions(max_slots=1, max_seq_len=128))
    assert e.default_sampling() == SamplingParams(stop_token_ids=(stop,))  # do_sample false: greedy
    out = e.generate(["Hello"])[0]  # sampling=None: the checkpoint's defaults
    assert out.token_ids == first.token_ids[: first.token_ids.index(stop) + 1] and out.finish_reason == "stop"
    (path / "generation_config.json").write_text(json.dumps({"do_sample": False, "repetition_penalty": 1.05}))
    e = QwenEngine.from_pretrained(path, EngineOptions(max_slots=1, max_seq_len=128))  # a processor: greedy too
    assert e.default_sampling() == SamplingParams(stop_token_ids=(151645,), repetition_penalty=1.05)
    (path / "generation_config.json").unlink()  # then config.json's eos_token_id
    assert QwenEngine.from_pretrained(path).default_sampling().stop_token_ids == (151645,)


@pytest.mark.parametrize(
    "text",
    ["{not json", "[1, 2]", '{"do_sample": true, "temperature": -1}', '{"repetition_penalty": 0}',
     '{"do_sample": true, "top_k": "many"}', '{"eos_token_id": ["a"]}'],
)  # fmt: skip
def test_a_generation_config_without_valid_sampling_is_refused_at_load(text, checkpoint, tmp_path):
    """Before any weight is read, naming the file, rather than at the first request."""
    path = tmp_path / "gen"
    shutil.copytree(checkpoint("tiny-qwen3"), path)
    (path / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match="generation_config.json"):
        QwenEngine.from_pretrained(path)


def test_bad_text_input_is_refused_and_changes_nothing(eng, checkpoint):
    eng.prefill(eng.tokenizer.encode("held"), slot_id=1)
    before = engine_state(eng)
    bad = [
        ([""], "empty"),
        ([[{"role": "user"}]], "'role' and 'content'"),
        (["fine", 3.5], "prompt 1 must be"),
        ("a bare string", "wrap a single string"),
        (["x " * 300], "max_seq_len"),
        ([[{"role": "tool", "content": "42"}]], "chat template refused"),
    ]
    for prompts, message in bad:
        with pytest.raises(ValueError, match=message):
            eng.generate(prompts)
        with pytest.raises(ValueError, match=message):
            eng.stream(prompts)
        assert_same_state(before, engine_state(eng))
    eng.release_slot(1)
    stream = eng.stream(["abandoned after one delta"], eng.default_sampling(**GREEDY8))
    next(stream)
    stream.close()
    assert eng.free_slots() == [0, 1]


def test_engines_without_or_with_a_mismatched_tokenizer(make_engine, eng):
    plain = make_engine("tiny-qwen3")  # random ids only: no tokenizer in the folder
    assert plain.tokenizer is None
    with pytest.raises(ValueError, match="need a tokenizer"):
        plain.generate(["hello"])
    assert plain.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))[0] == plain.generate([[1, 2, 3]])[0][:2]
    with pytest.raises(ValueError, match="different checkpoints"):
        QwenEngine(plain.cfg, {}, tokenizer=eng.tokenizer)


def test_hybrid_text_preset_streams(make_engine):
    e = make_engine("tiny-qwen3_5-text", max_slots=1)
    assert e.tokenizer.convert_tokens_to_ids("<|im_end|>") == 248046
    deltas = list(e.stream([CHAT], e.default_sampling(temperature=0.0, max_new_tokens=4)))
    assert deltas[-1].done and "".join(d.text for d in deltas) == deltas[-1].completion.text
    assert e.tokenizer.decode(deltas[-1].completion.prompt_ids).endswith("<|im_start|>assistant\n<think>\n")


def test_closing_a_text_stream_closes_its_token_stream(eng):
    """At once, not when the garbage collector gets to it: the token stream's close gives back its slots (on CUDA
    something kept the frame alive, and an abandoned stream held slot 0)."""
    ids = [eng.tokenizer.encode("abandoned")]
    steps = stream_tokens(eng, ids, eng.default_sampling(**GREEDY8))  # held here, as that reference was
    deltas = _deltas(eng.tokenizer, ids, steps)
    next(deltas)
    assert eng.free_slots() == [1]
    deltas.close()
    assert steps.gi_frame is None and eng.free_slots() == [0, 1]
