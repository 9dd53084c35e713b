"""Fault injection: raise at the k-th of the engine's internal steps, to check that an interrupted call loses nothing.

A step is any of: a layer's token mixer or MLP, the logits, an access to a cache bank (K/V, conv, recurrent: the
layers' cache writes, snapshot and restore), a history edit, a prefix-cache operation, the drafter's and the
speculator's steps, sampling, a CUDA graph capture. `Faults(engine)` counts them during a call (`calls`), or with
`at=k` raises `exc` at the k-th, once; then every patch is undone.
"""

from __future__ import annotations

from contextlib import ExitStack

from .. import engine as engine_module


class InjectedInterrupt(KeyboardInterrupt):
    """What a fault raises by default: a KeyboardInterrupt (as a notebook's stop button), told apart from a real one."""


class InjectedError(RuntimeError):
    """A fault as an ordinary error (a CUDA error, an out-of-memory) rather than an interrupt."""


_PREFIX_STEPS = (
    "prepare",
    "reached",
    "history_changed",
    "before_clear",
    "before_restore",
    "forget",
    "_retire",
    "_retain",
    "_copy_kv",
    "_load_state",
    "_make_room",
    "_evict",
)


class _Banks(dict):
    """A cache bank ({layer: tensor}) whose every lookup is a step."""

    def __init__(self, bank: dict, step):
        super().__init__(bank)
        self._step = step

    def __getitem__(self, key):
        self._step()
        return super().__getitem__(key)


class Faults:
    """Context manager: within it, the engine's steps are counted and the `at`-th raises `exc` (None: never)."""

    def __init__(self, engine, at: int | None = None, exc: type[BaseException] = InjectedInterrupt):
        self.engine, self.at, self.exc = engine, at, exc
        self.calls, self.fired = 0, False
        self._stack = ExitStack()

    def step(self) -> None:
        self.calls += 1
        if self.calls == self.at and not self.fired:
            self.fired = True
            raise self.exc(f"injected at step {self.calls}")

    def __enter__(self) -> Faults:
        eng = self.engine
        for layer in list(eng.model.layers) + ([eng.model.mtp.layer] if getattr(eng.model, "mtp", None) else []):
            self._wrap(layer, "mixer")
            self._wrap(layer, "mlp")
        self._wrap(eng.model, "logits")
        for slot in eng.cache.slots:
            for name in ("extend", "truncate", "replace"):
                self._wrap(slot, name)
        for name in ("k", "v", "conv", "rec"):
            self._swap(eng.cache, name, _Banks(getattr(eng.cache, name), self.step))
        if eng.prefix is not None:
            for name in _PREFIX_STEPS:
                self._wrap(eng.prefix, name)
        if eng.speculator is not None:
            for name in ("draft", "observe", "commit"):
                self._wrap(eng.speculator.drafter, name)
            self._wrap(eng.speculator, "_roll_back")
        if eng.graphs is not None:  # a replay is one point: no Python runs inside it
            for name in ("capture", "replay"):
                self._wrap(eng.graphs, name)
        self._swap(engine_module, "sample", self._counted(engine_module.sample))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _counted(self, fn):
        def counted(*args, **kwargs):
            self.step()
            return fn(*args, **kwargs)

        return counted

    def _wrap(self, obj, name: str) -> None:
        self._swap(obj, name, self._counted(getattr(obj, name)))

    def _swap(self, obj, name: str, value) -> None:
        """Set obj.name = value until exit. Instance attributes are put back; a patched method is just deleted."""
        had = name in getattr(obj, "__dict__", {})
        old = getattr(obj, name)
        setattr(obj, name, value)
        self._stack.callback(lambda: setattr(obj, name, old) if had else delattr(obj, name))


def count_steps(engine, call) -> int:
    """How many steps `call()` takes (it runs for real)."""
    with Faults(engine) as faults:
        call()
    return faults.calls


def prefix_cache_problems(prefix) -> list[str]:
    """What is inconsistent in a PrefixCache's bookkeeping (empty: nothing): the budget matches what it holds, every
    checkpoint and entry is accounted for once, and the block index agrees with each cached prefix's tokens."""
    from ..prefix_cache import chain_hashes

    if prefix is None:
        return []
    problems, known = [], set(prefix.slots) | set(prefix.entries)
    if prefix.used != sum(prefix.lru.values()) or prefix.used > prefix.budget:
        problems.append(f"used {prefix.used} bytes, the LRU holds {sum(prefix.lru.values())}, budget {prefix.budget}")
    for p, pos in prefix.lru:
        if p not in known or (pos is None) != (p.slot is None) or (pos is not None and pos not in p.states):
            problems.append(f"LRU key ({p.slot}, {pos}) is not a held checkpoint or entry")
    for p in known:
        missing = [pos for pos in p.states if (p, pos) not in prefix.lru and p.slot is not None]
        if missing or (p.slot is None and (p, None) not in prefix.lru):
            problems.append(f"prefix of slot {p.slot} holds unaccounted checkpoints {missing}")
        if p.hashes != chain_hashes(p.tokens, prefix.block, len(p.hashes)):
            problems.append(f"prefix of slot {p.slot}: its block hashes do not match its tokens")
        if any(p not in prefix.index.get(h, ()) for h in p.hashes):
            problems.append(f"prefix of slot {p.slot}: a block hash is missing from the index")
    if any(p not in known for holders in prefix.index.values() for p in holders):
        problems.append("the index names a prefix the cache no longer holds")
    return problems
