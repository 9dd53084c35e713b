"""Shared fixtures. POCKETLAB_DEVICE=cuda runs the engine tests on a GPU: float32 by default, where every
contract holds as on the CPU; POCKETLAB_DTYPE=bfloat16 runs them in bf16 with looser logit tolerances."""

import json
import os
import sys

import pytest
import torch

# no GPU: Triton kernels run in Triton's CPU interpreter, a flag read as each kernel is decorated (so before pocketlab)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pocketlab import EngineOptions, QwenEngine  # noqa: E402
from pocketlab.tools.synthetic import write_checkpoint  # noqa: E402

DEVICE = os.environ.get("POCKETLAB_DEVICE", "cpu")
DTYPE = os.environ.get("POCKETLAB_DTYPE", "float32")
# float32 parity is the contract (1e-4); in bf16 we allow errors relative to the logit scale.
LOGIT_TOL = 1e-4 if DTYPE == "float32" else 0.05
# POCKETLAB_KERNELS=triton (with TRITON_INTERPRET=1 on a CPU) runs every engine test through our Triton kernels
TRITON_KERNELS = dict(decode_attention="triton", linear_decode="triton", fused_linear="triton", moe_kernel="triton")
KERNELS = TRITON_KERNELS if os.environ.get("POCKETLAB_KERNELS") else {}


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from threads; on a busy 2-core box they cost several x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(preset, **overrides) -> folder, written once per session."""
    made = {}

    def get(preset: str, **overrides):
        key = (preset, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = write_checkpoint(preset, tmp_path_factory.mktemp(preset), seed=0, **overrides)
        return made[key]

    return get


@pytest.fixture(scope="session")
def make_engine(checkpoint):
    def make(preset: str = "tiny-qwen3", norm_noise: float = 0.0, **options) -> QwenEngine:
        """An engine over the preset's checkpoint (its norm weights moved off the identity by `norm_noise`)."""
        opts = dict(max_slots=4, max_seq_len=256, prefill_chunk=16, device=DEVICE, dtype=DTYPE) | KERNELS | options
        path = checkpoint(preset, norm_noise=norm_noise) if norm_noise else checkpoint(preset)
        return QwenEngine.from_pretrained(path, EngineOptions(**opts))

    return make


def greedy_run(engine: QwenEngine, prompt: list[int], steps: int, slot_id: int = 0):
    """Prefill then `steps` greedy decodes on one slot: (tokens, [logits per step])."""
    return greedy_continue(engine, engine.prefill(prompt, slot_id=slot_id), steps, slot_id)


def greedy_continue(engine: QwenEngine, first, steps: int, slot_id: int = 0):
    """`steps` greedy decodes after the prefill result `first`: (tokens, [logits per step]) including it."""
    tokens, logits = [first.next_token], [first.logits]
    for _ in range(steps):
        r = engine.decode_step(tokens[-1], slot_id=slot_id)
        tokens.append(r.next_token)
        logits.append(r.logits)
    return tokens, torch.stack(logits)


def random_prompt(length: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_state(engine: QwenEngine) -> list:
    """Everything every slot holds (tokens, owner, cache rows), for exact before/after comparisons."""
    state = []
    for s in range(engine.options.max_slots):
        slot = engine.cache.slots[s]
        snap = engine.cache.snapshot(s)
        state.append((list(slot.tokens), slot.owner, {k: v.clone() for k, v in snap.tensors.items()}))
    return state + [engine.num_slots]


def assert_same_state(a, b):
    assert a[-1] == b[-1]
    for (ta, oa, xa), (tb, ob, xb) in zip(a[:-1], b[:-1], strict=True):
        assert ta == tb and oa == ob
        assert xa.keys() == xb.keys()
        for k in xa:
            assert torch.equal(xa[k], xb[k]), k


def pytest_runtest_logreport(report):
    """POCKETLAB_INSTAFAIL=1 prints each failure as it happens: a GPU run cut by its time limit keeps them."""
    if report.failed and os.environ.get("POCKETLAB_INSTAFAIL"):
        sys.__stderr__.write(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext[-2500:]}\n")
        sys.__stderr__.flush()


# In Triton's interpreter, each distinct launch of a pocketlab kernel is recorded and, at the session's end,
# compiled for the H200 by tests/sm90.py (the interpreter accepts kernels the compiler refuses). Under
# pytest-xdist each worker hands its launches to the controller, which compiles them all: a worker's exit status
# would not fail the run. POCKETLAB_SM90=0 skips it.
LAUNCHES: set[str] = set()
SM90_CHECK = os.environ.get("POCKETLAB_SM90", "1") != "0"
XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ
if os.environ.get("TRITON_INTERPRET") == "1" and SM90_CHECK:
    from sm90 import launch_key  # noqa: E402
    from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

    _interpreted_run = InterpretedFunction.run

    def _recorded_run(self, *args, grid, warmup, **kwargs):
        try:
            if self.fn.__module__.startswith("pocketlab."):  # the engine's kernels, not the tests' own
                LAUNCHES.add(launch_key(self.fn, args, dict(kwargs)))
        except (TypeError, KeyError) as e:  # never the launch's failure: the check reports it instead
            LAUNCHES.add(json.dumps({"unrecorded": f"{self.fn.__name__}: no sm_90 signature ({e!r})"}))
        return _interpreted_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = _recorded_run


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: the launches a finished worker recorded."""
    LAUNCHES.update(node.workeroutput.get("sm90_launches", []))


def pytest_sessionfinish(session, exitstatus):
    """The recorded launches compiled for sm_90 in a process without the interpreter; a failure fails the run."""
    if XDIST_WORKER:
        session.config.workeroutput["sm90_launches"] = sorted(LAUNCHES)
        return
    if not LAUNCHES:
        return
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("\n".join(sorted(LAUNCHES)) + "\n")
    env = os.environ | {"TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "sm90.py"), f.name], env=env,
                          capture_output=True, text=True)  # fmt: skip
    os.unlink(f.name)
    sys.__stdout__.write("\n" + done.stdout + (done.stderr[-3000:] if done.returncode else ""))
    if done.returncode:
        session.exitstatus = 1
