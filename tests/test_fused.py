"""torch.compile'd chains run only inside CUDA-graph capture on CUDA tensors; everywhere else, eagerly."""

import torch
from torch._dynamo.utils import counters

from pocketlab.layers import fused
from pocketlab.layers.norm import _rms_norm, rms_norm


def test_cpu_calls_stay_eager_even_inside_capture():
    before = dict(counters["frames"])
    x, w = torch.randn(2, 8), torch.randn(8)
    with fused.compiled_kernels():
        assert fused._state["on"]
        assert torch.equal(rms_norm(x, w, 1e-6), _rms_norm(x, w, 1e-6))
    assert not fused._state["on"]
    assert dict(counters["frames"]) == before  # dynamo never looked at a frame
