"""Model facts read from a Hugging Face config.json, and the engine's own options."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

DENSE_TYPES = ("qwen2", "qwen3")
HYBRID_TYPES = ("qwen3_5", "qwen3_5_text")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_SPECULATIVE_TOKENS = 7


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()
    # Gated DeltaNet (hybrid models only)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    mtp_num_hidden_layers: int = 0
    mtp_use_dedicated_embeddings: bool = False  # Qwen3.5 checkpoints: False (the head shares embed_tokens)

    @property
    def is_hybrid(self) -> bool:
        return self.model_type in HYBRID_TYPES

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in DENSE_TYPES + HYBRID_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; pocketlab serves {DENSE_TYPES + HYBRID_TYPES}")
        text = dict(raw.get("text_config") or raw)  # qwen3_5 nests the language model under text_config
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        n_layers = text["num_hidden_layers"]
        hybrid = model_type in HYBRID_TYPES
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = text.get("full_attention_interval", 4)
            layer_types = [
                "linear_attention" if hybrid and (i + 1) % interval else "full_attention" for i in range(n_layers)
            ]
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in text.items() if k in known}
        values.update(
            model_type=model_type,
            head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
            rope_theta=rope.get("rope_theta", text.get("rope_theta", 1e6)),
            partial_rotary_factor=rope.get(
                "partial_rotary_factor", text.get("partial_rotary_factor", 0.25 if hybrid else 1.0)
            ),
            attention_bias=text.get("attention_bias", model_type == "qwen2"),
            layer_types=tuple(layer_types),
        )
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not supported (only the default rotary embedding)")
        return cls(**values)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ValueError(f"{path}: no config.json; expected a Hugging Face checkpoint folder")
        return cls.from_dict(json.loads(file.read_text()))


@dataclass
class EngineOptions:
    max_slots: int | str = 4  # "auto": as many as memory_fraction of the free device memory holds (pocketlab.memory)
    memory_fraction: float = 0.9  # of the device memory free at start that the engine may plan to use
    max_seq_len: int = 1024
    prefill_chunk: int = 2048  # longer prompts are prefilled in chunks of this many tokens
    device: str = "cpu"
    dtype: str = "float32"
    cuda_graphs: bool = True  # replay batch decode from captured graphs on CUDA
    compile: bool = True  # fuse elementwise chains with torch.compile in captured decode graphs
    decode_attention: str = "auto"  # "triton" (live keys read in place), "sdpa", or "auto": triton on CUDA
    linear_decode: str = "auto"  # Gated DeltaNet decode: "triton" (states updated in place), "torch", "auto"
    fused_linear: str = "auto"  # few-row projections with their norm / residual add / SwiGLU in one Triton kernel
    graph_batch_sizes: tuple[int, ...] = field(default=(1, 2, 4, 8, 16, 32, 64))
    batch_invariant: bool = False  # logits bitwise independent of the batch (Triton kernels; CPU: interpreter)
    speculative_tokens: int = 0  # drafts per decode step (MTP head), verified in one forward; 0: off
    speculative_rollback: str = "states"  # GDN state after a rejection: per-token "states" kept, or "replay"
    prefix_cache: bool = True  # reuse K/V and states of shared prompt prefixes (per slot and across slots)
    prefix_cache_bytes: int = 1 << 30  # budget for retained prefixes and state checkpoints (live slots never count)
    prefix_block: int = 16  # tokens per hashed block in the cross-slot lookup
    checkpoint_stride: int = 512  # hybrid: also checkpoint the recurrent state at multiples of this (0: prompt ends)

    def __post_init__(self):
        if not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_tokens={self.speculative_tokens}: need 0 <= k <= {MAX_SPECULATIVE_TOKENS}")
        if self.speculative_rollback not in ("replay", "states"):
            raise ValueError(f"speculative_rollback {self.speculative_rollback!r} is not one of replay, states")
        if self.batch_invariant:
            self._check_batch_invariant()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {list(DTYPES)}")
        if self.decode_attention not in ("auto", "triton", "sdpa"):
            raise ValueError(f"decode_attention {self.decode_attention!r} is not one of auto, triton, sdpa")
        for name in ("linear_decode", "fused_linear"):
            if getattr(self, name) not in ("auto", "triton", "torch"):
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of auto, triton, torch")
        if self.max_slots != "auto" and not (isinstance(self.max_slots, int) and self.max_slots >= 1):
            raise ValueError(f"max_slots={self.max_slots!r}: an int >= 1, or 'auto'")
        if self.max_seq_len < 2 or self.prefill_chunk < 1:
            raise ValueError("max_seq_len >= 2 and prefill_chunk >= 1 are required")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction={self.memory_fraction}: need 0 < fraction <= 1")
        if self.prefix_cache_bytes < 0 or self.prefix_block < 1 or self.checkpoint_stride < 0:
            raise ValueError("prefix_cache_bytes >= 0, prefix_block >= 1 and checkpoint_stride >= 0 are required")

    def _check_batch_invariant(self) -> None:
        if importlib.util.find_spec("triton") is None:
            raise ValueError("batch_invariant=True runs Triton kernels: install triton")
        if torch.device(self.device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "batch_invariant=True on the CPU runs the Triton kernels in Triton's interpreter: set "
                "TRITON_INTERPRET=1 in the environment before Python starts"
            )
        if self.speculative_rollback != "states":
            raise ValueError("batch_invariant=True rolls speculative drafts back by kept states: use rollback 'states'")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
