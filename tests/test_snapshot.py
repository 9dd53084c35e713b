"""Snapshots: continuing from a restored snapshot equals continuing the original, in any slot, via a file."""

import pytest
import torch
from conftest import assert_same_state, engine_state, random_prompt

from pocketlab import Snapshot


def continue_greedy(engine, slot, token, steps):
    tokens, logits = [], []
    for _ in range(steps):
        r = engine.decode_step(token, slot_id=slot)
        token = r.next_token
        tokens.append(token)
        logits.append(r.logits)
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3_5", "tiny-qwen3_5_moe"])
@pytest.mark.parametrize("target", ["same slot", "other slot", "file"])
def test_restored_snapshot_continues_identically(preset, target, make_engine, tmp_path):
    engine = make_engine(preset)
    r = engine.prefill(random_prompt(37, seed=5), slot_id=1)
    first, _ = continue_greedy(engine, 1, r.next_token, 5)
    snap = engine.snapshot(1)
    expected = continue_greedy(engine, 1, first[-1], 12)
    engine.prefill(random_prompt(9, seed=6), slot_id=2)  # other traffic in between
    slot = {"same slot": 1, "other slot": 3, "file": 0}[target]
    if target == "file":
        snap.save(tmp_path / "snap.safetensors")
        snap = Snapshot.load(tmp_path / "snap.safetensors")
    engine.restore(snap, slot_id=slot)
    assert engine.position(slot) == 37 + 5
    got = continue_greedy(engine, slot, first[-1], 12)
    assert got[0] == expected[0]
    assert torch.equal(got[1], expected[1])


def test_snapshot_from_another_model_is_refused(make_engine):
    dense, hybrid = make_engine("tiny-qwen3"), make_engine("tiny-qwen3_5")
    hybrid.prefill([1, 2, 3], slot_id=0)
    before = engine_state(dense)
    with pytest.raises(ValueError, match="snapshot"):
        dense.restore(hybrid.snapshot(0), slot_id=0)
    assert_same_state(before, engine_state(dense))


def test_file_without_metadata_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="not a pocketlab snapshot"):
        Snapshot.load(tmp_path / "x.safetensors")
