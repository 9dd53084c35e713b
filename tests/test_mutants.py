"""The verification suite can fail: every check fails each engine mutant it targets and passes the correct
engine (pocketlab.verify.mutants). Notebook 07 shows the whole matrix on tiny Qwen3; here the targeted cells:
on the hybrid model (where the recurrent-state mutants apply) in float32, the bitwise batch-invariance check on
tiny Qwen3, and the calibrated bf16 verdicts of the isolation and batch checks."""

import pandas as pd
import pytest
from conftest import DEVICE, DTYPE

from pocketlab.layers.gated_delta import backend_name
from pocketlab.layers.moe import SparseMoE
from pocketlab.models.qwen3 import Attention
from pocketlab.verify import load_pair
from pocketlab.verify.mutants import CHECKS, EXPLAINED, MUTANTS, applies, catch_matrix

FAST = tuple(c for c in CHECKS if c != "invariance")  # invariance runs in notebook 07 (Triton's interpreter)
DENSE = [m for m in MUTANTS.values() if m.needs != "moe"]  # the mutants whose code runs in a model without experts


def _assert_all_caught(r):
    cells = r.tables["cells"]
    with pd.option_context("display.width", 250, "display.max_columns", 20):
        shown = f"\n{r.tables['matrix'].to_string()}\n{r.summary.to_string()}"
    correct = cells[cells.mutant == "(correct engine)"]
    assert correct.passed.all(), "the correct engine fails a check" + shown
    targeted = cells[(cells.mutant != "(correct engine)") & cells.targeted & cells.passed.notna()]
    missed = targeted[targeted.passed.astype(bool) & (targeted.explained == "")]
    assert missed.empty, f"missed: {list(zip(missed.mutant, missed.check, strict=True))}" + shown
    assert r.passed, shown
    return targeted


@pytest.fixture(scope="module")
def hybrid():
    return load_pair("tiny-qwen3_5", device=DEVICE)


def test_every_check_fails_every_mutant_it_targets_and_passes_the_correct_engine(hybrid):
    checks = FAST
    if DTYPE == "float32" and backend_name(DEVICE) == "fla":  # as in test_parity: no 1e-4 reference there
        checks = tuple(c for c in FAST if c != "parity")  # HF's float32 Qwen3.5 runs fla's TF32 chunk kernels
    mine = tuple(m.name for m in DENSE if set(m.targets) & set(checks))
    r = catch_matrix(hybrid, checks=checks, slots=2, mutants=mine, full=False)
    targeted = _assert_all_caught(r)
    # every mutant is targeted by at least one check that ran here, so none is silently out of reach
    want = {(m, c) for m in mine for c in MUTANTS[m].targets if c in checks and applies(MUTANTS[m], c, hybrid)}
    assert set(zip(targeted.mutant, targeted.check, strict=True)) == want
    assert {m for m, _ in want} == set(mine)
    eff = r.tables["effects"].set_index("mutant")
    assert (eff.first_changed_step != "(none)").all(), eff  # each mutant changes something in one step ...
    logit_bugs = eff.drop(index="sampling_by_row")
    assert (logit_bugs.rel_effect > 0).all()  # ... the logits (sampling_by_row: only the drawn token)
    assert eff.loc["sampling_by_row", "token_changed"]


def test_the_bitwise_batch_invariance_check_catches_its_mutants():
    """Tiny Qwen3 in the batch-invariant mode (Triton's interpreter on the CPU): a slot bug, the shared position
    and a matmul whose split-K follows the batch, a last-bit change (relative effect ~1e-6) only bits can see."""
    mine = tuple(m.name for m in DENSE if "invariance" in m.targets)
    r = catch_matrix(load_pair("tiny-qwen3", device=DEVICE), checks=("invariance",), slots=2, mutants=mine, full=False)
    assert len(_assert_all_caught(r)) == len(mine) == 3
    assert r.tables["effects"].set_index("mutant").loc["split_k_by_batch", "rel_effect"] < 1e-4


def test_calibrated_bf16_isolation_and_batch_verdicts_catch_their_mutants():
    """In bf16 the bound is 2 x the engine's own |bf16 - fp32| per step: tight enough to catch each mutant."""
    bf16 = load_pair("tiny-qwen3", device=DEVICE, dtype="bfloat16")
    mine = tuple(m.name for m in DENSE if {"isolation", "batch_api"} & set(m.targets))
    r = catch_matrix(bf16, checks=("isolation", "batch_api"), slots=2, mutants=mine, full=False)
    assert len(_assert_all_caught(r)) == 4


def test_the_checks_catch_a_capacity_limited_router_on_an_moe_model():
    """Tiny Qwen3-MoE: HF parity sees the pairs a prompt's forward drops, the batch check sees a token's output
    follow its batch; on a dense model the mutant is n/a, not a pass."""
    r = catch_matrix(
        "tiny-qwen3_moe", checks=("parity", "batch_api"), slots=2, mutants=("expert_capacity",), full=False
    )
    assert set(_assert_all_caught(r).check) == {"parity", "batch_api"}
    assert r.tables["effects"].set_index("mutant").loc["expert_capacity", "rel_effect"] > 0
    dense = catch_matrix("tiny-qwen3", checks=("batch_api",), slots=2, mutants=("expert_capacity",), full=False)
    assert dense.tables["cells"].set_index("mutant").loc["expert_capacity", "detail"] == "n/a"


def test_every_mutant_is_targeted_by_a_check():
    assert all(m.targets and set(m.targets) <= set(CHECKS) for m in MUTANTS.values())


def test_mutants_leave_the_engine_as_it_was():
    before, moe_before = Attention.__dict__["__call__"], SparseMoE.__dict__["__call__"]
    for m in MUTANTS.values():
        with m.install():
            pass
    assert Attention.__dict__["__call__"] is before and SparseMoE.__dict__["__call__"] is moe_before
    with pytest.raises(RuntimeError), MUTANTS["kv_other_slot"].install():
        raise RuntimeError("a failing check")
    assert Attention.__dict__["__call__"] is before


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown checks or mutants"):
        catch_matrix("tiny-qwen3", checks=("parity", "nope"))
    with pytest.raises(ValueError, match="full="):
        catch_matrix("tiny-qwen3", full="some")
    with pytest.raises(ValueError, match="at least 2"):
        catch_matrix("tiny-qwen3", slots=1)
    assert all(c in CHECKS for _, c in EXPLAINED)


def test_a_16_bit_miss_is_explained_only_where_the_bitwise_check_caught_it():
    """BELOW_16_BIT_NOISE excuses a default-mode miss in bf16/fp16 only, and only once invariance caught it."""
    from types import SimpleNamespace

    from pocketlab.verify.mutants import _explanation

    miss = SimpleNamespace(mutant="shared_position", check="batch_api")
    for caught_bitwise in (False, True):
        cells = pd.DataFrame([dict(check="invariance", mutant="shared_position", passed=not caught_bitwise)])
        assert _explanation(miss, cells, "float32") == ""
        assert bool(_explanation(miss, cells, "bfloat16")) == caught_bitwise
    other = SimpleNamespace(mutant="kv_other_slot", check="batch_api")
    assert (
        _explanation(other, pd.DataFrame([dict(check="invariance", mutant="kv_other_slot", passed=False)]), "bfloat16")
        == ""
    )
