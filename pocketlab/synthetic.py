"""Random-weight Hugging Face checkpoints: tiny presets for tests, real shapes for GPU runs.

Models are built by transformers itself, so the tensor names, shapes and files are exactly what HF
writes. Tiny presets use a large init (0.2) so logits are peaked and greedy tokens are meaningful.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, initializer_range=0.2, max_position_embeddings=4096,
             tie_word_embeddings=False)
_TINY_HYBRID = dict(_TINY, initializer_range=0.1, num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16, rope_parameters=dict(
                        rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25))

PRESETS: dict[str, tuple[str, dict]] = {
    "tiny-qwen2": ("qwen2", dict(_TINY, num_hidden_layers=2)),
    "tiny-qwen3": ("qwen3", dict(_TINY, num_hidden_layers=2)),
    "tiny-qwen3_5": ("qwen3_5_text", _TINY_HYBRID),
    "qwen3-0.6b": ("qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                                 tie_word_embeddings=True, max_position_embeddings=40960)),
    "qwen3-8b": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                               tie_word_embeddings=False, max_position_embeddings=40960)),
    "qwen3.5-0.8b": ("qwen3_5_text", dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584,
                                          num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                                          head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                                          linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True,
                                          rope_parameters=dict(rope_type="default", rope_theta=1e7,
                                                               partial_rotary_factor=0.25))),
    "qwen3.5-9b": ("qwen3_5_text", dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                                        num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
                                        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                                        linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False,
                                        rope_parameters=dict(rope_type="default", rope_theta=1e7,
                                                             partial_rotary_factor=0.25))),
}
DEFAULT_PRESET = "tiny-qwen3"

_CONFIGS = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "qwen3_5_text": "Qwen3_5TextConfig"}
_MODELS = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM"}


def hf_config(preset: str, **overrides) -> transformers.PretrainedConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    model_type, kwargs = PRESETS[preset]
    return getattr(transformers, _CONFIGS[model_type])(**(kwargs | overrides))


def build_hf_model(preset: str, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
                   **overrides):
    """The HF model with random weights from `seed`, built directly on `device` (real shapes fit on a GPU)."""
    config = hf_config(preset, **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, _MODELS[PRESETS[preset][0]])._from_config(config, dtype=dtype)
    return model.eval()


def write_checkpoint(preset: str, path: str | Path, seed: int = 0, max_shard_size: str | None = None,
                     **overrides) -> Path:
    """Write config.json + safetensors (sharded with an index when `max_shard_size` is given)."""
    path = Path(path)
    model = build_hf_model(preset, seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    (path / "pocketlab_preset.json").write_text(json.dumps({"preset": preset, "seed": seed}))
    return path


def ensure_checkpoint(preset: str = DEFAULT_PRESET, root: str | Path = "checkpoints", seed: int = 0) -> Path:
    """The checkpoint folder for a preset, written once and reused (cheap for tiny presets)."""
    path = Path(root) / f"{preset}-seed{seed}"
    if not (path / "config.json").is_file():
        write_checkpoint(preset, path, seed)
    return path
