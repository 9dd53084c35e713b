"""The elementwise steps between the matmuls: SwiGLU, the gated attention's output gate, and the Gated DeltaNet
decay and beta (fused into one kernel each inside captured CUDA graphs)."""

import torch
import torch.nn.functional as F

from .fused import compiled_in_graphs


@compiled_in_graphs
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(gate)


@compiled_in_graphs
def decay_and_beta(a: torch.Tensor, b: torch.Tensor, neg_A: torch.Tensor, dt_bias: torch.Tensor):
    """The delta rule's log-decay g = -exp(A_log) * softplus(a + dt_bias) (float32) and beta = sigmoid(b)."""
    return neg_A * F.softplus(a.float() + dt_bias), b.sigmoid()
