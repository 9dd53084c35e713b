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


@dataclass
class SlotState:
    tokens: list[int] = field(default_factory=list)  # history whose K/V (or state) is in the cache
    owner: int | None = None                          # request id holding the slot, if allocated

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
        save_file({k: v.contiguous().cpu() for k, v in self.tensors.items()}, str(path),
                  metadata={"tokens": ",".join(map(str, self.tokens))})

    @classmethod
    def load(cls, path: str | Path) -> "Snapshot":
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
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
            cfg.linear_num_value_heads * cfg.linear_value_head_dim
        for i in cfg.linear_layers:
            self.conv[i] = torch.zeros(rows, conv_dim, cfg.linear_conv_kernel_dim - 1, device=dev, dtype=dt)
            self.rec[i] = torch.zeros(rows, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                      cfg.linear_value_head_dim, device=dev, dtype=torch.float32)
        self.slots = [SlotState() for _ in range(opts.max_slots)]

    # -- per-slot state ------------------------------------------------------------------------
    def clear(self, slot: int) -> None:
        """Forget a slot's sequence. K/V rows need no wipe (masked by position); recurrent state does."""
        self.slots[slot].tokens = []
        for i in self.conv:
            self.conv[i][slot].zero_()
            self.rec[i][slot].zero_()

    def snapshot(self, slot: int) -> Snapshot:
        n, tensors = self.slots[slot].position, {}
        for i in self.k:
            tensors[f"k.{i}"] = self.k[i][slot, :, :n].clone()
            tensors[f"v.{i}"] = self.v[i][slot, :, :n].clone()
        for i in self.conv:
            tensors[f"conv.{i}"] = self.conv[i][slot].clone()
            tensors[f"rec.{i}"] = self.rec[i][slot].clone()
        return Snapshot(list(self.slots[slot].tokens), tensors)

    def check_snapshot(self, snap: Snapshot) -> None:
        expected = self.snapshot_shapes(snap.position)
        if snap.position > self.max_seq:
            raise ValueError(f"snapshot holds {snap.position} tokens, more than max_seq_len={self.max_seq}")
        if set(snap.tensors) != set(expected):
            raise ValueError("snapshot tensors do not match this engine's model "
                             f"(missing {sorted(set(expected) - set(snap.tensors))[:3]}, "
                             f"extra {sorted(set(snap.tensors) - set(expected))[:3]})")
        for name, shape in expected.items():
            if tuple(snap.tensors[name].shape) != shape:
                raise ValueError(f"snapshot tensor {name} has shape {tuple(snap.tensors[name].shape)}, "
                                 f"this engine needs {shape}")

    def snapshot_shapes(self, n: int) -> dict[str, tuple]:
        shapes = {}
        for i in self.k:
            shapes[f"k.{i}"] = shapes[f"v.{i}"] = (self.k[i].shape[1], n, self.k[i].shape[3])
        for i in self.conv:
            shapes[f"conv.{i}"], shapes[f"rec.{i}"] = tuple(self.conv[i].shape[1:]), tuple(self.rec[i].shape[1:])
        return shapes

    def restore(self, snap: Snapshot, slot: int) -> None:
        n = snap.position
        for i in self.k:
            self.k[i][slot, :, :n] = snap.tensors[f"k.{i}"]
            self.v[i][slot, :, :n] = snap.tensors[f"v.{i}"]
        for i in self.conv:
            self.conv[i][slot] = snap.tensors[f"conv.{i}"]
            self.rec[i][slot] = snap.tensors[f"rec.{i}"]
        self.slots[slot].tokens = list(snap.tokens)
