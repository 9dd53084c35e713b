"""Model families by HF model_type."""

from ..config import ModelConfig


def build_model(cfg: ModelConfig, weights: dict, opts):
    if cfg.is_hybrid:
        from .qwen3_5 import HybridModel

        return HybridModel(cfg, weights, opts)
    from .qwen3 import DenseModel

    return DenseModel(cfg, weights, opts)
