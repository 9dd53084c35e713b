"""SlotCache: everything a slot owns, so no state is shared between requests.

Device side, one row per slot (plus a scratch row that absorbs padding writes): attention K/V
[slots+1, kv_heads, max_seq, head_dim] per full-attention layer; for Gated DeltaNet layers the conv
window [slots+1, conv_dim, K-1] and the fp32 recurrent state [slots+1, Hv, dk, dv] (every layer's in one bank, beside
a few rows aside where a decode step launched ahead stores its states: `aside`).
Host side, per slot (`SlotState`): token history (whose K/V is cached; its length is the position), owner
request. The history is read-only outside its methods, which report every change to the registered listener.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .config import EngineOptions, ModelConfig
from .layers.linear_decode import Into
from .prefix_cache import common_len


def linear_state_bytes(cfg: ModelConfig, elem: int) -> int:
    """One slot's Gated DeltaNet states: every layer's conv window (elem bytes a value) and fp32 recurrent state."""
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return len(cfg.linear_layers) * (cfg.linear_conv_dim * (cfg.linear_conv_kernel_dim - 1) * elem + rec)


class HistoryListener(Protocol):
    """Told of every change to a slot's history and the rows behind it (the prefix cache registers as one)."""

    def history_changed(self, slot: int, first_changed: int) -> None:
        """The slot's tokens from index `first_changed` on changed (appended, cut or replaced); those before it
        did not."""

    def before_clear(self, slot: int) -> None:
        """The slot is about to be cleared: its history emptied and its conv/recurrent state zeroed."""

    def before_restore(self, slot: int) -> None:
        """The slot's rows and history are about to be overwritten by a snapshot."""


class TokensView(Sequence):
    """Read-only view of a slot's token list. It follows the list as it changes; a slice is a plain list copy,
    so the prefix cache's comparisons of slices still run at C speed; nothing can edit the history through
    it, so every change goes through SlotState's methods and reaches the listener."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: list[int]):
        self._tokens = tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, i):
        return self._tokens[i]

    def __iter__(self):
        return iter(self._tokens)

    def __eq__(self, other) -> bool:
        return self._tokens == (other._tokens if isinstance(other, TokensView) else other)

    __hash__ = None  # type: ignore[assignment]  # the documented way to make a class unhashable

    def __repr__(self) -> str:
        return f"TokensView({self._tokens!r})"


class SlotState:
    """A slot's host side: its token history (whose K/V or state is in the cache) and its owner. The history
    changes only through extend / truncate / replace, each of which reports the first index it changed to the
    listener (`history_changed(slot, first_changed)`), so it can drop exactly the facts that went stale."""

    def __init__(self, index: int):
        self.index = index
        self.owner: int | None = None  # request id holding the slot, if allocated
        self._tokens: list[int] = []
        self._view = TokensView(self._tokens)
        self._listener: HistoryListener | None = None
        self.changes = 0  # history changes so far (graphs.Ahead serves a call only if one, its own extend, came since)

    def listen(self, listener: HistoryListener | None) -> None:
        """Register the one listener told of every change (None: nobody); SlotCache.listen does it per slot."""
        self._listener = listener

    @property
    def tokens(self) -> TokensView:
        """The history, read-only (a view that follows later changes: copy a slice to keep one)."""
        return self._view

    @property
    def position(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens (their K/V or state was just computed)."""
        first = len(self._tokens)
        self._tokens.extend(tokens)
        self._changed(first)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (a rollback, or reuse of a prefix); truncate(0) empties the history."""
        if not 0 <= n <= len(self._tokens):
            raise ValueError(f"slot {self.index}: cannot truncate a history of {len(self._tokens)} tokens to {n}")
        del self._tokens[n:]
        self._changed(n)

    def replace(self, tokens: Iterable[int]) -> None:
        """Make `tokens` the history; the part it shares with the old one counts as unchanged."""
        tokens = list(tokens)
        first = common_len(self._tokens, tokens)
        self._tokens[first:] = tokens[first:]
        self._changed(first)

    def _changed(self, first: int) -> None:
        self.changes += 1
        if self._listener is not None:
            self._listener.history_changed(self.index, first)


SNAPSHOT_FORMAT = "pocketlab-snapshot"
SNAPSHOT_VERSION = "1"  # bump when what a snapshot holds changes: older or newer files are refused


@dataclass
class Snapshot:
    """A slot's complete state, restorable into any slot of an engine of the same model, dtype and shape. On disk: a
    safetensors file whose metadata holds the token history, the model's id, the dtype, the format version and a
    sha256 of all of it and of the tensor bytes, so a truncated, tampered or foreign file is refused, not restored."""

    tokens: list[int]
    tensors: dict[str, torch.Tensor]
    model: str = ""  # the engine's model_id (cfg and weights digest); "" only for hand-made snapshots
    dtype: str = ""  # the engine's dtype name

    @property
    def position(self) -> int:
        return len(self.tokens)

    def save(self, path: str | Path) -> None:
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.tensors.items()}
        meta = self._metadata()
        save_file(tensors, str(path), metadata=meta | {"sha256": _digest(meta, tensors)})

    def _metadata(self) -> dict[str, str]:
        return dict(
            format=SNAPSHOT_FORMAT,
            version=SNAPSHOT_VERSION,
            engine=_engine_version(),
            model=self.model,
            dtype=self.dtype,
            tokens=",".join(map(str, self.tokens)),
        )

    @classmethod
    def load(cls, path: str | Path) -> Snapshot:
        """Read and verify a snapshot file: a ValueError naming the file and what is wrong, never a half-read one."""
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            if meta.get("format") != SNAPSHOT_FORMAT or "tokens" not in meta:
                raise ValueError("not a pocketlab snapshot (no snapshot metadata)")
            if meta.get("version") != SNAPSHOT_VERSION:
                raise ValueError(
                    f"snapshot format version {meta.get('version')!r} (written by pocketlab {meta.get('engine')}); "
                    f"this engine reads version {SNAPSHOT_VERSION!r}"
                )
            tensors = load_file(str(path))
            fields = {k: v for k, v in meta.items() if k != "sha256"}
            if meta.get("sha256") != _digest(fields, tensors):
                raise ValueError("checksum mismatch: the file was changed or damaged after it was written")
            tokens = [int(t) for t in meta["tokens"].split(",") if t]
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        return cls(tokens, tensors, meta.get("model", ""), meta.get("dtype", ""))


def _digest(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of the metadata and of every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _engine_version() -> str:
    try:
        return importlib.metadata.version("pocketlab")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def model_id(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> str:
    """A short digest of the config and the weights (names, shapes, first values at bf16 precision, so every dtype of
    one checkpoint agrees): a snapshot restores only into the model that made it."""
    h = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str).encode())
    for name in sorted(weights):
        t = weights[name]
        h.update(f"{name}:{tuple(t.shape)}".encode())
        h.update(t.detach().reshape(-1)[:64].to("cpu", torch.bfloat16).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class SlotCache:
    k: dict[int | str, torch.Tensor]
    v: dict[int | str, torch.Tensor]

    def __init__(self, cfg: ModelConfig, opts: EngineOptions):
        self.cfg, self.max_seq = cfg, opts.max_seq_len
        self.model_id, self.dtype = "", opts.dtype  # the engine sets model_id once the weights are known
        self.num_slots = self.scratch = opts.slot_count  # the scratch row (padding, graph filler) follows the slots
        rows, dev, dt = self.num_slots + 1, opts.device, opts.torch_dtype
        self.k, self.v, self.conv, self.rec = {}, {}, {}, {}
        for i in cfg.attention_layers:
            shape = (rows, cfg.num_key_value_heads, opts.max_seq_len, cfg.head_dim)
            self.k[i] = torch.zeros(shape, device=dev, dtype=dt)
            self.v[i] = torch.zeros(shape, device=dev, dtype=dt)
        conv_row = (cfg.linear_conv_dim, cfg.linear_conv_kernel_dim - 1)
        rec_row = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        # every layer's rows in one bank, so a served step launched ahead moves its states in one copy a bank
        self.conv_bank = torch.zeros(len(cfg.linear_layers), rows, *conv_row, device=dev, dtype=dt)
        self.rec_bank = torch.zeros(len(cfg.linear_layers), rows, *rec_row, device=dev, dtype=torch.float32)
        self.allocate_aside(0)
        self.bank_row = {i: j for j, i in enumerate(cfg.linear_layers)}
        for i, j in self.bank_row.items():
            self.conv[i], self.rec[i] = self.conv_bank[j], self.rec_bank[j]
        self.extra: dict[str, torch.Tensor] = {}  # [rows, ...] per-slot state other parts register (MTP queue)
        self.slots = [SlotState(s) for s in range(self.num_slots)]
        self._listener: HistoryListener | None = None

    def listen(self, listener: HistoryListener | None) -> None:
        """Register the one listener told of every slot's history changes, clears and restores (None: nobody)."""
        self._listener = listener
        for slot in self.slots:
            slot.listen(listener)

    def add_kv(self, key: str, kv_heads: int, head_dim: int) -> None:
        """One more attention KV region per slot (e.g. the MTP layer's), snapshotted like the model's."""
        ref = next(iter(self.k.values()))
        self.k[key] = torch.zeros(ref.shape[0], kv_heads, self.max_seq, head_dim, device=ref.device, dtype=ref.dtype)
        self.v[key] = torch.zeros_like(self.k[key])

    def add_extra(self, name: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """A per-slot tensor [slots+1, *shape], zeroed by clear() and carried whole by snapshots."""
        self.extra[name] = torch.zeros(self.num_slots + 1, *shape, dtype=dtype, device=device)
        return self.extra[name]

    def allocate_aside(self, rows: int) -> None:
        """Rows aside for every Gated DeltaNet layer's states (graphs.StepGraphs allocates them: `aside_rows`)."""
        self.conv_aside = self.conv_bank.new_zeros(self.conv_bank.shape[0], rows, *self.conv_bank.shape[2:])
        self.rec_aside = self.rec_bank.new_zeros(self.rec_bank.shape[0], rows, *self.rec_bank.shape[2:])
        self.aside_index = torch.arange(rows, device=self.conv_bank.device)

    @property
    def aside_rows(self) -> int:
        """Batch rows a decode step launched ahead can store its Gated DeltaNet states aside for (`aside`)."""
        return len(self.aside_index)

    def aside(self, layer: int, rows: int) -> tuple[Into, Into]:
        """Where Gated DeltaNet layer `layer` stores the conv windows and recurrent states of a forward's `rows` rows
        instead of in their slots: rows 0..rows-1 aside (ForwardContext.states_aside)."""
        j, index = self.bank_row[layer], self.aside_index[:rows]
        return Into(self.conv_aside[j], index), Into(self.rec_aside[j], index)

    def take_aside(self, slot_ids: torch.Tensor) -> None:
        """Copy the states stored aside for batch rows 0..n-1 into slots slot_ids [n] (device): the step launched
        ahead that stored them is being served."""
        n = len(slot_ids)
        self.conv_bank.index_copy_(1, slot_ids, self.conv_aside[:, :n])
        self.rec_bank.index_copy_(1, slot_ids, self.rec_aside[:, :n])

    # -- per-slot state ------------------------------------------------------------------------
    def clear(self, slot: int) -> None:
        """Forget a slot's sequence. K/V rows need no wipe (masked by position); recurrent state does."""
        if self._listener is not None:  # before anything is zeroed: it may checkpoint the live state
            self._listener.before_clear(slot)
        self.slots[slot].truncate(0)
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
        return Snapshot(list(self.slots[slot].tokens), tensors, self.model_id, self.dtype)

    def check_snapshot(self, snap: Snapshot) -> None:
        """ValueError unless the snapshot came from this model, in this dtype, with exactly this engine's tensors."""
        if snap.model and snap.model != self.model_id:
            raise ValueError(f"snapshot was taken from another model (id {snap.model}; this engine: {self.model_id})")
        if snap.dtype and snap.dtype != self.dtype:
            raise ValueError(f"snapshot holds {snap.dtype} state; this engine runs {self.dtype}")
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
            if snap.tensors[name].dtype != self.bank_dtype(name):
                raise ValueError(
                    f"snapshot tensor {name} is {snap.tensors[name].dtype}, this engine holds {self.bank_dtype(name)}"
                )
            if snap.tensors[name].is_floating_point() and not bool(snap.tensors[name].isfinite().all()):
                raise ValueError(f"snapshot tensor {name} holds NaN or inf")

    def bank_dtype(self, name: str) -> torch.dtype:
        """The dtype of the bank a snapshot tensor name ("k.0", "rec.1", "x.mtp_queue") belongs to."""
        kind, key = name.split(".", 1)
        bank = cast(
            "dict[object, torch.Tensor]",
            {"k": self.k, "v": self.v, "conv": self.conv, "rec": self.rec, "x": self.extra}[kind],
        )
        return next(t.dtype for k, t in bank.items() if str(k) == key)

    def snapshot_shapes(self, n: int) -> dict[str, tuple]:
        shapes: dict[str, tuple[int, ...]] = {}
        for i in self.k:
            shapes[f"k.{i}"] = shapes[f"v.{i}"] = (self.k[i].shape[1], n, self.k[i].shape[3])
        for i in self.conv:
            shapes[f"conv.{i}"], shapes[f"rec.{i}"] = tuple(self.conv[i].shape[1:]), tuple(self.rec[i].shape[1:])
        for name, x in self.extra.items():
            shapes[f"x.{name}"] = tuple(x.shape[1:])
        return shapes

    def restore(self, snap: Snapshot, slot: int) -> None:
        if self._listener is not None:  # before the rows are overwritten: it may retain what they hold
            self._listener.before_restore(slot)
        n = snap.position
        for i in self.k:
            self.k[i][slot, :, :n] = snap.tensors[f"k.{i}"]
            self.v[i][slot, :, :n] = snap.tensors[f"v.{i}"]
        for i in self.conv:
            self.conv[i][slot] = snap.tensors[f"conv.{i}"]
            self.rec[i][slot] = snap.tensors[f"rec.{i}"]
        for name, x in self.extra.items():
            x[slot] = snap.tensors[f"x.{name}"]
        self.slots[slot].replace(snap.tokens)
