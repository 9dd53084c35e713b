"""SlotCache: everything a slot owns, so no state is shared between requests.

Device side, one row per slot (plus a scratch row that absorbs padding writes): attention K/V
[slots+1, kv_heads, max_seq, head_dim] per full-attention layer; for Gated DeltaNet layers the conv
window [slots+1, conv_dim, K-1] and the fp32 recurrent state [slots+1, Hv, dk, dv].
Host side, per slot: position (tokens whose K/V is cached), token history, owner request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import EngineOptions, ModelConfig


class TokenHistory(list):
    """A slot's token list that remembers the lowest index changed since `changed_from` was last set.
    Appending changes nothing below the old length; the edits the engine makes (item assignment, `del`,
    pop, clear) lower the mark, so the prefix cache drops exactly the checkpoints and hashed blocks that
    went stale, whoever made the edit."""

    def __init__(self, tokens=()):
        super().__init__(tokens)
        self.changed_from = 0

    def _mark(self, i: int) -> None:
        self.changed_from = max(0, min(self.changed_from, i))

    def _first(self, i) -> int:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            return stop + 1 if step < 0 else start
        return i + len(self) if i < 0 else i

    def __setitem__(self, i, value):
        self._mark(self._first(i))
        super().__setitem__(i, value)

    def __delitem__(self, i):
        self._mark(self._first(i))
        super().__delitem__(i)

    def pop(self, i=-1):
        self._mark(self._first(i))
        return super().pop(i)

    def clear(self):
        self._mark(0)
        super().clear()


@dataclass
class SlotState:
    tokens: list[int] = field(default_factory=list)  # history whose K/V (or state) is in the cache
    owner: int | None = None  # request id holding the slot, if allocated

    def __setattr__(self, name, value):
        if name == "tokens":  # a new history: changed from index 0
            value = TokenHistory(value)
        super().__setattr__(name, value)

    @property
    def position(self) -> int:
        return len(self.tokens)


@dataclass
class Snapshot:
    """A slot's complete state, restorable into any slot (same engine shape)."""

    tokens: list[int]
    tensors: dict[str, torch.Tensor]

    @property
    def position(self) -> int:
        return len(self.tokens)

    def save(self, path: str | Path) -> None:
        save_file(
            {k: v.contiguous().cpu() for k, v in self.tensors.items()},
            str(path),
            metadata={"tokens": ",".join(map(str, self.tokens))},
        )

    @classmethod
    def load(cls, path: str | Path) -> Snapshot:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            text = (f.metadata() or {}).get("tokens")
        if text is None:
            raise ValueError(f"{path}: not a pocketlab snapshot (no token metadata)")
        return cls(tokens=[int(t) for t in text.split(",") if t], tensors=load_file(str(path)))


class SlotCache:
    def __init__(self, cfg: ModelConfig, opts: EngineOptions):
        self.cfg, self.max_seq = cfg, opts.max_seq_len
        self.num_slots = opts.max_slots
        self.scratch = opts.max_slots  # padding and graph filler rows write here
        rows, dev, dt = opts.max_slots + 1, opts.device, opts.torch_dtype
        self.k, self.v, self.conv, self.rec = {}, {}, {}, {}
        for i in cfg.attention_layers:
            shape = (rows, cfg.num_key_value_heads, opts.max_seq_len, cfg.head_dim)
            self.k[i] = torch.zeros(shape, device=dev, dtype=dt)
            self.v[i] = torch.zeros(shape, device=dev, dtype=dt)
        conv_dim = (
            2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        )
        for i in cfg.linear_layers:
            self.conv[i] = torch.zeros(rows, conv_dim, cfg.linear_conv_kernel_dim - 1, device=dev, dtype=dt)
            self.rec[i] = torch.zeros(
                rows,
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
                device=dev,
                dtype=torch.float32,
            )
        self.extra: dict[str, torch.Tensor] = {}  # [rows, ...] per-slot state other parts register (MTP queue)
        self.slots = [SlotState() for _ in range(opts.max_slots)]
        self.watcher = None  # the prefix cache: told before a slot is cleared or restored (it may keep the rows)

    def add_kv(self, key: str, kv_heads: int, head_dim: int) -> None:
        """One more attention KV region per slot (e.g. the MTP layer's), snapshotted like the model's."""
        ref = next(iter(self.k.values()))
        self.k[key] = torch.zeros(ref.shape[0], kv_heads, self.max_seq, head_dim, device=ref.device, dtype=ref.dtype)
        self.v[key] = torch.zeros_like(self.k[key])

    def add_extra(self, name: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """A per-slot tensor [slots+1, *shape], zeroed by clear() and carried whole by snapshots."""
        self.extra[name] = torch.zeros(self.num_slots + 1, *shape, dtype=dtype, device=device)
        return self.extra[name]

    # -- per-slot state ------------------------------------------------------------------------
    def clear(self, slot: int) -> None:
        """Forget a slot's sequence. K/V rows need no wipe (masked by position); recurrent state does."""
        if self.watcher is not None:
            self.watcher.before_clear(slot)
        self.slots[slot].tokens = []
        for i in self.conv:
            self.conv[i][slot].zero_()
            self.rec[i][slot].zero_()
        for x in self.extra.values():
            x[slot].zero_()

    def snapshot(self, slot: int) -> Snapshot:
        n, tensors = self.slots[slot].position, {}
        for i in self.k:
            tensors[f"k.{i}"] = self.k[i][slot, :, :n].clone()
            tensors[f"v.{i}"] = self.v[i][slot, :, :n].clone()
        for i in self.conv:
            tensors[f"conv.{i}"] = self.conv[i][slot].clone()
            tensors[f"rec.{i}"] = self.rec[i][slot].clone()
        for name, x in self.extra.items():
            tensors[f"x.{name}"] = x[slot].clone()
        return Snapshot(list(self.slots[slot].tokens), tensors)

    def check_snapshot(self, snap: Snapshot) -> None:
        expected = self.snapshot_shapes(snap.position)
        if snap.position > self.max_seq:
            raise ValueError(f"snapshot holds {snap.position} tokens, more than max_seq_len={self.max_seq}")
        if set(snap.tensors) != set(expected):
            raise ValueError(
                "snapshot tensors do not match this engine's model "
                f"(missing {sorted(set(expected) - set(snap.tensors))[:3]}, "
                f"extra {sorted(set(snap.tensors) - set(expected))[:3]})"
            )
        for name, shape in expected.items():
            if tuple(snap.tensors[name].shape) != shape:
                raise ValueError(
                    f"snapshot tensor {name} has shape {tuple(snap.tensors[name].shape)}, this engine needs {shape}"
                )

    def snapshot_shapes(self, n: int) -> dict[str, tuple]:
        shapes = {}
        for i in self.k:
            shapes[f"k.{i}"] = shapes[f"v.{i}"] = (self.k[i].shape[1], n, self.k[i].shape[3])
        for i in self.conv:
            shapes[f"conv.{i}"], shapes[f"rec.{i}"] = tuple(self.conv[i].shape[1:]), tuple(self.rec[i].shape[1:])
        for name, x in self.extra.items():
            shapes[f"x.{name}"] = tuple(x.shape[1:])
        return shapes

    def restore(self, snap: Snapshot, slot: int) -> None:
        if self.watcher is not None:
            self.watcher.before_restore(slot)
        n = snap.position
        for i in self.k:
            self.k[i][slot, :, :n] = snap.tensors[f"k.{i}"]
            self.v[i][slot, :, :n] = snap.tensors[f"v.{i}"]
        for i in self.conv:
            self.conv[i][slot] = snap.tensors[f"conv.{i}"]
            self.rec[i][slot] = snap.tensors[f"rec.{i}"]
        for name, x in self.extra.items():
            x[slot] = snap.tensors[f"x.{name}"]
        self.slots[slot].tokens = list(snap.tokens)
