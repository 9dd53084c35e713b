"""Timing a call: CUDA events on a GPU, perf_counter on a CPU, and a chosen quantile of many samples."""

from __future__ import annotations

import time

import numpy as np
import torch


class Clock:
    """Seconds taken by fn(): CUDA events on a GPU (synchronised around the call), perf_counter on CPU.

    Figures are a quantile of many samples: the median by default; a low quantile (0.1) on a shared CPU,
    where other processes only ever add time, so the fast samples are the steady ones.
    """

    def __init__(self, device: str, quantile: float = 0.5):
        self.cuda, self.quantile = device.startswith("cuda"), quantile

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn, setup=None) -> float:
        if setup is not None:
            setup()
        self.sync()
        if not self.cuda:
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def calls(self, fn, n: int) -> list[float]:
        """Seconds of each of n calls of fn run back to back, on the host clock from one return to the next, from an
        idle device: a loop of calls as a caller runs it, where a call may leave work on the device that the next
        call's time then holds (a decode step launched ahead: StepGraphs.launch_ahead)."""
        self.sync()
        seconds = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - t)
        self.sync()
        return seconds

    def pick(self, samples: list[float]) -> float:
        return float(np.quantile(samples, self.quantile))

    def measure(self, fn, repeats: int, warmup: int, setup=None) -> float:
        """`warmup` untimed calls, then the chosen quantile of `repeats` timings; `setup` runs untimed first."""
        for _ in range(warmup):
            if setup is not None:
                setup()
            fn()
        return self.pick([self.time(fn, setup) for _ in range(max(repeats, 1))])
