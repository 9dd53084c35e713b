"""Interrupted calls: a KeyboardInterrupt (or an error) injected at every step k of a call (pocketlab.verify.faults)
leaves each of the call's slots as it was (interrupted while validating) or cleanly reset (empty, zeroed state,
owner as before, slots it allocated free again), every
other slot bitwise as it was, the prefix cache consistent, and the engine usable: restoring the state from before
and redoing the call gives the uninterrupted call's result."""

import pytest
import torch
from conftest import random_prompt

from pocketlab import BatchedRequest, SamplingParams, Snapshot
from pocketlab.verify import fuzz
from pocketlab.verify.faults import Faults, InjectedError, InjectedInterrupt, prefix_cache_problems
from pocketlab.verify.graph_doubles import rerun_graphs

P0 = random_prompt(20, seed=1)
P1 = P0[:12] + random_prompt(5, seed=2)  # shares 12 tokens with slot 0: reused from it
P2 = P0[:16] + random_prompt(3, seed=3)

# name -> (call, the slots it touches); slot 2 is free and empty, slots 0 and 1 hold sequences (0 is owned, so
# generate takes slots 1 and 2)
OPS = {
    "prefill": (lambda e, s: e.prefill(P2, slot_id=2), [2]),
    "prefill over a held sequence": (lambda e, s: e.prefill(P0[:16] + [5, 6], slot_id=1), [1]),
    "decode_step": (lambda e, s: e.decode_step(7, slot_id=0), [0]),
    "batch_prefill": (
        lambda e, s: e.batch_prefill([BatchedRequest(8, P2), BatchedRequest(9, P0[:10] + [1], slot_id=1)]),
        [2, 1],
    ),
    "batch_decode_step": (
        lambda e, s: e.batch_decode_step(
            [BatchedRequest(r, [], slot_id=r - 1, generated_tokens=[r + 2]) for r in (1, 2)]
        ),
        [0, 1],
    ),
    "generate": (lambda e, s: e.generate([P0[:8] + [3], [4, 5, 6]], SamplingParams(max_new_tokens=2)), [1, 2]),
    "snapshot": (lambda e, s: e.snapshot(0), []),
    "restore": (lambda e, s: e.restore(s, slot_id=2), [2]),
    "restore from a file": (lambda e, s: e.restore(s, slot_id=1), [1]),
    "reset": (lambda e, s: e.reset(1), [1]),
    "release_slot": (lambda e, s: e.release_slot(0), [0]),
}
PRESETS = {
    "dense": "tiny-qwen3",
    "hybrid": "tiny-qwen3_5",
    "MTP drafts": "tiny-qwen3_5-mtp",
    "hybrid MoE": "tiny-qwen3_5_moe",
}
STEPS = {"interrupts": 0}  # interrupts injected, for the reliability table


def busy(eng):
    """Slots 0 and 1 mid-sequence (1 reuses 12 of 0's tokens), slot 2 free and empty, slot 0 owned."""
    for s in range(eng.num_slots):
        eng.release_slot(s)
    eng.reset()
    eng.allocate_slot(request_id=77)
    eng.prefill(P0, slot_id=0)
    eng.decode_step(11, slot_id=0)
    eng.prefill(P1, slot_id=1)


def results(out):
    """What a call returned, as comparable pieces: tokens and logits."""
    if hasattr(out, "results"):
        return [(r.tokens, r.logits) for r in out.results]
    if hasattr(out, "next_tokens"):
        return [(out.tokens, out.logits)]
    if hasattr(out, "logits"):
        return [(out.tokens, out.logits)]
    if isinstance(out, Snapshot):
        return [(out.tokens, t) for t in out.tensors.values()]
    return [out]


def same_results(a, b):
    for x, y in zip(results(a), results(b), strict=True):
        if isinstance(x, tuple):
            assert x[0] == y[0] and fuzz.close(x[1], y[1])
        else:
            assert x == y


@pytest.fixture(scope="module", params=list(PRESETS))
def engine(request, make_engine):
    extra = dict(speculative_tokens=2) if request.param == "MTP drafts" else {}
    return make_engine(PRESETS[request.param], max_slots=3, max_seq_len=64, prefill_chunk=16, prefix_block=4, **extra)


@pytest.mark.parametrize("op", list(OPS))
def test_interrupt_at_every_step(engine, op, tmp_path):
    call, touched = OPS[op]
    if engine.speculator is not None and op not in ("decode_step", "batch_decode_step"):
        pytest.skip("with drafts only the calls that draft differ (the fuzzer interrupts the others too)")
    busy(engine)
    call(engine, engine.snapshot(0))  # the graphs it replays exist now: a CUDA replay passes no fault point inside
    busy(engine)
    snap = engine.snapshot(0)
    if op == "restore from a file":
        snap.save(tmp_path / "s.safetensors")
        snap = Snapshot.load(tmp_path / "s.safetensors")
    saved = {s: engine.snapshot(s) for s in touched}
    with Faults(engine) as counter:
        want = call(engine, snap)
    want_after = fuzz.fingerprint(engine)
    assert counter.calls >= 3, "the fault points must cover the call"
    for k in range(1, counter.calls + 1):
        busy(engine)
        before = fuzz.fingerprint(engine)
        exc = InjectedInterrupt if k % 2 else InjectedError  # interrupts and ordinary errors alike
        with pytest.raises(exc), Faults(engine, at=k, exc=exc):
            call(engine, snap)
        STEPS["interrupts"] += 1
        after = fuzz.fingerprint(engine)
        for s in range(engine.options.max_slots):
            if s not in touched:
                assert fuzz.same_slot(before[s], after[s]), f"k={k}: slot {s}, not in the call, changed"
            elif not fuzz.same_slot(before[s], after[s]):  # interrupted before it changed anything, or reset
                assert fuzz.cleanly_reset(after[s], before[s][1]), f"k={k}: slot {s} is not cleanly reset"
        assert not prefix_cache_problems(engine.prefix), f"k={k}: {prefix_cache_problems(engine.prefix)}"
        for s, sn in saved.items():  # usable: from the state before, the call gives what it gave uninterrupted
            engine.restore(sn, slot_id=s)
        got = call(engine, snap)
        same_results(got, want)
        for a, b in zip(fuzz.fingerprint(engine)[:-1], want_after[:-1], strict=True):
            assert a[:2] == b[:2] and all(fuzz.close(a[2][n], b[2][n]) for n in b[2]), f"k={k}: redo differs"


def test_interrupted_graph_capture_leaves_no_graph_and_decodes_after(make_engine):
    """CUDA graph capture, on the CPU through RerunGraphs: an interrupt inside a capture leaves no
    half-captured graph, resets the slots of the call, and the next call captures and replays exactly."""
    eng = rerun_graphs(make_engine("tiny-qwen3", max_slots=2, max_seq_len=64))
    ref = make_engine("tiny-qwen3", max_slots=2, max_seq_len=64)
    for e in (eng, ref):
        e.prefill(P0, slot_id=0)
        e.prefill(P1, slot_id=1)
    capture = eng.graphs.capture

    def interrupted(fn):
        fn()  # the warm-up run has written the scratch slot: then the capture is interrupted
        raise InjectedInterrupt("inside the capture")

    eng.graphs.capture = interrupted
    with pytest.raises(InjectedInterrupt):
        eng.decode_step(3, slot_id=1)

    def decode_graphs():  # prompt forwards replay graphs of their own
        return [k for k in eng.graphs.graphs if k[0] == "decode"]

    assert not decode_graphs() and eng.position(1) == 0 and eng.position(0) == len(P0)
    eng.graphs.capture = capture
    eng.prefill(P1, slot_id=1)
    got, want = eng.decode_step(3, slot_id=1), ref.decode_step(3, slot_id=1)
    assert decode_graphs() and got.next_token == want.next_token
    torch.testing.assert_close(got.logits, want.logits, atol=fuzz.TOL, rtol=0)


def test_real_keyboard_interrupt_is_not_swallowed(make_engine):
    """The engine re-raises what interrupted it (a notebook's stop button must stop the cell)."""
    eng = make_engine("tiny-qwen3", max_slots=2, max_seq_len=64)
    with pytest.raises(KeyboardInterrupt), Faults(eng, at=3, exc=KeyboardInterrupt):
        eng.prefill(P0, slot_id=0)


def teardown_module():
    fuzz.STATS["interrupts injected (test_interrupts)"] += STEPS["interrupts"]
    if fuzz.STATS_FILE:
        fuzz.write_stats(fuzz.STATS_FILE)
