"""One on-disk folder for every compiled kernel, so the second process starts warm.

A fresh process otherwise recompiles every torch.compile graph (inductor) and every Triton kernel and reruns
every autotune (fla's Gated DeltaNet kernels): tens of seconds before the first token. Inductor and Triton both
cache to disk; we point them at one folder and turn on Triton's autotune-result cache, which is off by default.
This runs when pocketlab is imported (this module first), before any Triton kernel is defined: an autotuner
reads the switch once, when its kernel is decorated. Variables already set in the environment win.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def cache_root() -> Path:
    """$POCKETLAB_CACHE, else $XDG_CACHE_HOME/pocketlab, else ~/.cache/pocketlab."""
    if os.environ.get("POCKETLAB_CACHE"):
        return Path(os.environ["POCKETLAB_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pocketlab"


def settings(root: Path) -> dict[str, str]:
    """The environment variables that send inductor's and Triton's caches under `root`."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),  # compiled graphs (FX graph cache) and their kernels
        "TRITON_CACHE_DIR": str(root / "triton"),  # compiled Triton kernels, ours and fla's
        "TRITON_CACHE_AUTOTUNING": "1",  # autotune winners, keyed by kernel source and shape key
    }


def configure() -> dict[str, str]:
    """Set each variable unless the environment already has it; returns what is in effect."""
    effective = {}
    for name, value in settings(cache_root()).items():
        effective[name] = os.environ.setdefault(name, value)
    if "triton" in sys.modules:  # imported before pocketlab: its knobs may have read the environment already
        from triton import knobs

        knobs.cache.dir = effective["TRITON_CACHE_DIR"]
        knobs.autotuning.cache = effective["TRITON_CACHE_AUTOTUNING"] == "1"
    return effective


configure()
