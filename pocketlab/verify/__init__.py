"""Verification: checks that return DataFrames and a verdict; the notebooks only display and assert.

from pocketlab import verify
r = verify.parity(model="tiny-qwen3")      # or isolation(...), batch_api(...), invariance(...)
r.summary; r.tables; r.figures; assert r.passed
verify.write_verdict(r)                    # key figures for `make reports` (no-op elsewhere)
"""

from .batch_api import batch_api
from .common import Pair, Report, Tolerance, load_pair, tolerance, write_verdict
from .invariance import invariance
from .isolation import isolation
from .parity import parity

__all__ = [
    "parity",
    "isolation",
    "batch_api",
    "invariance",
    "write_verdict",
    "load_pair",
    "Pair",
    "Report",
    "Tolerance",
    "tolerance",
]
