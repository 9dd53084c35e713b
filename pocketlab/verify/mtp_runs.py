"""Speculative engines driven for the MTP checks: drafters by name, plain reference runs, an interleaved schedule
of single and batch calls, and engines with an MTP head for any preset.

Drafters: "mtp" (the checkpoint's head), "oracle" (the known greedy continuation: every draft right),
"adversarial" (every draft wrong), "oracle@0.5" (each draft right with probability 0.5).
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, cast

from ..config import DTYPES, EngineOptions, ModelConfig
from ..engine import QwenEngine
from ..requests import BatchedRequest
from ..sampling import SamplingParams
from ..speculative import MTPDrafter
from ..tools.synthetic import PRESETS, build_hf_model, ensure_checkpoint, mtp_weights
from .common import checkpoint_root, solo_run
from .drafters import AdversarialDrafter, OracleDrafter

if TYPE_CHECKING:
    from ..speculative import Speculator

DEFAULT_MODEL = "tiny-qwen3_5-mtp"
DRAFTERS = ("mtp", "oracle", "adversarial", "oracle@0.5")


def use_drafter(eng: QwenEngine, name: str, references: dict[int, list[int]] | None):
    """Point the engine's speculator at a drafter by name; returns it."""
    spec = cast("Speculator", eng.speculator)  # callers pass engines made with speculative_tokens > 0
    if name == "mtp":
        return spec.use(MTPDrafter())
    if name == "adversarial":
        return spec.use(AdversarialDrafter(references))
    if name.startswith("oracle"):
        accuracy = float(name.split("@")[1]) if "@" in name else 1.0
        return spec.use(OracleDrafter(references, accuracy=accuracy))
    raise ValueError(f"unknown drafter {name!r}; known: {DRAFTERS}")


# -- runs ----------------------------------------------------------------------------------------
def plain_greedy(eng: QwenEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Full sequences (prompt + new_tokens + 1 greedy tokens), each slot alone, speculation off."""
    out = []
    with plain(eng):
        for s, p in enumerate(prompts):
            out.append(list(p) + solo_run(eng, p, new_tokens, slot=s).tokens)
            eng.reset(s)
    return out


@contextlib.contextmanager
def plain(eng: QwenEngine):
    """The engine without its speculator (plain decode steps) for the duration."""
    spec, eng.speculator = eng.speculator, None
    try:
        yield eng
    finally:
        eng.speculator = spec


def interleaved(
    eng: QwenEngine, prompts: list[list[int]], new_tokens: int, sampling: list[SamplingParams] | None = None
) -> tuple[list[BatchedRequest], list[dict]]:
    """Slot 0 is prefilled and decoded alone first; the others are prefilled in one batch; then rounds of
    (all live slots in one batch_decode_step), (the last one alone via decode_step), (all but the first, in
    reverse order), until every slot has new_tokens + 1 tokens. Returns the requests and, per call, its kind,
    slots and forwards run."""
    sampling = sampling or [SamplingParams()] * len(prompts)
    reqs = [
        BatchedRequest(100 + i, list(p), slot_id=i, sampling=sp)
        for i, (p, sp) in enumerate(zip(prompts, sampling, strict=True))
    ]
    need, calls = new_tokens + 1, []

    def call(kind, rs, fn):
        before = eng.forward_count
        out = fn()
        calls.append(dict(call=kind, slots=[r.slot_id for r in rs], forwards=eng.forward_count - before))
        return out

    r = call("prefill", reqs[:1], lambda: eng.prefill(prompts[0], slot_id=0, sampling=sampling[0]))
    reqs[0].generated_tokens = [r.next_token]
    if len(reqs) > 1:
        call("batch_prefill", reqs[1:], lambda: eng.batch_prefill(reqs[1:]))
    rnd = 0
    while True:
        live = [r for r in reqs if len(r.generated_tokens) < need]
        if not live:
            break
        if rnd % 3 == 1 or len(live) == 1:
            one = live[-1]
            assert one.last_token is not None and one.slot_id is not None  # every request is prefilled by now
            res = call(
                "decode_step", [one], functools.partial(eng.decode_step, one.last_token, one.slot_id, one.sampling)
            )
            one.generated_tokens.extend(res.tokens)
        else:
            group = live if rnd % 3 == 0 else live[::-1][:-1]
            call("batch_decode_step", group, functools.partial(eng.batch_decode_step, group))
        rnd += 1
    return reqs, calls


def mtp_engine(model, device, dtype, seed, **options):
    """(engine maker, vocab) for a preset or checkpoint; real-shape presets get random MTP weights in memory."""
    name = str(model)
    if name in PRESETS and not name.startswith("tiny"):
        torch_dtype = DTYPES[dtype]
        hf = build_hf_model(name, seed, device, torch_dtype, mtp_num_hidden_layers=1)
        cfg = ModelConfig.from_dict(hf.config.to_dict())
        weights = dict(hf.state_dict()) | mtp_weights(cfg, seed, device, torch_dtype)
        del hf
        return (
            lambda **o: QwenEngine(cfg, weights, EngineOptions(device=device, dtype=dtype, **(options | o)))
        ), cfg.vocab_size
    path = ensure_checkpoint(name, checkpoint_root(), seed) if name in PRESETS else name
    cfg = ModelConfig.from_pretrained(path)
    return (
        lambda **o: QwenEngine.from_pretrained(path, EngineOptions(device=device, dtype=dtype, **(options | o)))
    ), cfg.vocab_size
