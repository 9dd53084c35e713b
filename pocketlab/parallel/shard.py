"""Which part of every weight and every slot-state tensor one tensor-parallel rank holds (Megatron-style).

Column-parallel (output rows split by heads): q/k/v, gate/up, the Gated DeltaNet input projections, with the conv
weights, A_log and dt_bias sliced with their heads. Row-parallel (input columns split): o_proj, down_proj, out_proj;
the model sums their parts with one all-reduce each. Vocab-parallel: embed_tokens and lm_head rows (Qwen vocabularies
divide by every power of two up to 128). KV heads are split when there are at least as many as ranks, else each rank
keeps the one its query heads read (replicated). MoE experts are split like the MLP, each by its intermediate dim (the
router is replicated, so every rank routes alike; one all-reduce sums the block). Norms, the MTP head's fc and
everything else are replicated.

The slot state follows its heads: K/V by KV head, the conv window by conv channel, the recurrent state by value
head. `local_snapshot` slices a whole-model snapshot for this rank; `merge_state` puts the ranks' parts back
together, so a snapshot file always holds the unsharded layout and restores at any world size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..config import ModelConfig

COLUMN = ("q_proj", "gate_proj", "up_proj", "in_proj_z", "in_proj_b", "in_proj_a", "A_log", "dt_bias")
ROW = ("o_proj", "down_proj", "out_proj")
KV = ("k_proj", "v_proj")
GDN_CHANNELS = ("in_proj_qkv", "conv1d")  # rows laid out [q | k | v] by key, key, value heads
VOCAB = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class Shard:
    """This process's place in a tensor-parallel group: `rank` of `world`."""

    rank: int = 0
    world: int = 1

    # -- what the model looks like on one rank -------------------------------------------------------------------
    def check(self, cfg: ModelConfig) -> None:
        """ValueError unless every split this world size needs divides evenly."""
        n, bad = self.world, []
        if cfg.num_attention_heads % n:
            bad.append(f"num_attention_heads={cfg.num_attention_heads}")
        kv = cfg.num_key_value_heads
        if (kv % n if kv >= n else n % kv) or cfg.num_attention_heads % kv:
            bad.append(f"num_key_value_heads={kv} (split needs kv % N == 0, replication N % kv == 0)")
        if cfg.vocab_size % n:
            bad.append(f"vocab_size={cfg.vocab_size}")
        for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(cfg, name) % n:
                bad.append(f"{name}={getattr(cfg, name)}")
        if cfg.is_hybrid and (cfg.linear_num_key_heads % n or cfg.linear_num_value_heads % n):
            heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
            bad.append("linear_num_key_heads={}, linear_num_value_heads={}".format(*heads))
        if bad:
            raise ValueError(f"tensor_parallel={n} does not divide this model's " + ", ".join(bad))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of this rank's part of the model: its heads, its slice of the MLP and of the vocabulary. The
        model and the slot cache are built from it unchanged."""
        if self.world == 1:
            return cfg
        self.check(cfg)
        n = self.world
        return dataclasses.replace(
            cfg,
            num_attention_heads=cfg.num_attention_heads // n,
            num_key_value_heads=max(cfg.num_key_value_heads // n, 1),
            intermediate_size=cfg.intermediate_size // n,
            moe_intermediate_size=cfg.moe_intermediate_size // n,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // n,
            linear_num_key_heads=cfg.linear_num_key_heads // n if cfg.is_hybrid else cfg.linear_num_key_heads,
            linear_num_value_heads=cfg.linear_num_value_heads // n if cfg.is_hybrid else cfg.linear_num_value_heads,
            vocab_size=cfg.vocab_size // n,
        )

    # -- weights ------------------------------------------------------------------------------------------------
    def weights(self, tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """This rank's slice of every (whole-model, validated) tensor, each a contiguous copy."""
        return {name: self.weight(name, t, cfg).contiguous() for name, t in tensors.items()}

    def weight(self, name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        if self.world == 1:
            return t
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, d]: every expert's gate and up rows, each split
            return torch.cat([self._part(half, 1) for half in t.chunk(2, dim=1)], dim=1)
        if name.endswith("experts.down_proj"):  # [E, d, I]: every expert's input columns
            return self._part(t, 2)
        module = name.split(".")[-2] if name.endswith((".weight", ".bias")) else name.split(".")[-1]
        if module in COLUMN:
            return self._part(t, 0)
        if module in ROW:
            return self._part(t, 1)
        if module in KV:
            return self._kv(t, cfg)
        if module in GDN_CHANNELS:
            return self._gdn_channels(t, cfg)
        if module in VOCAB:
            return self._part(t, 0)
        return t  # norms, mtp.fc: replicated

    # -- slot state -----------------------------------------------------------------------------------------------
    def local_snapshot(self, tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """This rank's part of a whole-model snapshot's tensors. A tensor whose shape is not the whole model's is
        passed through unsliced, for the cache's own check to refuse with its message."""
        if self.world == 1:
            return tensors
        full = state_shapes(cfg)
        out = {}
        for name, t in tensors.items():
            kind = name.split(".", 1)[0]
            if kind not in full or tuple(t.shape[:1]) != (full[kind],):
                out[name] = t
            elif kind in ("k", "v"):
                out[name] = self._kv(t, cfg)
            elif kind == "conv":
                out[name] = self._gdn_channels(t, cfg)
            else:
                out[name] = self._part(t, 0)
        return out

    def merge_state(self, name: str, parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
        """The whole-model tensor of snapshot tensor `name` from every rank's part (rank order)."""
        kind = name.split(".", 1)[0]
        if kind in ("k", "v"):
            if cfg.num_key_value_heads >= self.world:
                return torch.cat(parts)
            return torch.cat(parts[:: self.world // cfg.num_key_value_heads])  # one rank per replicated head
        if kind == "conv":
            sections = [p.split(_gdn_sections(cfg, self.world)) for p in parts]
            return torch.cat([torch.cat(column) for column in zip(*sections, strict=True)])
        if kind == "rec":
            return torch.cat(parts)
        return parts[0]  # replicated (the MTP queue)

    # -- slicing --------------------------------------------------------------------------------------------------
    def _part(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        size = t.shape[dim] // self.world
        return t.narrow(dim, self.rank * size, size)

    def _kv(self, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """K/V projections or cache rows by KV head: split, or the one head this rank's query heads read."""
        kv = cfg.num_key_value_heads
        if kv >= self.world:
            return self._part(t, 0)
        width = t.shape[0] // kv
        return t.narrow(0, self.rank // (self.world // kv) * width, width)

    def _gdn_channels(self, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """Gated DeltaNet conv channels [q | k | v]: this rank's heads of each section."""
        sections = t.split(_gdn_sections(cfg, 1))
        return torch.cat([self._part(s, 0) for s in sections])


def _gdn_sections(cfg: ModelConfig, world: int) -> list[int]:
    """Sizes of the q, k, v sections of the Gated DeltaNet conv channels, on one of `world` ranks."""
    qk = cfg.linear_num_key_heads * cfg.linear_key_head_dim // world
    return [qk, qk, cfg.linear_num_value_heads * cfg.linear_value_head_dim // world]


def state_shapes(cfg: ModelConfig) -> dict[str, int]:
    """The whole model's leading (head or channel) dimension of each kind of snapshot tensor."""
    return {
        "k": cfg.num_key_value_heads,
        "v": cfg.num_key_value_heads,
        "conv": sum(_gdn_sections(cfg, 1)),
        "rec": cfg.linear_num_value_heads,
    }
