"""torch.distributed for tensor parallelism: the process groups, the collectives the model runs, and JSON messages.

Three groups. The world group only meets at startup (long timeout: processes start, shards load). `compute` (NCCL
on CUDA, gloo on the CPU) runs the model's all-reduces and gathers, every wait bounded by
EngineOptions.parallel_timeout_s, so a rank that died or hung surfaces as an error, never a hang. `control` (gloo,
CPU) carries the calls rank 0 broadcasts; a follower's wait for the next call may be long (a notebook user
thinking), rank 0's send is bounded like a compute wait. Messages are UTF-8 JSON in a uint8 tensor after its
length: no pickle.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .shard import Shard

if TYPE_CHECKING:
    from ..config import EngineOptions

IDLE_TIMEOUT = timedelta(days=7)  # a follower waiting for rank 0's next call
STARTUP_TIMEOUT = timedelta(minutes=30)  # starting the processes and loading every rank's shard
_groups: dict[str, Any] = {}  # "compute", "control" and rank 0's "timeout" on control


def setup(
    rank: int, world: int, device: str, timeout_s: float, init_method: str = "env://", local_rank: int | None = None
) -> Shard:
    """Join the tensor-parallel group (once per process); on CUDA each rank takes its own device."""
    if is_active():
        return current()
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank if local_rank is None else local_rank)
    # the world group, with a startup-long timeout, only meets everyone and waits while every rank loads its shard
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=STARTUP_TIMEOUT)
    _groups["compute"] = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    _groups["control"] = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    _groups["timeout"] = timedelta(seconds=timeout_s)
    return current()


def started() -> None:
    """Wait until every rank is here (each has loaded its shard), up to STARTUP_TIMEOUT."""
    dist.barrier()


def is_active() -> bool:
    return dist.is_available() and dist.is_initialized() and "compute" in _groups


def current() -> Shard:
    return Shard(dist.get_rank(), dist.get_world_size())


def teardown() -> None:
    """Leave the group (a no-op outside one), so the process can start another."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _groups.clear()


def shard_for(options: EngineOptions) -> tuple[Shard, EngineOptions]:
    """(this process's Shard, options with its device) for an engine of `options`: world 1 unless
    tensor_parallel > 1, which needs the group (joined here from torchrun's environment if not yet)."""
    n = options.tensor_parallel
    if n == 1:
        return Shard(), options
    if not is_active():
        if "WORLD_SIZE" not in os.environ:
            raise ValueError(
                f"tensor_parallel={n} runs one process per device: start them with torchrun --nproc-per-node {n}, "
                "or call pocketlab.parallel.launch(path, options) (also from a notebook)"
            )
        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        setup(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), options.device, options.parallel_timeout_s,
              local_rank=local)  # fmt: skip
    shard = current()
    if shard.world != n:
        raise ValueError(f"tensor_parallel={n} but the process group has {shard.world} processes")
    if torch.device(options.device).type == "cuda":
        options = dataclasses.replace(options, device=f"cuda:{torch.cuda.current_device()}")
    return shard, options


# -- what the model runs ----------------------------------------------------------------------------------------------
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of every rank's x, in place on the current stream (under NCCL a CUDA graph captures it)."""
    dist.all_reduce(x, group=_groups["compute"])
    return x


def gather_last(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x [..., n] concatenated along the last dimension (vocab-parallel logits -> the vocabulary's)."""
    return torch.cat(gather_tensor(x), dim=-1)


def vocab_embedding(tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Embedding lookup in a vocab-parallel table: each rank looks up the tokens in its rows (zeros elsewhere) and
    one all-reduce assembles the rows."""
    local = tokens - dist.get_rank() * table.shape[0]
    inside = (local >= 0) & (local < table.shape[0])
    h = F.embedding(local.clamp(0, table.shape[0] - 1), table).masked_fill(~inside[..., None], 0)
    return all_reduce(h)


def gather_tensor(x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's x (same shape everywhere) in rank order, on every rank."""
    out = x.new_empty(dist.get_world_size() * x.numel())  # gathered along dim 0: rank after rank
    dist.all_gather_single(out, x.reshape(-1), group=_groups["compute"])
    return list(out.view(-1, *x.shape).unbind(0))


# -- messages from rank 0 to the followers ----------------------------------------------------------------------------
def broadcast_json(message=None):
    """Rank 0 sends `message` (JSON-able); every other rank gets it. UTF-8 JSON bytes, never pickle."""
    if dist.get_rank() == 0:
        data = torch.frombuffer(bytearray(json.dumps(message).encode()), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.long)
    else:
        length = torch.zeros(1, dtype=torch.long)
    _send(length)
    if dist.get_rank() != 0:
        data = torch.empty(int(length), dtype=torch.uint8)
    _send(data)
    return message if dist.get_rank() == 0 else json.loads(bytes(data.numpy()).decode())


def broadcast_tensors(tensors: dict[str, torch.Tensor] | None, spec: list) -> dict[str, torch.Tensor]:
    """Rank 0's tensors on every rank (CPU): `spec` ([name, dtype, shape] each) came first as JSON."""
    out = {}
    for name, dtype, shape in spec:
        t = (
            cast(dict[str, torch.Tensor], tensors)[name].contiguous().cpu()
            if dist.get_rank() == 0
            else torch.empty(shape, dtype=getattr(torch, dtype))
        )
        _send(t)
        out[name] = t
    return out


def _send(t: torch.Tensor) -> None:
    """Broadcast from rank 0 on the control group. Rank 0's send completes only when each follower receives, so
    it waits at most the compute timeout (a hung follower); the followers wait for the next call indefinitely."""
    work = dist.broadcast(t, 0, group=_groups["control"], async_op=True)
    if dist.get_rank() == 0:
        work.wait(timeout=_groups["timeout"])
    else:
        work.wait()


def tensor_spec(tensors: dict[str, torch.Tensor]) -> list:
    return [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()]


def outcomes(ok: bool) -> list[bool]:
    """Every rank's `ok` (a call's outcome), on every rank: the ranks compare them after each call. Over the compute
    group, so a rank that is gone or stuck makes it fail within the timeout."""
    flags = gather_tensor(torch.tensor([int(ok)], dtype=torch.long, device=_compute_device()))
    return [bool(int(f)) for f in flags]


def _compute_device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def gather_snapshot(snap, shard: Shard, cfg):
    """A snapshot of this rank's part of a slot -> the whole slot's (one-device layout), on every rank."""
    names = sorted(snap.tensors)  # the same order on every rank
    tensors = {name: shard.merge_state(name, gather_tensor(snap.tensors[name]), cfg) for name in names}
    return dataclasses.replace(snap, tensors=tensors)
