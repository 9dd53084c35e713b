"""Schedule fuzzing (pocketlab.verify.fuzz): random schedules of every call, each slot checked against a solo replay
of its modelled history after every call. 100 deterministic schedules here; `make fuzz` runs 1,000+ from a seed."""

import os

from pocketlab.verify import fuzz

SCHEDULES = int(os.environ.get("POCKETLAB_FUZZ_SCHEDULES", 0))

TestSchedules = fuzz.EngineMachine.TestCase
TestSchedules.settings = fuzz.fuzz_settings(SCHEDULES or 100, derandomize=not SCHEDULES)


def teardown_module():
    print("\nfuzz:", dict(fuzz.STATS))
    if fuzz.STATS_FILE:
        fuzz.write_stats(fuzz.STATS_FILE)
