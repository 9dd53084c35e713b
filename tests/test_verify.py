"""The verify checks: they return the promised tables, pass on the engine, and FAIL on broken engines
(a check that cannot fail proves nothing)."""

import dataclasses
import json

import nbformat
import pytest
import torch

from pocketlab import BatchDecodeResult, ModelConfig, QwenEngine, verify
from pocketlab.sampling import GREEDY
from pocketlab.verify import reports
from pocketlab.verify.common import VERDICT_ENV, NoiseMeter, Run, compare_runs, solo_run, step_metrics, tolerance
from pocketlab.verify.isolation import SCHEDULES

SMALL = dict(decode_steps=3, prefill_chunk=4)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def pair(root):
    return verify.load_pair("tiny-qwen3", root=root)


def with_engine(pair, cls=QwenEngine, perturb=None):
    """The same pair, but the engine is `cls` built from (optionally perturbed) HF weights."""
    cfg = ModelConfig.from_dict(pair.hf.config.to_dict())
    weights = {k: v.detach().clone() for k, v in pair.hf.state_dict().items()}
    if perturb:
        perturb(weights)
    return dataclasses.replace(pair, make=lambda opts: cls(cfg, weights, opts))


# -- comparison primitives -----------------------------------------------------------------------
def test_step_metrics_token_rules():
    ref = torch.zeros(16)
    ref[3], ref[5] = 5.0, 4.99
    exact = step_metrics(ref, ref, ref_token=3, token=5, tol=tolerance("float32"))
    assert exact["within_tol"] and not exact["token_equal"] and exact["decisive_mismatch"]
    near_tie = step_metrics(ref, ref, ref_token=3, token=5, tol=tolerance("bfloat16"))
    assert not near_tie["decisive_mismatch"]  # a 0.01 margin is within bf16's allowed error
    ref[5] = 1.0
    assert step_metrics(ref, ref, 3, 5, tolerance("bfloat16"))["decisive_mismatch"]
    assert not step_metrics(ref, ref + 1e-3, 3, 3, tolerance("float32"))["within_tol"]


def test_calibrated_low_precision_bound_follows_the_measured_noise():
    """bf16 engine vs itself with a measured noise: |diff| <= 2 x noise per step, and a flip only where the
    reference's top-2 margin is within that bound (not the uncalibrated 2 x 0.1 x max|logit|)."""
    tol = tolerance("bfloat16")
    ref = torch.zeros(16)
    ref[3], ref[5] = 5.0, 4.9  # margin 0.1
    loose = step_metrics(ref, ref, 3, 5, tol)  # uncalibrated: 0.1 < 2 x 0.5, accepted
    assert not loose["decisive_mismatch"]
    quiet = step_metrics(ref, ref, 3, 5, tol, noise=0.02)  # measured noise 0.02: bound 0.04 < 0.1
    assert quiet["bound"] == pytest.approx(0.04) and quiet["decisive_mismatch"]
    assert not step_metrics(ref, ref, 3, 5, tol, noise=0.06)["decisive_mismatch"]  # bound 0.12 explains it
    assert not step_metrics(ref, ref + 0.05, 3, 3, tol, noise=0.02)["within_tol"]  # 5% of the scale would pass
    assert step_metrics(ref, ref + 0.05, 3, 3, tol)["within_tol"]  # ... the uncalibrated rule (0.5)
    with pytest.raises(ValueError, match="no tolerance"):
        tolerance("int8")


def test_noise_meter_measures_bf16_against_float32(root):
    bf16 = verify.load_pair("tiny-qwen3", dtype="bfloat16", root=root)
    eng, meter = bf16.engine(max_slots=1, max_seq_len=64), NoiseMeter(bf16, max_slots=1, max_seq_len=64)
    run = solo_run(eng, [1, 2, 3, 4], 3)
    noise = meter([1, 2, 3, 4], run)
    assert len(noise) == 4 and all(0 < n < 1 for n in noise)
    assert NoiseMeter(verify.load_pair("tiny-qwen3", root=root))([1, 2], run) is None  # float32: exact verdicts


def test_compare_runs_flags_a_wrong_token():
    logits = [torch.randn(8) for _ in range(4)]
    ref = Run([int(x.argmax()) for x in logits], logits)
    assert compare_runs(ref, ref, tolerance("float32"))["pass"]
    wrong = Run(list(ref.tokens), logits)
    wrong.tokens[1] = (wrong.tokens[1] + 1) % 8
    c = compare_runs(ref, wrong, tolerance("float32"))
    assert not c["pass"] and c["first_divergence"] == 1 and not c["tokens_equal"]
    assert not compare_runs(ref, Run(ref.tokens[:2], logits[:2]), tolerance("float32"))["pass"]  # too short


# -- parity --------------------------------------------------------------------------------------
def test_parity_table_and_pass(pair):
    r = verify.parity(pair, prompt_lens=[1, 4, 5], **SMALL)
    assert {"prompt_len", "step", "max_abs_diff", "token_equal", "explicit_slot_equal"} <= set(r.tables["steps"])
    assert {"prompt_len", "max_abs_diff", "token_agreement", "first_divergence", "default_eq_explicit", "pass"} <= set(
        r.summary
    )
    assert len(r.tables["steps"]) == 3 * 4 and r.passed, r.summary
    assert r.figures["max_abs_diff"] <= 1e-4


def test_parity_fails_on_a_perturbed_weight(pair):
    def nudge(w):
        w["model.layers.1.mlp.down_proj.weight"] += 1e-2

    r = verify.parity(with_engine(pair, perturb=nudge), prompt_lens=[1, 5], **SMALL)
    assert not r.passed and not r.summary["pass"].any()
    assert (r.summary.max_abs_diff > 1e-4).all()


def test_parity_low_precision_is_calibrated_by_hf_own_error(root):
    bf16 = verify.load_pair("tiny-qwen3", dtype="bfloat16", root=root)
    r = verify.parity(bf16, prompt_lens=[1, 5], **SMALL)
    assert r.passed and (r.tables["steps"].hf_own_diff > 0).all(), r.summary

    def nudge(w):
        w["model.layers.1.mlp.down_proj.weight"] += 0.1

    assert not verify.parity(with_engine(bf16, perturb=nudge), prompt_lens=[1, 5], **SMALL).passed


# -- isolation -----------------------------------------------------------------------------------
class LeakyEngine(QwenEngine):
    """Each decode step scribbles on the next slot's keys: harmless solo, visible when slots share."""

    def decode_step(self, token, slot_id=0, sampling=GREEDY):
        out = super().decode_step(token, slot_id=slot_id, sampling=sampling)
        for k in self.cache.k.values():
            k[(slot_id + 1) % self.num_slots] += 0.5
        return out


class ResetAllEngine(QwenEngine):
    """reset(slot_id=s) forgets every slot: the classic shared-state bug."""

    def reset(self, slot_id=None):
        super().reset()


def test_isolation_table_and_pass(pair):
    r = verify.isolation(pair, num_slots=[2, 3], **SMALL)
    assert {"num_slots", "schedule", "sequence", "slot", "tokens_equal", "max_abs_diff", "bitwise", "pass"} <= set(
        r.tables["sequences"]
    )
    assert len(r.summary) == 2 * len(SCHEDULES)
    assert r.passed, r.summary


def test_isolation_catches_a_leak_between_slots(pair):
    r = verify.isolation(with_engine(pair, LeakyEngine), num_slots=2, **SMALL)
    assert not r.passed
    assert not r.summary.set_index("schedule").loc["interleaved", "pass"]


def test_isolation_catches_reset_of_all_slots(pair):
    r = verify.isolation(with_engine(pair, ResetAllEngine), num_slots=2, **SMALL).summary.set_index("schedule")
    assert r.loc["interleaved", "pass"] and not r.loc["reset_mid_run", "pass"]


# -- batch API -----------------------------------------------------------------------------------
class LoopEngine(QwenEngine):
    """The seed's 'batch' API: a for-loop of single decodes (one forward per request)."""

    def batch_decode_step(self, requests):
        outs = [self.decode_step(r.last_token, slot_id=r.slot_id) for r in requests]
        for r, o in zip(requests, outs, strict=True):
            r.generated_tokens.append(o.next_token)
        return BatchDecodeResult(
            [o.next_token for o in outs], torch.stack([o.logits for o in outs]), [o.position for o in outs]
        )


class SloppyEngine(QwenEngine):
    """Clears the slot before validating the prompt, so a rejected prefill destroys the slot."""

    def prefill(self, tokens, slot_id=0, **kw):
        if isinstance(slot_id, int) and 0 <= slot_id < self.num_slots:
            self.cache.clear(slot_id)
        return super().prefill(tokens, slot_id=slot_id, **kw)


def test_batch_api_tables_and_pass(pair):
    r = verify.batch_api(pair, **SMALL)
    assert set(r.tables) == {"requests", "sampled", "forwards", "bookkeeping", "errors"}
    assert r.tables["sampled"].own_uniform_draws.all() and r.tables["sampled"].tokens_equal.all()
    assert {"case", "expected", "raised", "message", "state_unchanged", "pass"} <= set(r.tables["errors"])
    assert (r.tables["forwards"].actual == 1).all() and len(r.tables["errors"]) >= 20
    assert r.passed, r.summary


def test_a_flipped_draw_passes_only_where_the_logits_explain_it():
    """A uniform distribution over 1,000 tokens; the solo run drew token t. A batched run whose logits take
    token t's mass away may draw t + 1 (its CDF moved across the uniform), never t + 5; with equal logits no
    flip is explained at all."""
    from pocketlab.sampling import SamplingParams
    from pocketlab.verify.batch_api import _flip_explained

    sp, position, width = SamplingParams(temperature=2.0, seed=7), 5, 1e-3
    target = sp.uniform(position)
    assert 0.2 < (target / width) % 1 < 0.8  # the uniform lies well inside its token, not at a boundary
    t = int(target / width)
    ref = Run([t], [torch.zeros(1000)])
    moved = torch.zeros(1000)
    moved[t] = -20.0

    def explained(token, logits):
        return _flip_explained(ref, Run([token], [logits]), 0, sp, position, "cpu")

    assert explained(t + 1, moved)
    assert not explained(t + 5, moved)
    assert not explained(t + 1, torch.zeros(1000))


def test_batch_api_catches_a_looping_batch(pair):
    s = verify.batch_api(with_engine(pair, LoopEngine), **SMALL).summary.set_index("check")
    assert not s.loc["one forward per batch call", "pass"]


def test_batch_api_catches_state_changed_by_an_error(pair):
    r = verify.batch_api(with_engine(pair, SloppyEngine), **SMALL)
    errors = r.tables["errors"].set_index("case")
    assert not errors.loc["prefill: token >= vocab_size", "state_unchanged"] and not r.passed


# -- verdicts and reports --------------------------------------------------------------------------
def test_write_verdict_writes_the_verdict_and_figures(pair, tmp_path, monkeypatch):
    rep = verify.Report("demo", verify.parity(pair, prompt_lens=[2], decode_steps=1).summary, figures={"a": 1.5})
    monkeypatch.setenv(VERDICT_ENV, str(tmp_path / "r.json"))
    verify.write_verdict(rep, extra=7)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["passed"] and data["figures"] == {"a": 1.5, "extra": 7} and data["reports"][0]["summary"]
    assert not verify.write_verdict(rep, passed=False, path=tmp_path / "f.json")["passed"]


def _notebook(path, body):
    nb = nbformat.v4.new_notebook(
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    )
    params = nbformat.v4.new_code_cell('model = "x"\ndevice = "cpu"\ndtype = "float32"\nseed = 0')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(body)]
    nbformat.write(nb, path)


def test_reports_runs_every_notebook_and_fails_at_the_end(tmp_path):
    books = tmp_path / "nb"
    books.mkdir()
    _notebook(
        books / "01_ok.ipynb", "from pocketlab import verify\nverify.write_verdict(passed=True, answer=42, model=model)"
    )
    _notebook(
        books / "02_bad.ipynb", "from pocketlab import verify\nverify.write_verdict(passed=False, x=1)\nassert False"
    )
    (books / "notes.ipynb").write_text("not a numbered notebook: never run")
    out = tmp_path / "out"
    assert reports.main(["--notebooks", str(books), "--out", str(out), "--model", "m1"]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert [(o["notebook"], o["passed"]) for o in summary["outcomes"]] == [("01_ok", True), ("02_bad", False)]
    assert summary["outcomes"][0]["verdict"]["figures"]["answer"] == 42
    page = (out / "index.html").read_text()
    assert "FAIL" in page and "answer" in page and "AssertionError" in page
    assert (out / "m1" / "01_ok.html").is_file() and (out / "m1" / "02_bad.ipynb").is_file()
    # the same verdicts rebuilt from the files alone (a run split over machines, or cut short)
    (out / "m1" / "02_bad.ipynb").unlink()
    assert reports.main(["--notebooks", str(books), "--out", str(out), "--model", "m1", "--index-only", "again"]) == 0
    again = json.loads((out / "again.json").read_text())
    assert [(o["notebook"], o["passed"]) for o in again["outcomes"]] == [("01_ok", True)]
    assert again["outcomes"][0]["verdict"]["figures"]["answer"] == 42 and (out / "again.html").is_file()


def test_reports_models_flag_uses_the_default_list(tmp_path, monkeypatch):
    (tmp_path / "01_a.ipynb").write_text("{}")
    seen = []

    def fake(nb, model, params, out):
        seen.append((model, nb.stem, params["device"]))
        return reports.Outcome(model, nb.stem, True, 0.0)

    monkeypatch.setattr(reports, "run_notebook", fake)
    assert reports.main(["--models", "--notebooks", str(tmp_path), "--out", str(tmp_path / "o")]) == 0
    assert seen == [(m, "01_a", "cpu") for m in reports.DEFAULT_MODELS]
