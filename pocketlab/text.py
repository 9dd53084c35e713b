"""Text in, text out: prompts go through the checkpoint's own tokenizer and chat template, and generated tokens
are decoded incrementally, so a stream never shows half a character (a byte-level BPE token can end inside
one: an emoji often takes several tokens)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard

from .generate import stream_tokens
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .engine import QwenEngine

# a prompt: raw text, a chat (list of {"role", "content"} messages) or token ids
Prompt = str | list[dict] | list[int]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


@dataclass
class Completion:
    """One prompt's outcome in text and ids. token_ids include the stop token, text leaves special tokens out."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str  # "stop": a stop token ended it; "length": max_new_tokens or max_seq_len did
    reused_tokens: int = 0  # prompt tokens the prefix cache supplied


@dataclass
class TextDelta:
    """What one forward added to one request: new text (maybe "" while a character is incomplete) and tokens.
    The last delta of a request has done=True and its Completion."""

    index: int  # the prompt's position in the call
    text: str
    token_ids: list[int] = field(default_factory=list)
    done: bool = False
    completion: Completion | None = None


class Detokenizer:
    """Incremental decoding: emit text only once it no longer ends in an incomplete character (U+FFFD), decoding a
    short window (the tokens since the last emitted text) rather than the whole output each step."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.start = self.read = 0  # ids[start:read] is already emitted context, ids[read:] not yet

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        before, now = self._decode(self.ids[self.start : self.read]), self._decode(self.ids[self.start :])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self.start, self.read = self.read, len(self.ids)
        return now[len(before) :]

    @property
    def text(self) -> str:
        """Everything decoded so far, as decode() gives it."""
        return self._decode(self.ids)

    def flush(self) -> str:
        """Whatever is left at the end, an incomplete character included (as U+FFFD, like decode())."""
        before, now = self._decode(self.ids[self.start : self.read]), self._decode(self.ids[self.start :])
        self.start = self.read = len(self.ids)
        return now[len(before) :]


def load_tokenizer(path: str | Path):
    """The folder's tokenizer (transformers' AutoTokenizer, offline), or None when the folder ships none."""
    path = Path(path)
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises, say which folder and why
        raise ValueError(f"{path}: the tokenizer files could not be loaded: {exc}") from exc


def is_token_ids(prompt) -> TypeGuard[list[int] | tuple[int, ...]]:
    return isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def encode_prompt(tokenizer, prompt: Prompt, what: str = "prompt", enable_thinking: bool | None = None) -> list[int]:
    """Token ids for a prompt: raw text is tokenized as is, a chat goes through the chat template with the
    assistant's generation prompt (enable_thinking passed on when given: Qwen3's switch), ids pass through."""
    if is_token_ids(prompt) and prompt:
        return list(prompt)
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{what} is empty: at least one token is needed")
        return tokenizer.encode(prompt, add_special_tokens=False)
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(
            f"{what} must be a non-empty string, a list of chat messages or a list of token ids, got {prompt!r:.80}"
        )
    for m in prompt:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{what}: every chat message needs a string 'role' and 'content', got {m!r:.80}")
    if not tokenizer.chat_template:
        raise ValueError(f"{what} is a chat, but the checkpoint's tokenizer has no chat template: pass a string")
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    try:
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as exc:  # noqa: BLE001 - jinja's errors (raise_exception, undefined names) as a ValueError
        raise ValueError(f"{what}: the checkpoint's chat template refused it: {exc}") from exc
    return tokenizer.encode(text, add_special_tokens=False)


def stream(
    engine: QwenEngine,
    prompts: list[Prompt],
    sampling: SamplingParams | list | None = None,
    enable_thinking: bool | None = None,
    progress: bool = False,
) -> Iterator[TextDelta]:
    """TextDeltas for every request as its tokens arrive (continuous batching over the free slots). Every prompt
    is encoded and checked first: bad input raises here and leaves every slot as it was."""
    tok = engine.require_tokenizer()
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
        raise ValueError("prompts is a list of prompts: wrap a single string or chat in a list")
    ids = [encode_prompt(tok, p, f"prompt {i}", enable_thinking) for i, p in enumerate(prompts)]
    steps = stream_tokens(engine, ids, engine.default_sampling() if sampling is None else sampling, progress)
    return _deltas(tok, ids, steps)


def _deltas(tok, prompt_ids: list[list[int]], steps) -> Iterator[TextDelta]:
    """The token steps as text; closing this stream closes `steps` at once, which gives back the slots it holds
    (left to the garbage collector, that waited for whatever still referenced the frame: seen on CUDA)."""
    detok = [Detokenizer(tok) for _ in prompt_ids]
    reused = [0] * len(prompt_ids)
    try:
        for s in steps:
            d = detok[s.index]
            reused[s.index] += s.reused_tokens
            text = d.push(s.tokens)
            if s.finished is None:
                yield TextDelta(s.index, text, s.tokens)
                continue
            text += d.flush()
            done = Completion(d.text, d.ids, prompt_ids[s.index], s.finished, reused[s.index])
            yield TextDelta(s.index, text, s.tokens, True, done)
    finally:
        steps.close()


def complete(engine: QwenEngine, prompts: list[Prompt], sampling=None, enable_thinking=None, progress=False):
    """A Completion per prompt, in prompt order."""
    out: list[Completion | None] = [None] * len(prompts)
    for d in stream(engine, prompts, sampling, enable_thinking, progress):
        if d.done:
            out[d.index] = d.completion
    return out
