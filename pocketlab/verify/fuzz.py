"""Schedule fuzzing: a hypothesis state machine drives random schedules of every slot-API call against one engine.

The model: each slot's token history and owner, the allocated slot count, the snapshots taken. The oracle, after
every call: each allocated slot holds exactly its modelled history and owner, and its cache state (K/V, conv,
recurrent) equals a fresh solo replay of that history in a reference engine (one slot, no prefix cache, no drafts;
float32 tolerance), so its next-token logits do too; every logits a call returns equal the replay's, and every
greedy token is the replay's argmax. A call the model says is invalid must raise ValueError or IndexError and
change nothing, bitwise. A call interrupted by an injected fault (`faults.Faults`) must leave its slots cleanly
reset and every other slot bitwise as it was. Three configs replay decode (or verify and draft) steps and short
prompts from (re-run) CUDA graphs: padded to their buckets, the replays must match the solo eager replays too.
Hypothesis shrinks a failing schedule to a minimal list of calls and keeps it in its example database
(.hypothesis/), so the next run tries it first.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, cast

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ..cache import Snapshot
from ..config import EngineOptions
from ..engine import QwenEngine
from ..requests import BatchedRequest
from ..sampling import SamplingParams
from ..tools.synthetic import ensure_checkpoint
from .common import checkpoint_root, tolerance
from .faults import Faults, InjectedInterrupt, prefix_cache_problems
from .graph_doubles import rerun_graphs

TOL = tolerance("float32").atol
VOCAB, MAX_SLOTS, MAX_SEQ = 512, 3, 40
# small budgets so that prefix reuse, retention, eviction and hybrid checkpoints all happen in short schedules
OPTIONS: dict[str, Any] = dict(
    max_slots=MAX_SLOTS,
    max_seq_len=MAX_SEQ,
    prefill_chunk=8,
    prefix_block=4,
    checkpoint_stride=8,
    prefix_cache_bytes=1 << 16,
    device="cpu",
    dtype="float32",
)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("tiny-qwen3", {}),
    "dense, no prefix cache": ("tiny-qwen3", dict(prefix_cache=False)),
    "hybrid": ("tiny-qwen3_5", {}),
    "hybrid, no prefix cache": ("tiny-qwen3_5", dict(prefix_cache=False)),
    "hybrid + MTP drafts": ("tiny-qwen3_5-mtp", dict(speculative_tokens=2)),
    "hybrid + MTP drafts, no prefix cache": ("tiny-qwen3_5-mtp", dict(speculative_tokens=2, prefix_cache=False)),
    "MoE": ("tiny-qwen3_moe", {}),
    "hybrid MoE + MTP drafts": ("tiny-qwen3_5_moe-mtp", dict(speculative_tokens=2)),
    "dense, graphed prompts and decode": ("tiny-qwen3", dict(prefill_graph_tokens=48, decode_ahead=True)),
    "hybrid, graphed prompts and decode": ("tiny-qwen3_5", dict(prefill_graph_tokens=48, decode_ahead=True)),
    "hybrid + MTP drafts, graphed": ("tiny-qwen3_5-mtp", dict(speculative_tokens=2, prefill_graph_tokens=48)),
}
# engines with prompt graphs: their CUDA graphs are graph_doubles.SharedPoolGraphs (each replay spoils the others)
GRAPHED = {name for name, (_, extra) in CONFIGS.items() if extra.get("prefill_graph_tokens")}
INTERPRETED: list[str] = []  # configs whose Triton kernels run in Triton's interpreter: far slower schedules
if os.environ.get("TRITON_INTERPRET") == "1":  # the in-place Triton kernels run on the CPU in Triton's interpreter
    CONFIGS["hybrid, in-place kernels"] = ("tiny-qwen3_5", dict(linear_decode="triton", linear_in_place_tokens=8))
    INTERPRETED.append("hybrid, in-place kernels")
# prompts share prefixes of a few base sequences, so the prefix cache has something to find
BASES = [torch.randint(0, VOCAB, (MAX_SEQ,), generator=torch.Generator().manual_seed(b)).tolist() for b in range(3)]
STATS: Counter = Counter()  # what the fuzz runs did: schedules, calls, refused, interrupted, checks


class Oracle:
    """Solo replays of token histories in a reference engine, memoized (LRU): (next-token logits, slot tensors)."""

    memo: OrderedDict[tuple[int, ...], tuple[torch.Tensor | None, dict[str, torch.Tensor]]]

    def __init__(self, preset: str, size: int = 4096):
        opts = EngineOptions(**(OPTIONS | dict(max_slots=1, prefill_chunk=MAX_SEQ, prefix_cache=False)))
        self.engine, self.memo, self.size = (
            QwenEngine.from_pretrained(ensure_checkpoint(preset, checkpoint_root()), opts),
            OrderedDict(),
            size,
        )

    def replay(self, history: list[int]) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        key = tuple(history)
        if key in self.memo:
            self.memo.move_to_end(key)
            return self.memo[key]
        self.engine.reset(0)
        logits = self.engine.prefill(list(history)).logits.clone() if history else None
        self.memo[key] = logits, {k: v.clone() for k, v in self.engine.snapshot(0).tensors.items()}
        if len(self.memo) > self.size:
            self.memo.popitem(last=False)
        return self.memo[key]


_POOL: dict[str, tuple[QwenEngine, Oracle]] = {}


def engines(config: str) -> tuple[QwenEngine, Oracle]:
    """The engine under test and its oracle for a config, built once per process (a schedule starts by clearing)."""
    if config not in _POOL:
        preset, extra = CONFIGS[config]
        eng = QwenEngine.from_pretrained(
            ensure_checkpoint(preset, checkpoint_root()), EngineOptions(**(OPTIONS | extra))
        )
        _POOL[config] = rerun_graphs(eng) if config in GRAPHED else eng, Oracle(preset)
    return _POOL[config]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (a.numel() == 0 or float((a - b).abs().max()) <= TOL * max(1.0, float(b.abs().max())))


def fingerprint(eng: QwenEngine) -> list:
    """Everything each slot holds (history, owner, every cache tensor) and the allocated count: compared bitwise."""
    slots = [
        (list(eng.cache.slots[s].tokens), eng.cache.slots[s].owner, eng.cache.snapshot(s).tensors)
        for s in range(eng.options.slot_count)
    ]
    return slots + [eng.num_slots]


def prefix_summary(prefix) -> tuple | None:
    """What the prefix cache holds, in numbers: entries, checkpoints, bytes, indexed blocks."""
    if prefix is None:
        return None
    held = [(p.slot, len(p.tokens), pos, n) for (p, pos), n in prefix.lru.items()]
    return len(prefix.entries), held, prefix.used, sorted(map(len, prefix.index.values()))


def same_slot(a, b) -> bool:
    return a[:2] == b[:2] and a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2])


def cleanly_reset(slot, owner) -> bool:
    """A fingerprinted slot is empty, its owner is `owner` and its state (all but the masked K/V rows) is zero."""
    tokens, now, tensors = slot
    state = [t for n, t in tensors.items() if not n.startswith(("k.", "v."))]
    return tokens == [] and now == owner and not any(t.any() for t in state)


def prompt(base: int, shared: int, tail: list[int]) -> list[int]:
    return BASES[base][:shared] + tail


PROMPTS = st.builds(
    prompt, st.integers(0, 2), st.integers(0, MAX_SEQ - 4), st.lists(st.integers(0, VOCAB - 1), max_size=6)
)
SLOTS = st.integers(0, 3 * MAX_SLOTS).map(
    lambda x: x % MAX_SLOTS if x < 3 * MAX_SLOTS else MAX_SLOTS
)  # 10%: no such slot
# a fault at step k of the call in about one call of four (shrinks towards none)
FAULTS = st.tuples(st.integers(0, 3), st.integers(1, 60)).map(lambda t: t[1] if t[0] == 3 else None)
BAD_CALLS = ("token outside vocab", "decode token outside vocab", "foreign snapshot", "tampered file", "no token")


class EngineMachine(RuleBasedStateMachine):
    """One schedule: a config, then calls; the model follows each call, the invariant checks every slot after it."""

    hist: list[list[int]]  # each slot's token history
    owner: list[int | None]  # each slot's owning request id

    @initialize(config=st.sampled_from(list(CONFIGS)))
    def start(self, config):
        self.config = config
        self.eng, self.oracle = engines(config)
        self.eng.allocate_batch_slots(MAX_SLOTS)
        for s in range(MAX_SLOTS):
            self.eng.release_slot(s)
        self.eng.reset()
        self.n, self.hist, self.owner = MAX_SLOTS, [[] for _ in range(MAX_SLOTS)], [None] * MAX_SLOTS
        self.last: list[int | None] = [None] * MAX_SLOTS  # each slot's predicted next token
        self.snaps: list[tuple[Snapshot, list[int]]] = []
        self.request = 100
        self.dir = Path(tempfile.mkdtemp(prefix="pocketlab-fuzz-"))
        STATS["schedules"] += 1
        STATS[f"schedules: {config}"] += 1

    def teardown(self):
        for f in getattr(self, "dir", Path("/nonexistent")).glob("*"):
            f.unlink()

    # -- the model's helpers -----------------------------------------------------------------------------
    def valid_slot(self, s) -> bool:
        return s is not None and 0 <= s < self.n

    def free(self) -> list[int]:
        return [s for s in range(self.n) if self.owner[s] is None]

    def prompt_ok(self, p: list[int]) -> bool:
        return 1 <= len(p) <= MAX_SEQ

    def expect(self, history: list[int], logits: torch.Tensor, token: int) -> None:
        """Returned logits equal the solo replay's; the (greedy) token is its argmax (up to a tie within TOL)."""
        ref = self.oracle.replay(history)[0]
        assert ref is not None  # every caller passes a non-empty history (a valid prompt, or one extended by a token)
        assert close(logits.float().cpu(), ref), f"logits after {len(history)} tokens diverge from the solo replay"
        self.greedy(history, token)

    def greedy(self, history: list[int], token: int) -> None:
        ref = self.oracle.replay(history)[0]
        assert ref is not None  # every caller passes a non-empty history (a valid prompt, or one extended by a token)
        assert float(ref[token]) >= float(ref.max()) - 2 * TOL, f"token {token} is not the replay's argmax"

    def refused(self, call) -> None:
        """A call the model says is invalid: a ValueError/IndexError, and nothing changed."""
        before, cache = fingerprint(self.eng), prefix_summary(self.eng.prefix)
        try:
            call()
        except (ValueError, IndexError):
            STATS["refused"] += 1
        else:
            raise AssertionError("the engine accepted a call the model says is invalid")
        after = fingerprint(self.eng)
        unchanged = all(same_slot(a, b) for a, b in zip(before[:-1], after[:-1], strict=True))
        assert unchanged and before[-1] == after[-1], "a refused call changed state"
        assert prefix_summary(self.eng.prefix) == cache, "a refused call changed the prefix cache"

    def run(self, call, touched: list[int], fault: int | None):
        """(True, call()) or, when the injected fault interrupted it, (False, None) after checking that every slot
        but `touched` is bitwise as before; the model then resets `touched`."""
        STATS["calls"] += 1
        before = fingerprint(self.eng) if fault else None
        with Faults(self.eng, at=fault):
            try:
                return True, call()
            except InjectedInterrupt:
                pass
        STATS["interrupted"] += 1
        assert before is not None  # only a fault (then `before` was taken) interrupts a call
        after = fingerprint(self.eng)
        for s in range(MAX_SLOTS):
            if same_slot(before[s], after[s]):  # not touched, or interrupted before it changed anything
                continue
            assert s in touched, f"an interrupted call changed slot {s}, which it did not touch"
            assert cleanly_reset(after[s], before[s][1]), f"interrupted: slot {s} neither as before nor reset"
            self.hist[s], self.last[s] = [], None
        return False, None

    # -- the calls -----------------------------------------------------------------------------------------
    @rule(slot=SLOTS, p=PROMPTS, fault=FAULTS)
    def prefill(self, slot, p, fault):
        if not (self.valid_slot(slot) and self.prompt_ok(p)):
            return self.refused(lambda: self.eng.prefill(p, slot_id=slot))
        done, r = self.run(lambda: self.eng.prefill(p, slot_id=slot), [slot], fault)
        if done:
            self.hist[slot], self.last[slot] = list(p), r.next_token
            self.expect(p, r.logits, r.next_token)

    def live(self, pick: int) -> int:
        """Mostly (9 picks in 10) a slot that can decode, when there is one: else any slot, or none that exists."""
        ready = [s for s in range(self.n) if self.hist[s] and len(self.hist[s]) < MAX_SEQ]
        return ready[pick % len(ready)] if ready and pick < 9 else pick % (MAX_SLOTS + 1)

    @rule(pick=st.integers(0, 9), token=st.one_of(st.none(), st.integers(0, VOCAB - 1)), fault=FAULTS)
    def decode_step(self, pick, token, fault):
        slot = self.live(pick)
        token = self.last[slot] if token is None and self.valid_slot(slot) and self.last[slot] is not None else token
        token = 0 if token is None else token
        if not (self.valid_slot(slot) and self.hist[slot] and len(self.hist[slot]) < MAX_SEQ):
            return self.refused(lambda: self.eng.decode_step(token, slot_id=slot))
        done, r = self.run(lambda: self.eng.decode_step(token, slot_id=slot), [slot], fault)
        if done:
            self.advance(slot, token, r.tokens, r.logits)

    def advance(self, slot: int, token: int, emitted: list[int], logits: torch.Tensor) -> None:
        """A decode step fed `token` and produced `emitted` (speculative: accepted drafts, then the target's)."""
        h = self.hist[slot] + [token]
        for t in emitted[:-1]:  # accepted drafts are what plain greedy decoding would have produced
            self.greedy(h, t)
            h = h + [t]
        self.hist[slot], self.last[slot] = h, emitted[-1]
        self.expect(h, logits, emitted[-1])

    @rule(reqs=st.lists(st.tuples(st.one_of(st.none(), SLOTS), PROMPTS), min_size=1, max_size=3), fault=FAULTS)
    def batch_prefill(self, reqs, fault):
        explicit = [s for s, _ in reqs if s is not None]
        free = iter(s for s in self.free() if s not in explicit)
        chosen = [s if s is not None else next(free, None) for s, _ in reqs]
        ok = (
            None not in chosen
            and all(self.valid_slot(s) for s in chosen)
            and len(set(chosen)) == len(chosen)
            and all(self.prompt_ok(p) for _, p in reqs)
        )
        requests = [BatchedRequest(self.request + i, list(p), slot_id=s) for i, (s, p) in enumerate(reqs)]
        self.request += len(reqs)
        if not ok:
            return self.refused(lambda: self.eng.batch_prefill(requests))
        done, out = self.run(lambda: self.eng.batch_prefill(requests), cast(list[int], chosen), fault)
        if not done:
            kept = [r.slot_id for r, (s, _) in zip(requests, reqs, strict=True) if r.slot_id != s]
            assert not kept, f"an interrupted batch kept its allocations {kept}"
            return
        for r, s, (given, p), res in zip(requests, cast(list[int], chosen), reqs, out.results, strict=True):
            assert r.slot_id == s, f"request {r.request_id} was prefilled in slot {s} but given slot {r.slot_id}"
            if given is None:
                self.owner[s] = r.request_id
            self.hist[s], self.last[s] = list(p), res.next_token
            self.expect(p, res.logits, res.next_token)

    @rule(picks=st.lists(st.integers(0, 9), min_size=1, max_size=3), fault=FAULTS)
    def batch_decode_step(self, picks, fault):
        slots = list(dict.fromkeys(self.live(p) for p in picks))  # duplicates: test_errors
        ok = len(set(slots)) == len(slots) and all(
            self.valid_slot(s) and self.hist[s] and len(self.hist[s]) < MAX_SEQ for s in slots
        )
        toks = [cast(int, self.last[s]) if self.valid_slot(s) and self.last[s] is not None else 1 for s in slots]
        requests = [
            BatchedRequest(self.request + i, [], slot_id=s, generated_tokens=[t])
            for i, (s, t) in enumerate(zip(slots, toks, strict=True))
        ]
        self.request += len(slots)
        if not ok:
            return self.refused(lambda: self.eng.batch_decode_step(requests))
        done, out = self.run(lambda: self.eng.batch_decode_step(requests), slots, fault)
        if done:
            for b, (s, t) in enumerate(zip(slots, toks, strict=True)):
                self.advance(s, t, out.tokens[b], out.logits[b])

    @rule(prompts=st.lists(PROMPTS, min_size=1, max_size=3), new=st.integers(0, 4), fault=FAULTS)
    def generate(self, prompts, new, fault):
        free = self.free()
        if not (free and all(1 <= len(p) < MAX_SEQ for p in prompts)):
            return self.refused(lambda: self.eng.generate(prompts, SamplingParams(max_new_tokens=new)))
        used = free[: len(prompts)] if new else []
        done, outs = self.run(lambda: self.eng.generate(prompts, SamplingParams(max_new_tokens=new)), used, fault)
        if not done:
            assert all(self.eng.cache.slots[s].owner is None for s in used), "an interrupted generate kept its slots"
            return
        for s in used:  # released when their requests finished
            self.hist[s], self.last[s] = [], None
        for p, out in zip(prompts, outs, strict=True):
            if not self.eng.speculator:
                assert len(out) == min(new, MAX_SEQ - len(p)), f"generated {len(out)} tokens, not {new}"
            assert len(out) <= new
            for i, t in enumerate(out):
                self.greedy(p + out[:i], t)

    @rule(slot=st.one_of(st.none(), SLOTS), fault=FAULTS)
    def reset(self, slot, fault):
        if slot is not None and not self.valid_slot(slot):
            return self.refused(lambda: self.eng.reset(slot))
        touched = list(range(self.n)) if slot is None else [slot]
        self.run(lambda: self.eng.reset(slot), touched, fault)
        for s in touched:
            self.hist[s], self.last[s] = [], None

    @rule(slot=SLOTS, fault=FAULTS)
    def release_slot(self, slot, fault):
        if not self.valid_slot(slot):
            return self.refused(lambda: self.eng.release_slot(slot))
        done, _ = self.run(lambda: self.eng.release_slot(slot), [slot], fault)
        self.hist[slot], self.last[slot] = [], None
        if done:
            self.owner[slot] = None

    @rule()
    def allocate_slot(self):
        if not self.free():
            return self.refused(lambda: self.eng.allocate_slot(self.request))
        STATS["calls"] += 1
        s = self.eng.allocate_slot(self.request)
        assert s == self.free()[0], f"allocated slot {s}, not the first free one"
        self.owner[s], self.request = self.request, self.request + 1

    @rule(n=st.integers(0, MAX_SLOTS + 1))
    def allocate_batch_slots(self, n):
        if not 1 <= n <= MAX_SLOTS:
            return self.refused(lambda: self.eng.allocate_batch_slots(n))
        STATS["calls"] += 1
        self.eng.allocate_batch_slots(n)
        for s in range(n, self.n):
            self.hist[s], self.owner[s], self.last[s] = [], None, None
        self.n = n

    @rule(slot=SLOTS, fault=FAULTS)
    def snapshot(self, slot, fault):
        if not self.valid_slot(slot):
            return self.refused(lambda: self.eng.snapshot(slot))
        done, snap = self.run(lambda: self.eng.snapshot(slot), [], fault)
        if done:
            self.snaps.append((snap, list(self.hist[slot])))

    @precondition(lambda self: self.snaps)
    @rule(i=st.integers(0, 7), slot=SLOTS, via_file=st.booleans(), fault=FAULTS)
    def restore(self, i, slot, via_file, fault):
        snap, history = self.snaps[i % len(self.snaps)]
        if via_file:
            snap.save(self.dir / "snap.safetensors")
            snap = Snapshot.load(self.dir / "snap.safetensors")
        if not self.valid_slot(slot):
            return self.refused(lambda: self.eng.restore(snap, slot))
        done, _ = self.run(lambda: self.eng.restore(snap, slot), [slot], fault)
        if done:
            self.hist[slot] = list(history)
            self.last[slot] = int(cast(torch.Tensor, self.oracle.replay(history)[0]).argmax()) if history else None

    @rule(kind=st.sampled_from(BAD_CALLS))
    def bad_call(self, kind):
        eng = self.eng
        if kind == "token outside vocab":
            return self.refused(lambda: eng.prefill([1, VOCAB], slot_id=0))
        if kind == "decode token outside vocab":
            return self.refused(lambda: eng.decode_step(-1, slot_id=0))
        if kind == "no token":
            return self.refused(lambda: eng.batch_decode_step([BatchedRequest(1, [1], slot_id=0)]))
        if kind == "foreign snapshot":  # the same cache shapes, another model's weights: only its model id tells
            alien = foreign(self.config)
            alien.reset(0)
            alien.prefill([1, 2, 3], slot_id=0)
            return self.refused(lambda: eng.restore(alien.snapshot(0), 0))
        path = self.dir / "tampered.safetensors"  # "tampered file": one bit of the file's last byte flipped
        eng.snapshot(0).save(path)
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        return self.refused(lambda: eng.restore(Snapshot.load(path), 0))

    @invariant()
    def every_slot_is_its_solo_replay(self):
        if not hasattr(self, "eng"):
            return
        STATS["checks"] += 1
        assert self.eng.num_slots == self.n
        assert not prefix_cache_problems(self.eng.prefix), prefix_cache_problems(self.eng.prefix)
        for s in range(self.n):
            slot = self.eng.cache.slots[s]
            assert list(slot.tokens) == self.hist[s], f"slot {s} holds another history than the model's"
            assert slot.owner == self.owner[s], f"slot {s} is owned by {slot.owner}, the model says {self.owner[s]}"
            _, want = self.oracle.replay(self.hist[s])
            got = self.eng.snapshot(s).tensors
            for name, ref in want.items():
                assert close(got[name], ref), f"slot {s}: {name} differs from a solo replay of its history"


_FOREIGN: dict[str, QwenEngine] = {}


def foreign(config: str) -> QwenEngine:
    """An engine of another model with this config's cache shapes (the same preset, other weights)."""
    if config not in _FOREIGN:
        preset, extra = CONFIGS[config]
        path = ensure_checkpoint(preset, checkpoint_root(), seed=1)
        _FOREIGN[config] = QwenEngine.from_pretrained(path, EngineOptions(**(OPTIONS | extra)))
    return _FOREIGN[config]


def machine_for(configs: list[str]) -> type[EngineMachine]:
    """An EngineMachine whose schedules start from one of `configs` only (make test gives the interpreted configs a
    fixed share of their own: drawn among all, their count follows hypothesis's choices, at 10-60 s each)."""

    class Machine(EngineMachine):
        @initialize(config=st.sampled_from(configs))
        def start(self, config):
            super().start(config)

    Machine.__name__ = f"EngineMachine[{', '.join(configs)}]"
    return Machine


def fuzz_settings(schedules: int, steps: int = 24, **kw) -> settings:
    """`schedules` random schedules of up to `steps` calls each; no deadline (the CPU box is shared)."""
    return settings(
        max_examples=schedules,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        **kw,
    )


def write_stats(path: str | Path) -> dict:
    """Add what this process counted since its last write to the JSON file at `path` (each test file adds its own)."""
    path = Path(path)
    total = Counter(json.loads(path.read_text())) if path.is_file() else Counter()
    total.update(STATS - _WRITTEN)
    _WRITTEN.update(STATS - _WRITTEN)
    path.write_text(json.dumps(dict(sorted(total.items())), indent=1))
    return dict(total)


_WRITTEN: Counter = Counter()
STATS_FILE = os.environ.get("POCKETLAB_RELIABILITY")  # where the runs add their counts (make fuzz)


def table(stats: dict, seed: str | None = None) -> str:
    """The README's reliability table, from the counts a passing `make fuzz` wrote (a failing run writes none)."""
    schedules, calls = stats.get("schedules", 0), stats.get("calls", 0) + stats.get("refused", 0)
    configs = ", ".join(f"{k.split(': ', 1)[1]} {v}" for k, v in stats.items() if k.startswith("schedules: "))
    interrupts = stats.get("interrupted", 0) + stats.get("interrupts injected (test_interrupts)", 0)
    files = stats.get("hostile weight files tried", 0) + stats.get("hostile snapshot files tried", 0)
    rows = [
        ("schedules run", f"{schedules} ({configs})" + (f", seed {seed}" if seed else "")),
        ("calls per schedule", f"{calls / max(schedules, 1):.1f} on average (at most 24), {calls} in all"),
        ("calls refused as bad input (state compared bitwise)", stats.get("refused", 0)),
        ("slot-vs-solo-replay checks (after every call)", stats.get("checks", 0)),
        (
            "interrupts injected",
            f"{interrupts} ({stats.get('interrupted', 0)} in schedules, "
            f"{stats.get('interrupts injected (test_interrupts)', 0)} at every step of each call)",
        ),
        (
            "hostile files tried",
            f"{files} ({stats.get('hostile weight files tried', 0)} weights, "
            f"{stats.get('hostile snapshot files tried', 0)} snapshots)",
        ),
        ("wall time of the schedules", f"{stats.get('fuzz seconds', 0)} s"),
        ("divergences", "0 (the first one fails the run, and no table is written)"),
        ("corrupted states", "0 (likewise)"),
    ]
    return "| | |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="print the reliability table from a make fuzz counts file")
    ap.add_argument("--table", required=True, help="the JSON counts file (POCKETLAB_RELIABILITY)")
    ap.add_argument("--seed", default=None)
    args = ap.parse_args()
    print(table(json.loads(Path(args.table).read_text()), args.seed))
