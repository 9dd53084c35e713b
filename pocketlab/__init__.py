"""PocketLab: a compact, verified inference engine for Qwen2, Qwen3 and Qwen3.5 with a slot API."""

from . import memory
from .cache import Snapshot
from .config import EngineOptions, ModelConfig
from .engine import QwenEngine
from .requests import BatchDecodeResult, BatchedRequest, BatchPrefillResult, ForwardResult
from .sampling import SamplingParams
from .text import Completion, TextDelta

__all__ = [
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
