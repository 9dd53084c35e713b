"""Prefix cache: a prompt reuses whatever any slot already computed for its prefix, exactly, dense or hybrid.

Where reusable prefixes live (each is a `CachedPrefix`: token ids plus where their K/V and states are):
  * slot prefixes, one per slot: the slot's own rows. Attention K/V serve any prefix of the slot's history,
    to the token; the slot's live conv/recurrent state serves exactly its end. A cleared (released) slot's
    rows still hold its old history until the slot is written again: the slot's prefix becomes a *ghost* and is
    still found, at no copy cost.
  * state checkpoints (hybrid models only): Gated DeltaNet state cannot be rewound, so prefill keeps copies
    of every linear layer's conv + recurrent state at the end of each prompt and at every multiple of
    `checkpoint_stride` (the layers hand those back from inside the prefill forward: `marks`). A shared prefix
    resumes from the nearest checkpoint at or below the shared length, never from a block boundary hundreds of
    tokens back.
  * retained entries: just before a slot's rows are overwritten, what they held beyond the part that stays
    (its history for dense models; up to its last checkpoint for hybrid ones) is copied out into an entry of
    its own, checkpoints moved along, unless another cached prefix already serves it.

Lookup (`prepare`): chain hashes of `prefix_block`-token blocks index every cached prefix. The prompt's block
hashes find the candidates in one dict probe per block; a token comparison then confirms each match (ruling
out collisions) and extends it to the exact token inside the next block. The target slot's own history is
always compared directly, so it is reused to the token even below one block. Cost: O(prompt / block) hashing
and probes plus O(match) C-speed list comparisons per candidate; no Python loop per token.

Budget: checkpoints and retained entries count against `prefix_cache_bytes`, evicted least recently used
first (a hit refreshes what it used). Live slot rows and states are never counted and never evicted.

Staleness: this cache is the slot cache's listener (`cache.HistoryListener`). A slot's history is read-only
outside `SlotState.extend/truncate/replace`, and each of those reports the first index it changed
(`history_changed`), so the hashed blocks and checkpoints above it are dropped at once, whoever made the edit
(prefill, decode, a speculative rollback). A live slot prefix reads its tokens through the slot; only entries
and ghosts keep a list of their own. Clearing or restoring a slot calls this cache first (`before_clear`,
`before_restore`); `reset` forgets everything, so a run after it is computed exactly as on a fresh engine.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cache import SlotState

_SEED = 0x5EED


def common_len(a, b, limit: int | None = None, known: int = 0) -> int:
    """Length of the common prefix of token lists a and b, at most `limit`. `known` is a length the block
    hashes say is equal: confirmed with one comparison (a collision just falls back to a full compare)."""
    n = min(len(a), len(b), len(a) + len(b) if limit is None else limit)
    lo, k = 0, min(known, n)
    if k and a[:k] == b[:k]:
        lo = k
    step = 64
    while lo < n:
        hi = min(lo + step, n)
        if a[lo:hi] == b[lo:hi]:
            lo, step = hi, step * 2
        elif hi - lo <= 8:
            while a[lo] == b[lo]:
                lo += 1
            return lo
        else:
            step = (hi - lo) // 2
    return n


def block_hash(prev: int, block: list[int]) -> int:
    """One block's hash, chained to the hash of everything before it. Collisions only cost a comparison."""
    return hash((prev, *block))


def chain_hashes(tokens, block: int, n_blocks: int, first: int = 0, prev: int = _SEED) -> list[int]:
    """Hash of blocks first..n_blocks-1, each chained to all blocks before it (prev: the hash of block first-1)."""
    out = []
    for k in range(first, n_blocks):
        prev = block_hash(prev, tokens[k * block : (k + 1) * block])
        out.append(prev)
    return out


@dataclass(eq=False)
class CachedPrefix:
    """A reusable prefix: `tokens` and where the K/V for them lives, plus hybrid state checkpoints."""

    held: list[int] = field(default_factory=list)  # the tokens of an entry or a ghost (unused while live)
    slot: int | None = None  # K/V in this slot's rows; None: a retained entry holding copies in `kv`
    history: SlotState | None = None  # live: the tokens are this slot's history, the live state is at its end
    kv: dict | None = None  # retained entry: {("k"|"v", layer key): [kv_heads, len(tokens), head_dim]}
    states: dict[int, dict] = field(default_factory=dict)  # position -> {("conv"|"rec", layer): copy}
    hashes: list[int] = field(default_factory=list)  # chain hash of each full block of `tokens`

    @property
    def live(self) -> bool:
        """The slot's rows and live conv/recurrent state are those of its current history."""
        return self.history is not None

    @property
    def tokens(self):
        """The tokens whose K/V this prefix offers: read through the slot while live, else its own list."""
        return self.history.tokens if self.history is not None else self.held

    def resume_point(self, shared: int, stateful: bool) -> int:
        """The longest prefix (<= shared tokens) this prefix can hand over: any length for K/V alone; for
        hybrid models only where a state is known (a checkpoint, or the live state at the end)."""
        if not stateful:
            return shared
        best = max((p for p in self.states if p <= shared), default=0)
        if self.live and len(self.tokens) <= shared:
            best = max(best, len(self.tokens))
        return best


class PrefixCache:
    def __init__(self, cache, options):
        self.cache = cache
        self.block, self.stride, self.budget = (
            options.prefix_block,
            options.checkpoint_stride,
            options.prefix_cache_bytes,
        )
        self.slots = [CachedPrefix(slot=s, history=cache.slots[s]) for s in range(cache.num_slots)]
        self.entries: list[CachedPrefix] = []  # retained entries
        self.index: dict[int, set[CachedPrefix]] = {}  # chain hash -> cached prefixes holding that block chain
        self.lru: OrderedDict[tuple[CachedPrefix, int | None], int] = OrderedDict()  # (prefix, position|None) -> bytes
        self.used = 0
        self.stats = dict(prefills=0, hits=0, reused_tokens=0, computed_tokens=0, checkpoints=0, retained=0, evicted=0)
        cache.listen(self)

    # -- the engine's entry points -------------------------------------------------------------
    def prepare(self, slot: int, prompt: list[int]) -> int:
        """Bring `slot` to the longest reusable prefix of `prompt` (at most len-1 tokens: the last is always
        computed) by truncation or device copy; returns its length, the position prefill starts from."""
        for prefix in self.slots:
            self._sync(prefix)
        own, limit = self.slots[slot], len(prompt) - 1
        m_own = common_len(own.tokens, prompt, limit)
        src, r = own, own.resume_point(m_own, self.stateful)
        other, r_other = self._search(prompt, limit, skip=own)
        if r_other > r:
            assert other is not None  # r_other > r >= 0, and _search pairs any positive length with a prefix
            src, r = other, r_other
        keep = min(m_own, r)  # rows [0, keep) of the slot already hold what the prompt needs
        self._touch(src, r)
        self._retire(own, keep, pin=src)
        state = (
            self._state_at(src, r) if self.stateful and not (src is own and own.live and r == len(own.tokens)) else None
        )
        if src is not own:
            self._copy_kv(src, slot, keep, r)
        if state is not None or (self.stateful and r == 0):
            self._load_state(slot, state)
        self.cache.slots[slot].replace(prompt[:r])  # -> history_changed: `own` follows the slot's history
        self.stats["prefills"] += 1
        self.stats["hits"] += r > 0
        self.stats["reused_tokens"] += r
        self.stats["computed_tokens"] += len(prompt) - r
        return r

    @property
    def stateful(self) -> bool:
        """Per-slot state beyond positional K/V (conv, recurrent, registered extras) cannot be rewound."""
        return bool(self.cache.conv or self.cache.rec or getattr(self.cache, "extra", None))

    @property
    def marks_in_forward(self) -> bool:
        """Conv and recurrent states can be captured mid-forward by the layers; registered extras (the MTP
        head's rows) cannot, so with those prefill pieces are cut at stride multiples instead."""
        return not getattr(self.cache, "extra", None)

    def stride_for_pieces(self) -> int:
        """Prefill cuts pieces at multiples of this: only when checkpoints cannot be taken inside a forward."""
        return self.stride if self.stateful and not self.marks_in_forward else 0

    def marks(self, lo: int, hi: int) -> list[int]:
        """Stride multiples strictly inside the prefill piece [lo, hi): offsets (from lo) where the forward
        must hand back each linear layer's state, so one forward serves any number of checkpoints."""
        if not (self.stateful and self.stride and self.marks_in_forward):
            return []
        return [p - lo for p in range((lo // self.stride + 1) * self.stride, hi, self.stride)]

    def reached(self, slot: int, position: int, final: bool, state: dict | None = None) -> None:
        """Prefill computed `slot` up to `position`: checkpoint the state at prompt ends and stride multiples
        (the slot's live state, or `state` captured inside the forward at that position)."""
        if not self.stateful or not (final or (self.stride and position % self.stride == 0)):
            return
        prefix = self.slots[slot]
        self._sync(prefix)  # the tokens up to `position` are now seen: what is added next is valid for them
        if position in prefix.states:
            self._touch(prefix, position)
            return
        nbytes = self.state_bytes()
        if self._make_room(nbytes):
            prefix.states[position] = state if state is not None else self._live_state(slot, clone=True)
            self._add((prefix, position), nbytes)
            self.stats["checkpoints"] += 1

    # -- the slot cache's listener (cache.HistoryListener) -------------------------------------------
    def history_changed(self, slot: int, first_changed: int) -> None:
        """The slot's tokens changed from `first_changed` on: drop the hashed blocks and checkpoints above it."""
        prefix = self.slots[slot]
        if prefix.history is None:
            history = self.cache.slots[slot]
            if not history.tokens:  # still empty: the rows hold the ghost's tokens
                return
            # the slot is written again: its rows still agree with the ghost's tokens up to the common prefix
            first_changed = common_len(prefix.held, history.tokens)
            prefix.held, prefix.history = [], history
        self._truncate(prefix, first_changed)

    def before_clear(self, slot: int) -> None:
        """SlotCache.clear is about to forget the slot's sequence: its K/V rows stay (a ghost, still
        reusable); its live state is zeroed, so checkpoint it first."""
        prefix = self.slots[slot]
        self._sync(prefix)
        if prefix.live and self.stateful and prefix.tokens:
            self.reached(slot, len(prefix.tokens), final=True)
        prefix.held, prefix.history = prefix.tokens[:], None

    def before_restore(self, slot: int) -> None:
        """SlotCache.restore is about to overwrite the slot: keep what it held, if worth it, and start over."""
        prefix = self.slots[slot]
        self._sync(prefix)
        self._retire(prefix, 0)

    def forget(self, slot: int | None = None) -> None:
        """Drop what was learned about one slot (or everything, retained entries included)."""
        for prefix in self.slots if slot is None else [self.slots[slot]]:
            self._truncate(prefix, 0)
            prefix.held, prefix.history = [], self.cache.slots[prefix.slot]
        if slot is None:
            for entry in list(self.entries):
                self._evict((entry, None), count=False)

    def kv_bytes(self, n_tokens: int) -> int:
        """Device bytes of n tokens' K/V over every attention region (what retaining them costs)."""
        return sum(t[0, :, :n_tokens].numel() * t.element_size() for _, _, t in self._kv_banks())

    def state_bytes(self) -> int:
        """Device bytes of one state checkpoint (every conv, recurrent and extra per-slot tensor)."""
        return sum(t[0].numel() * t.element_size() for _, _, t in self._state_banks())

    def contents(self) -> list[dict]:
        """What the budget holds, least recently used first."""
        return [
            dict(
                kind="entry" if pos is None else "checkpoint",
                slot=prefix.slot,
                tokens=len(prefix.tokens),
                position=len(prefix.tokens) if pos is None else pos,
                bytes=nbytes,
            )
            for (prefix, pos), nbytes in self.lru.items()
        ]

    def describe(self) -> dict:
        return dict(
            self.stats,
            entries=len(self.entries),
            used_bytes=self.used,
            budget_bytes=self.budget,
            checkpoints_held=sum(len(r.states) for r in self.slots + self.entries),
        )

    # -- lookup ------------------------------------------------------------------------------------
    def _search(
        self, prompt: list[int], limit: int, skip: CachedPrefix | None = None
    ) -> tuple[CachedPrefix | None, int]:
        """The cached prefix (not `skip`) that hands over the longest prefix of prompt[:limit], via block hashes."""
        depth: dict[CachedPrefix, int] = {}
        if not self.index:
            return None, 0
        prev = _SEED
        for k in range(limit // self.block):
            prev = block_hash(prev, prompt[k * self.block : (k + 1) * self.block])
            holders = self.index.get(prev)
            if not holders:
                break
            for prefix in holders:
                depth[prefix] = k + 1
        best, best_r = None, 0
        for prefix, d in depth.items():
            if prefix is skip:
                continue
            r = prefix.resume_point(common_len(prefix.tokens, prompt, limit, known=d * self.block), self.stateful)
            if r > best_r or (r == best_r and best is not None and prefix.slot is not None and best.slot is None):
                best, best_r = prefix, r
        return best, best_r

    def _sync(self, prefix: CachedPrefix) -> None:
        """Hash the blocks the prefix's tokens completed since the last look (stale ones are already dropped:
        `history_changed`), so lookups find them."""
        tokens = prefix.tokens
        n = len(tokens) // self.block
        if n > len(prefix.hashes):
            new = chain_hashes(tokens, self.block, n, len(prefix.hashes), prefix.hashes[-1] if prefix.hashes else _SEED)
            self._index(prefix, new)

    def _index(self, prefix: CachedPrefix, hashes: list[int]) -> None:
        for h in hashes:
            self.index.setdefault(h, set()).add(prefix)
        prefix.hashes.extend(hashes)

    def _truncate(self, prefix: CachedPrefix, n: int) -> None:
        """Forget everything the prefix claims beyond its first n tokens (hashed blocks, checkpoints, and for
        an entry or a ghost the tokens themselves: their rows are about to be overwritten or dropped)."""
        if prefix.history is None:
            del prefix.held[n:]
        nb = n // self.block
        if nb >= len(prefix.hashes) and (not prefix.states or max(prefix.states) <= n):  # e.g. an append: nothing stale
            return
        for h in prefix.hashes[nb:]:
            holders = self.index.get(h)
            if holders is not None:
                holders.discard(prefix)
                if not holders:
                    del self.index[h]
        del prefix.hashes[nb:]
        for p in [p for p in prefix.states if p > n]:
            self._evict((prefix, p), count=False)

    # -- keeping what is about to be overwritten ---------------------------------------------------
    def _retire(self, prefix: CachedPrefix, keep: int, pin: CachedPrefix | None = None) -> None:
        """The slot's rows beyond `keep` are about to be overwritten: copy out what is worth keeping."""
        ends = list(prefix.states) + ([len(prefix.tokens)] if prefix.live and prefix.tokens else [])
        end = max(ends, default=0) if self.stateful else len(prefix.tokens)
        if end - keep >= self.block and self._search(prefix.tokens[:end], end, skip=prefix)[1] < end:
            self._retain(prefix, keep, end, pin)
        self._truncate(prefix, keep)

    def _retain(self, prefix: CachedPrefix, keep: int, end: int, pin: CachedPrefix | None) -> None:
        slot, banks = prefix.slot, self._kv_banks()
        assert slot is not None
        kv_bytes = sum(t[slot, :, :end].numel() * t.element_size() for _, _, t in banks)
        copy_live = self.stateful and prefix.live and end == len(prefix.tokens) and end not in prefix.states
        if not self._make_room(kv_bytes + (self.state_bytes() if copy_live else 0), pinned={prefix, pin}):
            return
        states = {}
        for p in [p for p in prefix.states if keep < p <= end]:
            states[p] = prefix.states.pop(p)
            self.used -= self.lru.pop((prefix, p))
        if copy_live:
            states[end] = self._live_state(slot, clone=True)
        entry = CachedPrefix(
            prefix.tokens[:end],
            kv={(kind, name): t[slot, :, :end].clone() for kind, name, t in banks},
            states=states,
        )
        self._index(entry, prefix.hashes[: end // self.block])
        self.entries.append(entry)
        self._add((entry, None), kv_bytes + len(states) * self.state_bytes())
        self.stats["retained"] += 1

    # -- budget ------------------------------------------------------------------------------------
    def _add(self, key, nbytes: int) -> None:
        self.lru[key] = nbytes
        self.used += nbytes

    def _touch(self, prefix: CachedPrefix, position: int) -> None:
        key = (prefix, None) if prefix is not None and prefix.slot is None else (prefix, position)
        if key in self.lru:
            self.lru.move_to_end(key)

    def _make_room(self, nbytes: int, pinned=()) -> bool:
        """Evict least recently used checkpoints/entries (never `pinned` prefixes') until nbytes fit."""
        if nbytes > self.budget:
            return False
        for key in list(self.lru):
            if self.used + nbytes <= self.budget:
                break
            if key[0] not in pinned:
                self._evict(key)
        return self.used + nbytes <= self.budget

    def _evict(self, key, count: bool = True) -> None:
        prefix, position = key
        self.used -= self.lru.pop(key, 0)
        self.stats["evicted"] += count
        if position is None:
            self._truncate(prefix, 0)
            prefix.kv = None
            self.entries.remove(prefix)
        else:
            prefix.states.pop(position, None)

    # -- device copies (generic over whatever layers the cache holds) ---------------------------------
    def _kv_banks(self):
        return [
            (kind, name, t) for kind, bank in (("k", self.cache.k), ("v", self.cache.v)) for name, t in bank.items()
        ]

    def _state_banks(self):
        banks = (("conv", self.cache.conv), ("rec", self.cache.rec), ("extra", getattr(self.cache, "extra", {})))
        return [(kind, name, t) for kind, bank in banks for name, t in bank.items()]

    def _live_state(self, slot: int, clone: bool) -> dict:
        return {(kind, name): (t[slot].clone() if clone else t[slot]) for kind, name, t in self._state_banks()}

    def _state_at(self, prefix: CachedPrefix, position: int) -> dict | None:
        if position == 0:
            return None
        if position in prefix.states:
            return prefix.states[position]
        assert prefix.slot is not None
        return self._live_state(prefix.slot, clone=False)  # resume_point guarantees: live and at its end

    def _load_state(self, slot: int, state: dict | None) -> None:
        for kind, name, t in self._state_banks():
            if state is None:
                t[slot].zero_()
            else:
                t[slot].copy_(state[(kind, name)])

    def _copy_kv(self, src: CachedPrefix, slot: int, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        for kind, name, t in self._kv_banks():
            part = src.kv[(kind, name)][:, lo:hi] if src.kv is not None else t[src.slot, :, lo:hi]
            t[slot, :, lo:hi].copy_(part)
