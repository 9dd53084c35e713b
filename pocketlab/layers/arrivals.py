"""Zeroed per-device arrival counts for kernels whose last program to finish a piece of work combines the
others' partial results (split-K matmul tiles, split-key decode attention) in a fixed order, inside the same
launch. Each launch leaves its counts zeroed again, so a CUDA graph replays them without a memset."""

import torch

_COUNTS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers stay alive: graphs captured earlier still point at them


def arrival_counts(device: torch.device, needed: int) -> torch.Tensor:
    """At least `needed` zeroed int32 counts on `device`; grown (never during a graph capture) when too few."""
    have = _COUNTS.get(device)
    if have is None or have.numel() < needed:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"arrival counts for {needed} pieces of work must exist before graph capture")
        if have is not None:
            _RETIRED.append(have)
        have = torch.zeros(max(needed, 4096), dtype=torch.int32, device=device)
        _COUNTS[device] = have
    return have
