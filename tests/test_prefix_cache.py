"""Prefix cache: hits equal cold runs, counts are exact, stale prefixes never leak, memory stays in budget."""

import random

import pytest
import torch
from conftest import DTYPE, LOGIT_TOL, greedy_continue, greedy_run, random_prompt

from pocketlab import BatchedRequest, verify
from pocketlab import prefix_cache as pc
from pocketlab.cache import SlotState
from pocketlab.engine import plan_pieces
from pocketlab.verify import prefix as vprefix
from pocketlab.verify.ttft import ttft

PRESETS = ["tiny-qwen3", "tiny-qwen3_5"]
STRIDE, BLOCK, CHUNK = 8, 4, 16
OPTS = dict(checkpoint_stride=STRIDE, prefix_block=BLOCK, prefill_chunk=CHUNK)
V = 512


def close(a, b):
    tol = LOGIT_TOL * (1 if DTYPE == "float32" else b.abs().max().item())
    return (a.float() - b.float()).abs().max().item() <= tol


# Below float32 a hit and a cold run differ by rounding wherever their forwards were cut differently (a resumed
# prompt, the hybrid's state checkpoints; on CUDA through fla's chunk kernels), enough to flip a random tiny model's
# near-tied tokens; and measured against float32 the bf16 noise hides a state 2% off. The batch-invariant kernels
# make the two the same bits whatever the cuts, so there `check` holds them to that.
EXACT_HITS = dict(batch_invariant=True) if DTYPE != "float32" else {}
HIT_OPTS = OPTS | EXACT_HITS  # every engine whose runs `check` compares


@pytest.fixture(scope="module")
def engines(make_engine):
    """(cached engine, cold reference) per preset, built once; each test starts from reset()."""
    made = {}

    def get(preset, **options):
        key = (preset, tuple(sorted(options.items())))
        if key not in made:
            cold = make_engine(preset, **HIT_OPTS, prefix_cache=False)
            made[key] = (make_engine(preset, **HIT_OPTS, **options), cold)
        eng, cold = made[key]
        eng.reset()
        return eng, cold

    return get


def cold_run(cold, prompt, steps):
    cold.reset()
    return greedy_run(cold, prompt, steps)


def run(eng, prompt, steps, slot):
    r = eng.prefill(prompt, slot_id=slot)
    return (*greedy_continue(eng, r, steps, slot), r.reused_tokens, r.computed_tokens)


def check(eng, cold, prompt, slot, expected_reused, steps=3):
    tokens, logits, reused, computed = run(eng, prompt, steps, slot)
    ref_tokens, ref_logits = cold_run(cold, prompt, steps)
    assert (reused, computed) == (expected_reused, len(prompt) - expected_reused)
    assert tokens == ref_tokens
    assert torch.equal(logits, ref_logits) if EXACT_HITS else close(logits, ref_logits)
    return tokens


def hybrid(eng):
    return eng.prefix.stateful


def nearest(eng, shared, points):
    """What may be reused of `shared` tokens: all of them (dense), or the nearest checkpoint below (hybrid)."""
    return shared if not hybrid(eng) else max([p for p in points if p <= shared], default=0)


def other(tok):
    return (tok + 1) % V


# -- hits equal cold runs, counts exact ------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("where", ["same slot", "other slot"])
@pytest.mark.parametrize("shared", [32, 37])  # on / off the checkpoint stride
def test_hit_equals_cold_run(preset, where, shared, engines):
    eng, cold = engines(preset)
    A = random_prompt(40, seed=1)
    background = random_prompt(12, seed=2)
    bg = [eng.prefill(background, slot_id=3).next_token]
    check(eng, cold, A, 0, 0, steps=2)
    bg.append(eng.decode_step(bg[-1], slot_id=3).next_token)  # another slot runs in between
    prompt = A[:shared] + [other(A[shared])] + random_prompt(6, seed=3)
    slot = 0 if where == "same slot" else 1
    check(eng, cold, prompt, slot, nearest(eng, shared, range(STRIDE, 41, STRIDE)))
    bg.append(eng.decode_step(bg[-1], slot_id=3).next_token)
    assert bg == cold_run(cold, background, 2)[0]


@pytest.mark.parametrize("preset", PRESETS)
def test_next_turn_reuses_the_whole_history(preset, engines):
    eng, cold = engines(preset)
    prompt = random_prompt(21, seed=4)
    for turn in range(3):  # history = prompt + decoded; the live end is exact
        tokens = check(eng, cold, prompt, 2, eng.position(2) if turn else 0, steps=4)
        prompt = prompt + tokens + random_prompt(3, seed=5 + turn)


@pytest.mark.parametrize("preset", PRESETS)
def test_at_least_one_token_is_computed(preset, engines):
    eng, cold = engines(preset)
    A = random_prompt(24, seed=6)
    check(eng, cold, A, 0, 0)
    check(eng, cold, A, 1, nearest(eng, 23, [8, 16, 24]))  # the same prompt again, another slot
    check(eng, cold, A[:1], 0, 0)  # one token: nothing to reuse


def test_cache_off_is_plain_prefill(make_engine):
    on, off = make_engine("tiny-qwen3", **OPTS), make_engine("tiny-qwen3", **OPTS, prefix_cache=False)
    A = random_prompt(30, seed=7)
    for eng in (on, off):
        r = eng.prefill(A, slot_id=0)
        assert (r.reused_tokens, r.computed_tokens) == (0, 30)
    a, b = greedy_run(on, A + [1], 3, slot_id=1), greedy_run(off, A + [1], 3, slot_id=1)
    assert a[0] == b[0] and close(a[1], b[1])
    assert off.prefill(A + [1, 2], slot_id=1).reused_tokens == 0 and off.prefix is None
    assert on.prefill(A + [1, 2], slot_id=1).reused_tokens == 31


def test_cold_prompt_is_bitwise_unchanged_for_dense(make_engine):
    """With nothing to reuse the dense prefill runs the same chunks as with the cache off."""
    on, off = make_engine("tiny-qwen3", **OPTS), make_engine("tiny-qwen3", **OPTS, prefix_cache=False)
    A = random_prompt(37, seed=8)
    assert torch.equal(greedy_run(on, A, 3)[1], greedy_run(off, A, 3)[1])


@pytest.mark.parametrize("preset", PRESETS)
def test_batch_prefill_reuses_per_request(preset, engines):
    eng, cold = engines(preset)
    system = random_prompt(32, seed=9)
    eng.prefill(system + [5], slot_id=0)
    reqs = [BatchedRequest(i, system + random_prompt(3 + i, seed=10 + i), slot_id=1 + i) for i in range(3)]
    before = eng.forward_count
    res = eng.batch_prefill(reqs)
    assert eng.forward_count == before + 1
    assert [r.reused_tokens for r in res.results] == [32] * 3
    for r, req in zip(res.results, reqs, strict=True):
        assert r.next_token == cold_run(cold, req.prompt_tokens, 0)[0][0]


# -- stale prefixes never leak ------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_divergence_at_every_position_of_a_block(preset, engines):
    eng, cold = engines(preset)
    A = random_prompt(32, seed=11)
    eng.prefill(A, slot_id=0)
    for d in range(STRIDE, 2 * STRIDE + 1):  # every position of one stride block (two hash blocks)
        prompt = A[:d] + [other(A[d])] + A[d + 1 :]
        check(eng, cold, prompt, d % 2, nearest(eng, d, [8, 16, 24, 32]), steps=1)


@pytest.mark.parametrize("preset", PRESETS)
def test_reset_forgets_everything(preset, engines):
    eng, cold = engines(preset)
    A = random_prompt(30, seed=12)
    check(eng, cold, A, 0, 0)
    check(eng, cold, A + [3], 1, 30)  # slot 0 held A + decoded tokens: a real hit
    eng.reset(slot_id=1)
    check(eng, cold, A + [3], 1, 30)  # slot 0 still holds A
    eng.reset()
    assert eng.prefix.describe()["used_bytes"] == 0 and not eng.prefix.contents()
    check(eng, cold, A + [3], 1, 0)


@pytest.mark.parametrize("preset", PRESETS)
def test_released_and_overwritten_slots_reuse_only_what_they_hold(preset, engines):
    eng, cold = engines(preset)
    A, B = random_prompt(30, seed=13), random_prompt(20, seed=14)
    tokens = check(eng, cold, A, 0, 0)
    history = A + tokens[:-1]
    eng.release_slot(0)  # rows kept, end state checkpointed
    check(eng, cold, history + [7], 1, len(history))
    check(eng, cold, B, 0, 0)  # the released slot is reused for another prompt
    check(eng, cold, history[:25] + [other(history[25])], 2, nearest(eng, 25, [8, 16, 24, 30]))
    check(eng, cold, B + [9], 3, 20)


@pytest.mark.parametrize("preset", PRESETS)
def test_restore_replaces_what_the_slot_offers(preset, engines):
    eng, cold = engines(preset)
    A, B = random_prompt(30, seed=15), random_prompt(26, seed=16)
    eng.prefill(B, slot_id=1)
    snap_b = eng.snapshot(1)
    eng.prefill(A, slot_id=0)
    eng.restore(snap_b, slot_id=0)  # slot 0 now holds B; A survives as a retained entry
    check(eng, cold, B + [4], 0, 26)
    check(eng, cold, A + [4], 2, 30)


@pytest.mark.parametrize("preset", PRESETS)
def test_rollback_below_a_checkpoint_invalidates_it(preset, engines):
    """A decode-path rollback (as speculative decoding does: restore the state, truncate the tokens) must
    drop the checkpoints above the cut: the truncation alone tells the prefix cache."""
    eng, cold = engines(preset)
    A = random_prompt(40, seed=17)
    eng.prefill(A[:30], slot_id=0)
    snap = eng.snapshot(0)
    eng.prefill(A, slot_id=0)  # checkpoints at 32 and 40 (hybrid)
    cache = eng.cache
    for prefix, bank in (("conv", cache.conv), ("rec", cache.rec), ("x", getattr(cache, "extra", {}))):
        for i, t in bank.items():
            t[0].copy_(snap.tensors[f"{prefix}.{i}"])
    cache.slots[0].truncate(30)
    tok = other(A[30])
    for _ in range(5):
        tok = eng.decode_step(tok, slot_id=0).next_token
    history = cache.slots[0].tokens[:]  # A[:30] + 5 new tokens: differs from A at 30
    assert history[:30] == A[:30] and history[30] != A[30]
    check(eng, cold, history[:33] + [other(history[33])], 1, nearest(eng, 33, [8, 16, 24, 30]))


def test_hash_collisions_are_caught_by_token_comparison(engines, monkeypatch):
    monkeypatch.setattr(pc, "block_hash", lambda prev, block: 42)  # every block chain collides
    eng, cold = engines("tiny-qwen3_5")
    A, B = random_prompt(33, seed=18), random_prompt(33, seed=19)
    check(eng, cold, A, 0, 0)
    check(eng, cold, B, 1, 0)
    check(eng, cold, B[:20] + [1, 2], 2, 16)
    check(eng, cold, A[:27] + [other(A[27])], 3, 24)


# -- memory budget -------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_lru_eviction_under_a_tiny_budget(preset, make_engine, engines):
    _, cold = engines(preset)
    probe = make_engine(preset, **HIT_OPTS)
    prompts = [random_prompt(24, seed=20 + i) for i in range(6)]
    probe.prefill(prompts[0], slot_id=0)
    probe.prefill(prompts[1], slot_id=0)
    entry = [c["bytes"] for c in probe.prefix.contents() if c["kind"] == "entry"][0]
    budget = 2 * entry + entry // 2
    eng = make_engine(preset, **HIT_OPTS, prefix_cache_bytes=budget)
    live = random_prompt(17, seed=30)
    live_tokens = [eng.prefill(live, slot_id=3).next_token]
    for p in prompts[:5]:  # each overwrites slot 0, retaining the one before
        eng.prefill(p, slot_id=0)
        live_tokens.append(eng.decode_step(live_tokens[-1], slot_id=3).next_token)
        assert eng.prefix.used <= budget and sum(c["bytes"] for c in eng.prefix.contents()) == eng.prefix.used
    assert eng.prefix.stats["evicted"] > 0
    assert eng.prefill(prompts[3] + [1], slot_id=1).reused_tokens == 24  # newest retained: kept
    assert eng.prefill(prompts[0] + [1], slot_id=2).reused_tokens == 0  # oldest: evicted
    assert live_tokens == cold_run(cold, live, 5)[0]  # the live slot is untouched
    history = eng.cache.slots[3].tokens[:]
    check(eng, cold, history + [live_tokens[-1]], 3, len(history))  # and offers its whole history


def test_zero_budget_still_reuses_live_slots(make_engine, engines):
    _, cold = engines("tiny-qwen3_5")
    eng = make_engine("tiny-qwen3_5", **HIT_OPTS, prefix_cache_bytes=0)
    A = random_prompt(20, seed=31)
    tokens = check(eng, cold, A, 0, 0)
    check(eng, cold, A + tokens[:-1] + [5], 1, 20 + len(tokens) - 1)  # copied from slot 0's live state
    assert eng.prefix.used == 0 and not eng.prefix.contents()


# -- pieces -----------------------------------------------------------------------------------------
def test_pieces_end_on_stride_multiples():
    assert plan_pieces(0, 40, 16) == [(0, 16), (16, 32), (32, 40)]
    assert plan_pieces(5, 40, 16, stride=8) == [(5, 8), (8, 16), (16, 24), (24, 32), (32, 40)]
    assert plan_pieces(3, 70, 32, stride=64) == [(3, 35), (35, 64), (64, 70)]
    assert plan_pieces(7, 7, 16) == []


def test_common_len_matches_a_plain_loop():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randrange(0, 300)
        a = [rng.randrange(3) for _ in range(n)]
        cut = rng.randrange(0, n + 1)
        b = a[:cut] + [rng.randrange(3) for _ in range(rng.randrange(0, 50))]
        want = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        limit = rng.choice([None, rng.randrange(0, 300)])
        known = rng.randrange(0, 300)
        assert pc.common_len(a, b, limit, known) == (want if limit is None else min(want, limit))


def test_slot_history_reports_the_first_changed_index():
    seen = []

    class Recorder:
        def history_changed(self, slot, first_changed):
            seen.append((slot, first_changed))

    slot = SlotState(2)
    slot.listen(Recorder())
    slot.extend(range(10))
    slot.extend([10, 11])
    slot.truncate(7)
    slot.replace([0, 1, 2, 9])  # shares 3 tokens with the old history
    slot.replace([0, 1, 2, 9])
    slot.truncate(0)
    assert seen == [(2, 0), (2, 10), (2, 7), (2, 3), (2, 4), (2, 0)] and slot.position == 0
    with pytest.raises(ValueError, match="cannot truncate"):
        slot.truncate(1)


def test_history_is_read_only_outside_the_slot_methods(engines):
    """No edit can bypass the prefix cache: a slot's history changes only through SlotState's methods."""
    eng, _ = engines("tiny-qwen3")
    A = random_prompt(12, seed=34)
    eng.prefill(A, slot_id=0)
    tokens = eng.cache.slots[0].tokens
    for edit in (
        lambda: tokens.append(4),
        lambda: tokens.extend([4]),
        lambda: tokens.__setitem__(0, 9),
        lambda: tokens.__delitem__(slice(1, None)),
        lambda: tokens.clear(),
    ):
        with pytest.raises((AttributeError, TypeError)):
            edit()
    assert tokens == A and type(tokens[:2]) is list
    eng.decode_step(5, slot_id=0)
    assert tokens == A + [5] and list(tokens) == A + [5]  # the view follows the history


@pytest.mark.parametrize("preset", PRESETS)
def test_truncation_drops_stale_blocks_and_checkpoints_at_once(preset, engines):
    eng, _ = engines(preset)
    A = random_prompt(40, seed=32)
    eng.prefill(A, slot_id=0)
    eng.prefill(random_prompt(5, seed=33), slot_id=1)  # a lookup: slot 0's blocks are hashed
    prefix = eng.prefix.slots[0]
    assert len(prefix.hashes) == 40 // BLOCK and (not hybrid(eng) or max(prefix.states) == 40)
    assert prefix.tokens is eng.cache.slots[0].tokens  # a live slot prefix reads the slot's history, holds no copy
    eng.cache.slots[0].truncate(30)
    assert len(prefix.hashes) == 30 // BLOCK and all(p <= 30 for p in prefix.states)
    if hybrid(eng):
        assert sorted(prefix.states) == [8, 16, 24]


# -- the verify check and the TTFT measurement --------------------------------------------------------
@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {p: verify.load_pair(p, root=root) for p in PRESETS}


def test_verify_check_passes_and_fails_on_a_broken_cache(pairs, monkeypatch):
    small = dict(requests=6, turns=2, decode_steps=2)
    report = vprefix.prefix_cache(pairs["tiny-qwen3_5"], **small)
    assert report.passed, report.summary
    assert set(report.tables) == {"cases", "stale", "eviction", "workloads"}
    assert report.tables["cases"].reused.sum() > 0 and report.figures["evicted"] > 0
    monkeypatch.setattr(pc.PrefixCache, "_copy_kv", lambda *args: None)  # hits across slots read garbage K/V
    broken = vprefix.prefix_cache(pairs["tiny-qwen3"], **small)
    assert not broken.passed
    assert not broken.tables["cases"].set_index("case").loc["other slot: shared prefix off the stride", "pass"]


def test_ttft_table(pairs):
    df = ttft(pairs["tiny-qwen3"], device="cpu", dtype="float32", prompt_len=48, cached_len=40, repeats=1, warmup=0)
    assert list(df["mode"]) == [
        "cold, cache off",
        "cold, cache on (miss)",
        "hit: same slot",
        "hit: other slot (copy)",
        "hit: released slot",
    ]
    assert list(df.reused) == [0, 0, 40, 40, 40] and list(df.computed) == [48, 48, 8, 8, 8]
    assert (df.ttft_ms > 0).all() and df.speedup_vs_cold.iloc[0] == 1.0


def test_checkpoints_cost_no_extra_forwards(engines):
    """A cold hybrid prompt runs as many forwards with the cache on as off: the layers hand back their state at
    every stride multiple from inside the forward, and each such checkpoint resumes exactly."""
    eng, cold = engines("tiny-qwen3_5")
    prompt = random_prompt(4 * CHUNK + 3, seed=31)
    counts = []
    for e in (eng, cold):
        before = e.forward_count
        e.prefill(prompt)
        counts.append(e.forward_count - before)
    assert counts[0] == counts[1] == -(-len(prompt) // CHUNK)
    assert sorted(eng.prefix.slots[0].states) == list(range(STRIDE, len(prompt), STRIDE)) + [len(prompt)]
    for cut in (STRIDE, 3 * STRIDE, 5 * STRIDE):  # mid-piece and piece-end checkpoints, resumed in another slot
        check(eng, cold, prompt[:cut] + random_prompt(5, seed=cut), 1, cut)
