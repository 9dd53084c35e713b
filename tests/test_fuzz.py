"""Schedule fuzzing (pocketlab.verify.fuzz): random schedules of every call, each slot checked against a solo replay
of its modelled history after every call. 100 deterministic schedules here; `make fuzz` runs 1,000+ from a seed."""

import os
import time

import pytest

from pocketlab import BatchedRequest
from pocketlab.verify import fuzz

SCHEDULES = int(os.environ.get("POCKETLAB_FUZZ_SCHEDULES", 0))

if SCHEDULES:  # make fuzz: every config drawn at random
    TestSchedules = fuzz.EngineMachine.TestCase
    TestSchedules.settings = fuzz.fuzz_settings(SCHEDULES)
else:  # make test: 100 fixed schedules of the fast configs, 4 of the interpreted ones (10-60 s each)
    TestSchedules = fuzz.machine_for([c for c in fuzz.CONFIGS if c not in fuzz.INTERPRETED]).TestCase
    TestSchedules.settings = fuzz.fuzz_settings(100, derandomize=True)
    if fuzz.INTERPRETED:
        TestInterpretedSchedules = fuzz.machine_for(fuzz.INTERPRETED).TestCase
        TestInterpretedSchedules.settings = fuzz.fuzz_settings(4, derandomize=True)
START = 0.0


def setup_module():
    global START
    START = time.time()  # not at import: collection comes long before this module's first test


def teardown_module():
    fuzz.STATS["fuzz seconds"] += round(time.time() - START)
    print("\nfuzz:", dict(fuzz.STATS))
    if fuzz.STATS_FILE:
        fuzz.write_stats(fuzz.STATS_FILE)


# -- bugs the fuzzer found, kept as plain regression tests ------------------------------------------------------
def test_batch_prefill_gives_each_request_the_slot_its_prompt_went_to(make_engine):
    """Slot 0 allocated, slot 1 named by a request: the request without a slot was prefilled into slot 2 but
    given slot 1 (allocate_slot took the first free slot, a named one included), so its decode ran on
    another sequence. Minimal schedule as the fuzzer shrank it: allocate_slot(); batch_prefill([(None, p), (1, q)])."""
    eng = make_engine("tiny-qwen3", max_slots=3)
    eng.allocate_slot(request_id=5)
    reqs = [BatchedRequest(1, [4, 5, 6]), BatchedRequest(2, [7], slot_id=1)]
    eng.batch_prefill(reqs)
    assert reqs[0].slot_id == 2 and eng.cache.slots[2].owner == 1 and eng.cache.slots[2].tokens == [4, 5, 6]
    assert eng.cache.slots[1].owner is None and eng.cache.slots[1].tokens == [7]


def test_generate_with_every_slot_taken_is_refused_not_a_hang(make_engine):
    """generate() waited forever for a slot when every slot had an owner; now it says so."""
    eng = make_engine("tiny-qwen3", max_slots=2)
    eng.allocate_slot(1)
    eng.allocate_slot(2)
    with pytest.raises(ValueError, match="slots are taken"):
        eng.generate([[1, 2, 3]])
