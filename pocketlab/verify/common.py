"""What every check shares: the engine and its HF reference built from the same weights, prompts,
tolerances, and one way to compare logits, so parity, isolation and batch checks judge alike."""

from __future__ import annotations

import copy
import functools
import inspect
import json
import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from ..config import DTYPES, EngineOptions, ModelConfig
from ..engine import QwenEngine
from ..tools.synthetic import PRESETS, build_hf_model, ensure_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedModel


# -- the model pair ------------------------------------------------------------------------------
@dataclass
class Pair:
    """The engine under test (made on demand, with the options a check needs) and its HF reference."""

    name: str
    hf: PreTrainedModel
    make: Callable[[EngineOptions], QwenEngine]
    device: str = "cpu"
    dtype: str = "float32"

    @property
    def vocab_size(self) -> int:
        return self.hf.config.get_text_config().vocab_size

    def engine(self, **options) -> QwenEngine:
        return self.make(EngineOptions(device=self.device, dtype=self.dtype, **options))

    @functools.cached_property
    def hf32(self) -> PreTrainedModel:
        """HF in float32 on the same (possibly bf16-valued) weights: the reference in every dtype."""
        return self.hf if self.dtype == "float32" else copy.deepcopy(self.hf).float()


def checkpoint_root() -> Path:
    """Where tiny preset checkpoints are written once: $POCKETLAB_CHECKPOINTS, else the repo's checkpoints/."""
    if os.environ.get("POCKETLAB_CHECKPOINTS"):
        return Path(os.environ["POCKETLAB_CHECKPOINTS"])
    repo = Path(__file__).resolve().parents[2]
    return repo / "checkpoints" if (repo / "pyproject.toml").is_file() else Path.home() / ".cache/pocketlab"


def load_pair(
    model: str | Path, device: str = "cpu", dtype: str = "float32", seed: int = 0, root: str | Path | None = None
) -> Pair:
    """Tiny presets go through a checkpoint folder (so the loader is exercised, as HF's is); real-shape
    presets are built in memory on `device`; anything else is a checkpoint folder path."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch_dtype = DTYPES[dtype]
    name = str(model)
    if name in PRESETS and not name.startswith("tiny"):
        hf = build_hf_model(name, seed, device, torch_dtype)
        cfg, weights = ModelConfig.from_dict(hf.config.to_dict()), hf.state_dict()
        return Pair(name, hf, lambda opts: QwenEngine(cfg, weights, opts), device, dtype)
    path = ensure_checkpoint(name, root or checkpoint_root(), seed) if name in PRESETS else Path(name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device).eval()  # type: ignore[arg-type]  # transformers types to() as unbound Module.to
    return Pair(name, hf, lambda opts: QwenEngine.from_pretrained(path, opts), device, dtype)


def as_pair(model, device: str, dtype: str, seed: int) -> Pair:
    """A Pair passes through (its own device and dtype win); a name or path is loaded."""
    return model if isinstance(model, Pair) else load_pair(model, device, dtype, seed)


def random_prompts(vocab_size: int, lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def hf_logits(hf: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """HF logits [T, vocab] (float32, CPU) for the whole sequence in one forward: the reference."""
    ids = torch.tensor([tokens], device=hf.device)
    return hf(input_ids=ids).logits[0].float().cpu()


# -- runs ----------------------------------------------------------------------------------------
@dataclass
class Run:
    """One sequence's outputs: step 0 is the prefill's prediction, then one per decode step."""

    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # float32 CPU copies (buffers get reused)

    def add(self, token: int, logits: torch.Tensor) -> None:
        self.tokens.append(int(token))
        self.logits.append(logits.detach().float().cpu().clone())


def solo_run(eng: QwenEngine, prompt: list[int], steps: int, slot: int | None = None, sampling=None) -> Run:
    """Prefill then decode on one slot, greedy unless `sampling` (SamplingParams); slot=None uses the API's
    default slot."""
    kw = ({} if slot is None else {"slot_id": slot}) | ({} if sampling is None else {"sampling": sampling})
    run = Run()
    r = eng.prefill(prompt, **kw)
    run.add(r.next_token, r.logits)
    for _ in range(steps):
        r = eng.decode_step(r.next_token, **kw)
        run.add(r.next_token, r.logits)
    return run


# -- tolerance and comparison --------------------------------------------------------------------
@dataclass(frozen=True)
class Tolerance:
    """How far logits may drift, and when a different token is still acceptable.

    float32: |diff| <= atol everywhere, and tokens must be equal.
    Low precision, against HF: the reference is HF in float32, and the engine may be at most
    `hf_factor` times as far from it as HF itself is when run in the same low precision (HF's own
    error, measured per step, calibrates the bound for every model size); floor `floor * max|logit|`.
    Low precision, engine against itself (batched vs solo), calibrated: per step |diff| <= noise_factor x
    `noise`, the engine's own max |low precision - float32| on the reference's sequence, measured in the
    same run (two low-precision runs that each sit that far from float32 are at most twice as far apart);
    a token may differ only where the reference's top-2 margin is within that bound: a flip the measured
    noise cannot explain fails. Without a measurement: |diff| <= rtol * max|logit| (the prefix check).
    Against HF or uncalibrated, a token may differ where the reference's top-2 margin is within 2x the bound.
    """

    dtype: str
    atol: float = 1e-4
    rtol: float = 0.0
    hf_factor: float = 2.0
    floor: float = 1e-3
    noise_factor: float = 2.0

    @property
    def exact_tokens(self) -> bool:
        return self.rtol == 0.0

    def bound(self, ref: torch.Tensor, hf_error: float | None = None, noise: float | None = None) -> float:
        if self.exact_tokens:
            return self.atol
        if noise is not None:
            return max(self.noise_factor * noise, self.atol)
        scale = float(ref.abs().max())
        return self.rtol * scale if hf_error is None else max(self.hf_factor * hf_error, self.floor * scale)

    def flip_margin(self, bound: float, calibrated: bool) -> float:
        """The largest top-2 margin at which a different token is accepted (0: none in float32)."""
        if self.exact_tokens:
            return -1.0
        return bound if calibrated else 2 * bound

    def describe(self, vs_hf: bool = False, calibrated: bool = False) -> str:
        if self.exact_tokens:
            return f"|diff| <= {self.atol:g}"
        if vs_hf:
            return f"|diff vs HF fp32| <= {self.hf_factor:g} x HF {self.dtype}'s own"
        if calibrated:
            return f"|diff| <= {self.noise_factor:g} x own |{self.dtype} - fp32| per step; flips only within it"
        return f"|diff| <= {self.rtol:g} x max|logit|"


# low precision without a noise measurement (the prefix check): the bound scales with the logits (reports/README.md)
TOLERANCES = {
    "float32": Tolerance("float32", atol=1e-4),
    "bfloat16": Tolerance("bfloat16", rtol=0.1),
    "float16": Tolerance("float16", rtol=0.02),
}


def tolerance(dtype: str) -> Tolerance:
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {sorted(TOLERANCES)}")
    return TOLERANCES[dtype]


def step_metrics(
    ref: torch.Tensor,
    test: torch.Tensor,
    ref_token: int,
    token: int,
    tol: Tolerance,
    hf_error: float | None = None,
    noise: float | None = None,
) -> dict:
    """Compare one step's logits and token against the reference's (hf_error, noise: see Tolerance)."""
    ref, test = ref.float().cpu(), test.float().cpu()
    diff = float((test - ref).abs().max())
    scale = float(ref.abs().max())
    top2 = ref.topk(2).values
    margin = float(top2[0] - top2[1])
    bound = tol.bound(ref, hf_error, noise)
    equal = int(token) == int(ref_token)
    decisive = not equal and margin > tol.flip_margin(bound, noise is not None)  # a flip the bound can't explain
    return dict(
        max_abs_diff=diff,
        rel_diff=diff / max(scale, 1e-30),
        bound=bound,
        within_tol=diff <= bound,
        token=int(token),
        ref_token=int(ref_token),
        token_equal=equal,
        ref_margin=margin,
        decisive_mismatch=decisive,
    )


def compare_runs(ref: Run, test: Run, tol: Tolerance, noise: list[float] | None = None) -> dict:
    """Judge a run against its reference; steps after the first token divergence are not comparable.
    noise: per step of `ref`, its own |low precision - float32| distance (see `NoiseMeter`), or None."""
    n = min(len(ref.tokens), len(test.tokens))
    equal = [a == b for a, b in zip(ref.tokens[:n], test.tokens[:n], strict=True)]
    first = equal.index(False) if False in equal else -1
    upto = n if first < 0 else first + 1
    steps = [
        step_metrics(
            ref.logits[k], test.logits[k], ref.tokens[k], test.tokens[k], tol, noise=None if noise is None else noise[k]
        )
        for k in range(upto)
    ]
    ok = all(s["within_tol"] and not s["decisive_mismatch"] for s in steps) and len(test.tokens) == len(ref.tokens)
    return {
        "steps": n,
        "tokens_equal": first < 0 and len(test.tokens) == len(ref.tokens),
        "token_agreement": sum(equal) / max(n, 1),
        "first_divergence": first,
        "max_abs_diff": max((s["max_abs_diff"] for s in steps), default=0.0),
        "bound": min((s["bound"] for s in steps), default=tol.atol),
        "bitwise": all(torch.equal(ref.logits[k], test.logits[k]) for k in range(n)),
        "within_tol": all(s["within_tol"] for s in steps),  # every compared step's logits within its bound
        "pass": ok,
    }


class NoiseMeter:
    """The engine's own rounding noise, for calibrated low-precision verdicts: a float32 engine of the same
    weights and options re-runs a reference run's exact token sequence (teacher-forced), and each step's
    max |low precision - float32| is that step's noise. Float32 pairs measure nothing (None)."""

    def __init__(self, pair: Pair, **options):
        self.engine32 = (
            None
            if pair.dtype == "float32"
            else pair.make(EngineOptions(device=pair.device, dtype="float32", **options))
        )

    def __call__(self, prompt: list[int], run: Run) -> list[float] | None:
        if self.engine32 is None:
            return None
        eng = self.engine32
        eng.reset()
        ref = [eng.prefill(prompt, slot_id=0).logits]
        for token in run.tokens[:-1]:
            ref.append(eng.decode_step(token, slot_id=0).logits)
        return [float((a.float().cpu() - b.float().cpu()).abs().max()) for a, b in zip(run.logits, ref, strict=True)]


# -- what a check returns ------------------------------------------------------------------------
@dataclass
class Report:
    """DataFrames to show, a verdict to assert, and key figures for the reports index."""

    name: str
    summary: pd.DataFrame  # one row per case, boolean `pass` column
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    figures: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(len(self.summary)) and bool(self.summary["pass"].all())

    def __repr__(self) -> str:
        return f"Report({self.name!r}, passed={self.passed}, figures={self.figures})"


def seq_len_for(prompt_lens, decode_steps: int) -> int:
    """A max_seq_len with room for every prompt plus its decode steps (small keeps caches small)."""
    return max(64, max(prompt_lens) + decode_steps + 8)


# -- running and the verdict ---------------------------------------------------------------------
@contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def single_thread_on_cpu(check):
    """CPU checks run single-threaded: tiny matmuls gain nothing from OpenMP, and on a busy machine its
    barriers cost far more than the matmuls themselves."""

    @functools.wraps(check)
    def run(*args, **kwargs):
        bound = inspect.signature(check).bind(*args, **kwargs)
        bound.apply_defaults()
        model = bound.arguments.get("model")
        device = model.device if isinstance(model, Pair) else bound.arguments.get("device", "cpu")
        if torch.device(device).type != "cpu":
            return check(*args, **kwargs)
        with _threads(1):
            return check(*args, **kwargs)

    return run


VERDICT_ENV = "POCKETLAB_VERDICT"  # set by `python -m pocketlab.verify.reports` for each notebook it runs


def write_verdict(*reports: Report, passed: bool | None = None, path: str | Path | None = None, **figures) -> dict:
    """Write a notebook's verdict and key figures where the reports runner asked ($POCKETLAB_VERDICT, or
    `path`). Call it just before the notebook's final assert, so a failing check keeps its figures.
    Takes verify Reports and/or plain figures; with no destination it only returns the dict."""
    entries = [
        dict(
            name=r.name,
            passed=r.passed,
            figures=r.figures,
            summary=json.loads(r.summary.to_json(orient="records", double_precision=15)),
        )
        for r in reports
    ]
    merged: dict[str, Any] = {}
    for r in reports:
        merged.update(r.figures if len(reports) == 1 else {f"{r.name}.{k}": v for k, v in r.figures.items()})
    merged.update(figures)
    ok = all(r.passed for r in reports) and (passed if passed is not None else True)
    data = dict(passed=bool(ok), figures=merged, reports=entries)
    dest = path or os.environ.get(VERDICT_ENV)
    if dest:
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        Path(dest).write_text(json.dumps(data, indent=1, default=str))
    return data
