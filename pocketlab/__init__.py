"""PocketLab: a compact, verified inference engine for Qwen2, Qwen3 and Qwen3.5 with a slot API."""

from . import kernel_cache, memory  # kernel_cache first: it points the kernel caches at one folder on import
from .cache import Snapshot
from .config import EngineOptions, ModelConfig
from .engine import QwenEngine
from .requests import BatchDecodeResult, BatchedRequest, BatchPrefillResult, ForwardResult
from .sampling import SamplingParams
from .text import Completion, TextDelta

__all__ = [
    "kernel_cache",
    "memory",
    "QwenEngine",
    "EngineOptions",
    "ModelConfig",
    "SamplingParams",
    "BatchedRequest",
    "ForwardResult",
    "BatchPrefillResult",
    "BatchDecodeResult",
    "Snapshot",
    "Completion",
    "TextDelta",
]
