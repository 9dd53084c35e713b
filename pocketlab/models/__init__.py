"""Model families by HF model_type."""

import torch

from ..config import ModelConfig
from ..layers import prefetch
from ..layers.kernels import fuses_linear


def build_model(cfg: ModelConfig, weights: dict, opts):
    """The model for cfg.model_type. Where decode projections run our GEMV on a Hopper GPU, the blocks' weights
    are packed in reading order, so each launch prefetches the next one's weights into L2 (layers.prefetch)."""
    if cfg.is_hybrid:
        from .qwen3_5 import HybridModel

        model = HybridModel(cfg, weights, opts)
    else:
        from .qwen3 import DenseModel

        model = DenseModel(cfg, weights, opts)
    if fuses_linear(opts) and opts.gemv_rows and prefetch.enabled(torch.device(opts.device)):
        prefetch.pack_in_reading_order(model.reading_order())
    return model
