"""The sm_90 compile check (tests/sm90.py) names a kernel that runs in Triton's interpreter but not on the GPU."""

import os
import subprocess
import sys

import pytest
import torch
from sm90 import launch_key

triton = pytest.importorskip("triton")
tl = triton.language
# a mark, not a module-level skip: the check's own process imports this module without the interpreter
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the check runs where kernels are interpreted"
)


@triton.jit
def _rebinds_a_name(x_ptr, N, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    r = tl.load(x_ptr + i, mask=i < N)
    if tl.program_id(0) == 0:
        for r in range(0, 2):  # noqa: B007 - a block tile, then an int: the compiler refuses, the interpreter not
            pass
    tl.store(x_ptr + i, r + 1.0, mask=i < N)


@triton.jit
def _adds_one(x_ptr, N, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < N) + 1.0, mask=i < N)


def test_the_sm90_check_names_the_kernel_only_the_interpreter_runs(tmp_path):
    x = torch.zeros(8)
    _rebinds_a_name[(1,)](x, 8, BLOCK=8)  # the interpreter runs it as Python: r ends as the loop's last int, 1
    _adds_one[(1,)](x, 8, BLOCK=8)
    assert torch.equal(x, torch.full((8,), 3.0))
    launches = tmp_path / "launches.jsonl"
    launches.write_text("\n".join(launch_key(k.fn, (x, 8), {"BLOCK": 8}) for k in (_rebinds_a_name, _adds_one)))
    env = os.environ | {"TRITON_INTERPRET": "0"}
    here = os.path.dirname(__file__)
    done = subprocess.run([sys.executable, os.path.join(here, "sm90.py"), str(launches)], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 distinct Triton launches, 1 failed" in done.stdout
    assert "_rebinds_a_name" in done.stdout and "_adds_one" not in done.stdout
