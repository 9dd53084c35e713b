"""Tensor parallelism over torch.distributed: one process per device, each holding a shard of every layer.

shard.py says which slice of each weight and state tensor a rank holds; comm.py runs the process groups and
collectives; driver.py keeps the one-device API: rank 0's TensorParallelEngine forwards every call to the other
ranks, which run it on their shards (`launch` starts them, from a shell under torchrun or from a notebook).
"""

from .shard import Shard

__all__ = ["Shard", "launch", "TensorParallelEngine"]


def __getattr__(name):  # the driver imports the engine, which imports this package: load it on first use
    if name in ("launch", "TensorParallelEngine", "serve"):
        from . import driver

        return getattr(driver, name)
    raise AttributeError(name)
