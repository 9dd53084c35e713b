"""Random-weight Hugging Face checkpoints: tiny presets for tests, real shapes for GPU runs.

Models are built by transformers itself, so the tensor names, shapes and files are exactly what HF
writes. Tiny presets use a large init (0.2) so logits are peaked and greedy tokens are meaningful.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from ..config import ModelConfig
from ..loader import _mtp_shapes

_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    initializer_range=0.2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
_TINY_HYBRID = dict(
    _TINY,
    initializer_range=0.1,
    num_hidden_layers=4,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
)
# Mixture of experts: 8 experts of width 32, top-2; Qwen3-MoE with a dense layer (mlp_only_layers) among the sparse
_TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
_TINY_QWEN3_MOE = dict(_TINY, **_TINY_MOE, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)
_TINY_QWEN3_5_MOE = dict(_TINY_HYBRID, **_TINY_MOE, shared_expert_intermediate_size=32)

# Tiny presets with a real Qwen vocabulary and its tokenizer (see TOKENIZERS): text in, text out. Their embedding
# is tied and 151,936 (248,320) rows deep, ~10M (16M) parameters, so only the text tests and notebook use them.
_TEXT = dict(tie_word_embeddings=True, num_hidden_layers=2)
PRESETS: dict[str, tuple[str, dict]] = {
    "tiny-qwen2": ("qwen2", dict(_TINY, num_hidden_layers=2)),
    "tiny-qwen3": ("qwen3", dict(_TINY, num_hidden_layers=2)),
    "tiny-qwen3_5": ("qwen3_5_text", _TINY_HYBRID),
    "tiny-qwen2-text": ("qwen2", dict(_TINY, **_TEXT, vocab_size=151936, eos_token_id=151645)),
    "tiny-qwen3-text": ("qwen3", dict(_TINY, **_TEXT, vocab_size=151936, eos_token_id=151645)),
    "tiny-qwen3_5-text": ("qwen3_5_text", dict(_TINY_HYBRID, **_TEXT, vocab_size=248320, eos_token_id=248046)),
    # with a multi-token-prediction head: HF ignores the config key and the mtp.* tensors; see add_mtp()
    "tiny-qwen3_5-mtp": ("qwen3_5_text", dict(_TINY_HYBRID, mtp_num_hidden_layers=1)),
    "tiny-qwen3_moe": ("qwen3_moe", _TINY_QWEN3_MOE),
    "tiny-qwen3_5_moe": ("qwen3_5_moe_text", _TINY_QWEN3_5_MOE),
    "tiny-qwen3_5_moe-mtp": ("qwen3_5_moe_text", dict(_TINY_QWEN3_5_MOE, mtp_num_hidden_layers=1)),
    "tiny-qwen3_moe-text": ("qwen3_moe", dict(_TINY_QWEN3_MOE, **_TEXT, vocab_size=151936, eos_token_id=151645)),
    "tiny-qwen3_5_moe-text": (
        "qwen3_5_moe_text",
        dict(_TINY_QWEN3_5_MOE, **_TEXT, vocab_size=248320, eos_token_id=248046),
    ),
    "qwen3-0.6b": (
        "qwen3",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            rope_theta=1e6,
            tie_word_embeddings=True,
            max_position_embeddings=40960,
        ),
    ),
    "qwen3-8b": (
        "qwen3",
        dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rope_theta=1e6,
            tie_word_embeddings=False,
            max_position_embeddings=40960,
        ),
    ),
    "qwen3.5-0.8b": (
        "qwen3_5_text",
        dict(
            vocab_size=248320,
            hidden_size=1024,
            intermediate_size=3584,
            num_hidden_layers=24,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
        ),
    ),
    "qwen3.5-9b": (
        "qwen3_5_text",
        dict(
            vocab_size=248320,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=32,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
        ),
    ),
    "qwen3-30b-a3b": (
        "qwen3_moe",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=True,
            rope_theta=1e6,
            tie_word_embeddings=False,
            max_position_embeddings=40960,
        ),
    ),
    "qwen3.5-35b-a3b": (
        "qwen3_5_moe_text",
        dict(
            vocab_size=248320,
            hidden_size=2048,
            num_hidden_layers=40,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
        ),
    ),
    # the tensor-parallel bench's large hybrid: the shape as we read Qwen3.5-27B's config.json (check it against the
    # real file before quoting figures as that model's)
    "qwen3.5-27b-shape": (
        "qwen3_5_text",
        dict(
            vocab_size=248320,
            hidden_size=5120,
            intermediate_size=17408,
            num_hidden_layers=64,
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=48,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
        ),
    ),
}


def first_layers(preset: str, n: int) -> tuple[str, dict]:
    """A real-shape preset cut to its first n layers, every tensor at its real shape: one GPU then holds the float32
    HF reference next to the engines that the notebooks build, where it cannot hold the whole model twice."""
    model_type, kwargs = PRESETS[preset]
    return model_type, dict(kwargs, num_hidden_layers=n)


# The MoE notebook presets: NOT the full models (4 of 48 / 40 layers; Qwen3.5's 4 are one period of 3 linear-attention
# layers and 1 full-attention layer), so what they measure is per-layer parity and behaviour, never the model's figures.
PRESETS["qwen3-30b-a3b-4-layers"] = first_layers("qwen3-30b-a3b", 4)
PRESETS["qwen3.5-35b-a3b-4-layers"] = first_layers("qwen3.5-35b-a3b", 4)
DEFAULT_PRESET = "tiny-qwen3"
# presets whose checkpoint folder gets the real tokenizer and generation_config.json of their family
TOKENIZERS = {
    "tiny-qwen2-text": "qwen2",
    "tiny-qwen3-text": "qwen3",
    "tiny-qwen3_5-text": "qwen3_5",
    "tiny-qwen3_moe-text": "qwen3",
    "tiny-qwen3_5_moe-text": "qwen3_5",
    "qwen3-0.6b": "qwen3",
    "qwen3-8b": "qwen3",
    "qwen3.5-0.8b": "qwen3_5",
    "qwen3.5-9b": "qwen3_5",
    "qwen3-30b-a3b": "qwen3",
    "qwen3.5-35b-a3b": "qwen3_5",
}

_CONFIGS = {
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen3_5_text": "Qwen3_5TextConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "qwen3_5_moe_text": "Qwen3_5MoeTextConfig",
}
_MODELS = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}


def hf_config(preset: str, **overrides) -> transformers.PretrainedConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    model_type, kwargs = PRESETS[preset]
    return getattr(transformers, _CONFIGS[model_type])(**(kwargs | overrides))


def build_hf_model(
    preset: str,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    norm_noise: float = 0.0,
    **overrides,
):
    """The HF model with random weights from `seed`, built directly on `device` (real shapes fit on a GPU). HF starts
    every RMSNorm as the identity (w = 1, or 0 in (1 + w)); `norm_noise` adds N(0, norm_noise) to each norm weight,
    so a norm weight dropped or misplaced changes the logits."""
    config = hf_config(preset, **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, _MODELS[PRESETS[preset][0]])._from_config(config, dtype=dtype)
    if norm_noise:
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if name.endswith("norm.weight"):
                    weight += norm_noise * torch.randn(weight.shape, device=weight.device, dtype=weight.dtype)
    return model.eval()


def write_checkpoint(
    preset: str,
    path: str | Path,
    seed: int = 0,
    max_shard_size: str | None = None,
    tokenizer: bool = True,
    norm_noise: float = 0.0,
    **overrides,
) -> Path:
    """Write config.json + safetensors (sharded with an index when `max_shard_size` is given), and for presets
    with a real vocabulary (unless tokenizer=False) the tokenizer files and generation_config.json of their family.
    `norm_noise`: build_hf_model's."""
    path = Path(path)
    model = build_hf_model(preset, seed, norm_noise=norm_noise, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if getattr(model.config, "mtp_num_hidden_layers", 0):
        add_mtp(path, seed)
    if preset in TOKENIZERS and tokenizer:
        from .tokenizers import FAMILIES, write_tokenizer

        write_tokenizer(TOKENIZERS[preset], path)
        gen = FAMILIES[TOKENIZERS[preset]].generation
        (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    (path / "pocketlab_preset.json").write_text(json.dumps({"preset": preset, "seed": seed}))
    return path


def ensure_checkpoint(
    preset: str = DEFAULT_PRESET, root: str | Path = "checkpoints", seed: int = 0, tokenizer: bool = True
) -> Path:
    """The checkpoint folder for a preset, written once and reused (cheap for tiny presets)."""
    path = Path(root) / f"{preset}-seed{seed}"
    if not (path / "config.json").is_file():
        write_checkpoint(preset, path, seed, tokenizer=tokenizer)
    return path


def text_checkpoint(model: str | Path, root: str | Path = "checkpoints", seed: int = 0) -> Path:
    """A folder with a tokenizer for `model`: a checkpoint folder as it is; a preset's tiny twin with the real
    vocabulary of its family (tiny-qwen3 and qwen3-8b -> tiny-qwen3-text), written once under `root`."""
    name = str(model)
    if name not in PRESETS:
        return Path(model)
    if not (name in TOKENIZERS and name.startswith("tiny")):
        twins = {kind: p for p in TOKENIZERS if p.startswith("tiny") for kind in [PRESETS[p][0]]}
        name = twins[PRESETS[name][0]]
    return ensure_checkpoint(name, root, seed)


# -- multi-token prediction head ---------------------------------------------------------------------
def mtp_weights(
    cfg, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32, std: float | None = None
) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors for a pocketlab ModelConfig (HF builds none): every name and shape the loader
    expects, matrices ~ N(0, std) and the (1 + w) norm weights ~ N(0, 0.1), so a w-vs-(1+w) slip shows."""
    std = std if std is not None else (0.1 if cfg.hidden_size <= 256 else 0.02)
    gen = torch.Generator().manual_seed(10_000 + seed)
    out = {}
    for name, shape in sorted(_mtp_shapes(cfg).items()):
        scale = 0.1 if len(shape) == 1 else std
        out[name] = (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)
    return unstack_experts(out)


def unstack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked `...experts.gate_up_proj` / `down_proj` as the hub names them: one gate/up/down_proj per expert."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".experts.gate_up_proj"):
            block = name.removesuffix(".gate_up_proj")
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{block}.{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{block}.{e}.up_proj.weight"] = up[e].contiguous()
        elif name.endswith(".experts.down_proj"):
            block = name.removesuffix(".down_proj")
            out |= {f"{block}.{e}.down_proj.weight": d.contiguous() for e, d in enumerate(t.unbind(0))}
        else:
            out[name] = t
    return out


def add_mtp(path: str | Path, seed: int = 0) -> None:
    """Give a written Qwen3.5 checkpoint random mtp.* tensors, where real checkpoints keep them: in the
    weights files (a new shard listed in the index when sharded), next to the `mtp_num_hidden_layers`
    key that config.json already carries (HF's config class keeps unknown keys)."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    cfg = ModelConfig.from_pretrained(path)
    if not cfg.mtp_num_hidden_layers:
        raise ValueError(f"{path}/config.json declares no mtp_num_hidden_layers")
    dtype = next(iter(load_file(str(next(path.glob("*.safetensors")))).values())).dtype
    extra = {k: v.contiguous() for k, v in mtp_weights(cfg, seed, dtype=dtype).items()}
    index = path / "model.safetensors.index.json"
    if index.is_file():
        save_file(extra, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
        doc = json.loads(index.read_text())
        doc["weight_map"].update({k: "model-mtp.safetensors" for k in extra})
        index.write_text(json.dumps(doc, indent=2))
    else:
        file = path / "model.safetensors"
        save_file(load_file(str(file)) | extra, str(file), metadata={"format": "pt"})
