"""Bad input gets a clear error and leaves every slot exactly as it was."""

import pytest
from conftest import assert_same_state, engine_state, random_prompt

from pocketlab import BatchedRequest


@pytest.fixture(params=["tiny-qwen3", "tiny-qwen3_5"])
def busy_engine(make_engine, request):
    """Two slots mid-sequence, one allocated to a request, one free slot, max_seq_len 64."""
    engine = make_engine(request.param, max_slots=3, max_seq_len=64)
    engine.allocate_slot(request_id=7)
    engine.prefill(random_prompt(10, 1), slot_id=0)
    engine.prefill(random_prompt(20, 2), slot_id=1)
    engine.decode_step(5, slot_id=1)
    return engine


CASES = {
    "out-of-vocab prompt token": (ValueError, "outside the vocabulary", lambda e: e.prefill([1, 512], slot_id=2)),
    "negative token": (ValueError, "outside the vocabulary", lambda e: e.prefill([-1], slot_id=0)),
    "out-of-vocab decode token": (ValueError, "outside the vocabulary", lambda e: e.decode_step(10**6, slot_id=0)),
    "non-integer token": (ValueError, "outside the vocabulary", lambda e: e.prefill([1.5], slot_id=0)),
    "empty prompt": (ValueError, "empty", lambda e: e.prefill([], slot_id=0)),
    "slot beyond allocated": (IndexError, "does not exist", lambda e: e.prefill([1], slot_id=3)),
    "negative slot": (IndexError, "does not exist", lambda e: e.decode_step(1, slot_id=-1)),
    "decode before prefill": (ValueError, "prefill it before", lambda e: e.decode_step(1, slot_id=2)),
    "prompt past max_seq_len": (ValueError, "max_seq_len", lambda e: e.prefill(list(range(65)), slot_id=2)),
    "decode past max_seq_len": (ValueError, "max_seq_len", lambda e: [e.decode_step(1, slot_id=1) for _ in range(64)]),
    "duplicate slot in batch": (
        ValueError,
        "more than once",
        lambda e: e.batch_prefill([BatchedRequest(1, [1, 2], slot_id=2), BatchedRequest(2, [3], slot_id=2)]),
    ),
    "bad token in second request": (
        ValueError,
        "request 2 prompt",
        lambda e: e.batch_prefill([BatchedRequest(1, [1, 2], slot_id=2), BatchedRequest(2, [3, 9999])]),
    ),
    "batch decode with an empty slot": (
        ValueError,
        "prefill it before",
        lambda e: e.batch_decode_step(
            [
                BatchedRequest(1, [1], slot_id=0, generated_tokens=[4]),
                BatchedRequest(2, [1], slot_id=2, generated_tokens=[4]),
            ]
        ),
    ),
    "batch decode before batch prefill": (
        ValueError,
        "no token to decode",
        lambda e: e.batch_decode_step([BatchedRequest(1, [1], slot_id=0)]),
    ),
    "all slots taken": (ValueError, "slots are taken", lambda e: [e.allocate_slot(i) for i in range(3)]),
    "batch needs more slots than free": (
        ValueError,
        "free",
        lambda e: e.batch_prefill([BatchedRequest(i, [1]) for i in range(3)]),
    ),
    "too many batch slots": (ValueError, "max_slots", lambda e: e.allocate_batch_slots(4)),
    "restore into a missing slot": (IndexError, "does not exist", lambda e: e.restore(e.snapshot(0), slot_id=5)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_and_changes_nothing(case, busy_engine):
    exc, message, call = CASES[case]
    before = engine_state(busy_engine)
    with pytest.raises(exc, match=message):
        call(busy_engine)
    if case in ("decode past max_seq_len", "all slots taken"):  # the calls before the failing one did run
        return
    assert_same_state(before, engine_state(busy_engine))


def test_overflowing_decode_fails_at_the_limit_and_keeps_state(busy_engine):
    while busy_engine.position(1) < 64:
        busy_engine.decode_step(1, slot_id=1)
    before = engine_state(busy_engine)
    with pytest.raises(ValueError, match="max_seq_len"):
        busy_engine.decode_step(1, slot_id=1)
    assert_same_state(before, engine_state(busy_engine))


def test_all_slots_taken_keeps_state(busy_engine):
    busy_engine.allocate_slot(8)
    busy_engine.allocate_slot(9)
    before = engine_state(busy_engine)
    with pytest.raises(ValueError, match="slots are taken"):
        busy_engine.allocate_slot(10)
    assert_same_state(before, engine_state(busy_engine))
