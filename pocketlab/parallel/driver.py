"""The one-device API over N processes: rank 0 holds a TensorParallelEngine, the other ranks follow.

Every call that changes state is sent from rank 0 to the followers as JSON (the call's name and arguments; a
snapshot's tensors follow it as tensors), each rank runs it on its own engine shard, in step: the host side (slots,
prefix cache, sampling, drafts) decides identically everywhere because every rank sees the same gathered logits.
After each call the ranks compare outcomes (a bad argument fails everywhere alike); a rank that died, hung or failed
alone makes the facade raise an error naming the rank and its cause, and refuse every later call.

Launch: `launch(path, options)` spawns ranks 1..N-1 (torch.multiprocessing, spawn) and makes this process rank 0,
so a notebook kernel can start and stop them (`close()`); under `torchrun` it joins the group torchrun set up, rank 0
gets the facade and the other ranks serve rank 0 until it closes, then exit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import torch.multiprocessing as mp

from ..cache import Snapshot
from ..config import EngineOptions, ModelConfig
from ..engine import QwenEngine
from ..requests import BatchedRequest
from ..sampling import GREEDY, SamplingParams
from . import comm
from .shard import Shard

# the calls a follower runs when rank 0 sends them (every call that changes an engine's state)
CALLS = frozenset(
    ("prefill", "decode_step", "batch_prefill", "batch_decode_step", "generate", "stream", "warmup")
    + ("allocate_batch_slots", "allocate_slot", "release_slot", "reset", "snapshot", "restore")
)
EXIT_FAILED = 3  # a follower that cannot go on exits with this, after reporting why


class TensorParallelError(RuntimeError):
    """A rank died, hung or fell out of step: the engine refuses further calls (close() and launch again)."""


class TensorParallelEngine:
    """Rank 0's engine with the QwenEngine API; `workers`: the follower processes when `launch` spawned them."""

    def __init__(self, engine: QwenEngine, workers: list | None = None, reports: list | None = None):
        self.engine, self.workers, self._reports = engine, workers or [], reports or []
        self.broken: str | None = None  # why calls are refused
        self.closed = False
        self._said: dict[int, str] = {}  # what each failed follower reported

    def __getattr__(self, name):
        """Everything that only reads (cfg, options, cache, tokenizer, free_slots(), position(), forward_count,
        default_sampling() ...) comes from rank 0's engine. Change state only through the calls below."""
        if name == "engine":  # not set yet (or unpickling): no engine to read from
            raise AttributeError(name)
        return getattr(self.engine, name)

    # -- the calls every rank runs (QwenEngine's docstrings say what each does) ---------------------------------------
    def prefill(self, tokens, slot_id=0, sampling=GREEDY):
        return self._call("prefill", (list(tokens), slot_id, sampling))

    def decode_step(self, token, slot_id=0, sampling=GREEDY):
        return self._call("decode_step", (token, slot_id, sampling))

    def batch_prefill(self, requests):
        return self._call("batch_prefill", (requests,))

    def batch_decode_step(self, requests):
        return self._call("batch_decode_step", (requests,))

    def generate(self, prompts, sampling=None, progress=False, enable_thinking=None, arrivals=None):
        kwargs = dict(progress=progress, enable_thinking=enable_thinking, arrivals=arrivals)
        return self._call("generate", (prompts, sampling), kwargs)

    def warmup(self, progress=True):
        return self._call("warmup", (), dict(progress=progress))

    def allocate_batch_slots(self, n):
        return self._call("allocate_batch_slots", (n,))

    def allocate_slot(self, request_id):
        return self._call("allocate_slot", (request_id,))

    def release_slot(self, slot_id):
        return self._call("release_slot", (slot_id,))

    def reset(self, slot_id=None):
        return self._call("reset", (slot_id,))

    def snapshot(self, slot_id=0) -> Snapshot:
        """The slot's whole state in the one-device layout (gathered from every rank): save it from here."""
        return self._call("snapshot", (slot_id,))

    def restore(self, snapshot: Snapshot, slot_id=0) -> None:
        """Restore a snapshot taken at any tensor_parallel; its tensors go to every rank, each keeps its part."""
        return self._call("restore", (snapshot, slot_id))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stream(self, prompts, sampling=None, enable_thinking=None):
        """As QwenEngine.stream. Every rank runs the whole stream: closing it early finishes it unseen here."""
        args = (prompts, sampling, enable_thinking)
        with self._mirrored("stream", args, {}):
            it, closed = self.engine.stream(*args), False
            for delta in it:
                if not closed:
                    try:
                        yield delta
                    except GeneratorExit:
                        closed = True

    def _call(self, name, args, kwargs=None):
        assert name in CALLS, name
        kwargs = kwargs or {}
        with self._mirrored(name, args, kwargs):
            return getattr(self.engine, name)(*args, **kwargs)

    @contextmanager
    def _mirrored(self, name: str, args, kwargs):
        """Send the call to the followers, run the body here, then compare every rank's outcome."""
        self._check_usable()
        snapshots = [a for a in (*args, *kwargs.values()) if isinstance(a, Snapshot)]
        message = {"call": name, "args": encode(list(args)), "kwargs": encode(kwargs)}  # TypeError: nothing sent
        try:
            comm.broadcast_json(message)
            for snap in snapshots:
                comm.broadcast_tensors(snap.tensors, comm.tensor_spec(snap.tensors))
        except Exception as e:
            self._fail(f"sending {name} to the followers failed ({type(e).__name__}: {e})")
        error = None
        try:
            yield
        except Exception as e:  # the followers' outcomes decide whether it was this call's error or a fault
            error = e
        except BaseException:  # KeyboardInterrupt mid-call: the followers are left inside it, out of step
            self.broken = f"{name} was interrupted on rank 0; the other ranks are out of step"
            raise
        try:
            outcomes = comm.outcomes(error is None)
        except Exception as e:
            self._fail(f"{name} did not complete on every rank ({type(e).__name__}: {e})", error)
        if len(set(outcomes)) > 1:
            self._fail(f"{name} succeeded on ranks {[r for r, ok in enumerate(outcomes) if ok]} only", error)
        if error is not None:
            raise error

    def _check_usable(self) -> None:
        if self.closed:
            raise TensorParallelError("this tensor-parallel engine is closed: launch a new one")
        if self.broken is None:
            for rank, p in enumerate(self.workers, start=1):
                if not p.is_alive():
                    self.broken = f"rank {rank} is gone ({_exit_text(p.exitcode)}){self._report_text(rank)}"
        if self.broken is not None:
            raise TensorParallelError(f"tensor-parallel engine unusable: {self.broken}; close() it and launch again")

    def _fail(self, what: str, error: BaseException | None = None):
        """Mark the engine broken with what went wrong and which rank caused it, and raise."""
        deadline = time.monotonic() + 3  # a dying follower's report and exit take a moment
        while self.workers and time.monotonic() < deadline and all(p.is_alive() for p in self.workers):
            time.sleep(0.1)
        causes = []
        for rank, p in enumerate(self.workers, start=1):
            if not p.is_alive():
                causes.append(f"rank {rank} exited ({_exit_text(p.exitcode)}){self._report_text(rank)}")
            elif self._report_text(rank):
                causes.append(f"rank {rank} failed{self._report_text(rank)}")
        if not causes and self.workers:
            timeout = self.engine.options.parallel_timeout_s
            causes = [f"rank {r} alive but silent for {timeout:g} s (hung?)" for r in range(1, len(self.workers) + 1)]
        elif not self.workers:  # torchrun started the ranks: each reports on its own stderr, which torchrun shows
            causes = ["see the other ranks' stderr (torchrun prefixes it with their rank)"]
        self.broken = what + ("; " + "; ".join(causes) if causes else "")
        raise TensorParallelError(f"tensor-parallel engine failed: {self.broken}") from error

    def _report_text(self, rank: int) -> str:
        """What rank `rank` reported before it failed (spawned workers send one JSON line on a pipe)."""
        conn = self._reports[rank - 1] if rank - 1 < len(self._reports) else None
        try:
            while conn is not None and conn.poll():
                self._said[rank] = json.loads(conn.recv_bytes().decode())["error"]
        except (EOFError, OSError):
            pass
        text = self._said.get(rank)
        return f": {text}" if text else ""

    def close(self) -> None:
        """Stop the followers and leave the process group (idempotent; after a failure the workers are killed)."""
        if self.closed:
            return
        self.closed = True
        if self.broken is None:
            try:
                comm.broadcast_json({"call": "close"})
            except Exception:
                pass
        for p in self.workers:
            p.join(timeout=10 if self.broken is None else 1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if self.workers or self.broken is None:
            comm.teardown()

    def _fault(self, rank: int, kind: str) -> None:
        """Test hook: make follower `rank` fail as the next call arrives: "exit" (reports, then os._exit) or
        "hang" (sleeps past every timeout)."""
        comm.broadcast_json({"call": "__fault__", "rank": rank, "kind": kind})


def _exit_text(code) -> str:
    return f"exit code {code}" if code is None or code >= 0 else f"killed by signal {-code}"


# -- the followers -----------------------------------------------------------------------------------------------------
def serve(engine: QwenEngine, report=None) -> None:
    """A follower's loop: run each call rank 0 sends on this rank's engine, until rank 0 closes. A failure of this
    rank alone is reported (on `report`, a pipe, or stderr) and ends the process with EXIT_FAILED."""
    rank = comm.current().rank
    while True:
        try:
            message = comm.broadcast_json()
        except Exception as e:  # rank 0 is gone
            _report_and_exit(report, rank, f"lost rank 0 while waiting for a call ({type(e).__name__}: {e})")
        call = message["call"]
        if call == "close":
            return
        if call == "__fault__":
            if message["rank"] == rank:
                _fault_here(message["kind"], report)
            continue
        error = None
        try:
            if call not in CALLS:
                raise ValueError(f"{call!r} is not a call the followers run")
            args, kwargs = decode(message["args"]), decode(message["kwargs"])
            args = [_receive(a) for a in args]
            kwargs = {k: _receive(v) for k, v in kwargs.items()}
            if call in ("generate", "warmup"):
                kwargs["progress"] = False  # rank 0 shows it
            result = getattr(engine, call)(*args, **kwargs)
            if call == "stream":
                for _ in result:
                    pass
        except Exception as e:
            error = e
        try:
            outcomes = comm.outcomes(error is None)
        except Exception as e:
            _report_and_exit(report, rank, f"{call}: lost rank 0 ({type(e).__name__}: {e})")
        if len(set(outcomes)) > 1:
            text = "" if error is None else f": {type(error).__name__}: {error}"
            _report_and_exit(report, rank, f"{call} failed on this rank only{text}")


def _receive(arg):
    """A decoded argument; a snapshot's tensors come next from rank 0."""
    if isinstance(arg, Snapshot):
        arg.tensors = comm.broadcast_tensors(None, cast(list, arg.tensors))  # decode() left the spec there
    return arg


def _fault_here(kind: str, report) -> None:
    if kind == "exit":
        _report_and_exit(report, comm.current().rank, "injected fault: exit")
    time.sleep(1e9)


def _report_and_exit(report, rank: int, text: str):
    message = json.dumps({"rank": rank, "error": text})
    if report is not None:
        report.send_bytes(message.encode())
    else:
        print(f"pocketlab tensor-parallel rank {rank}: {text}", file=sys.stderr, flush=True)
    os._exit(EXIT_FAILED)


# -- launching -------------------------------------------------------------------------------------------------------
def launch(path: str | Path, options: EngineOptions | None = None, tensor_parallel: int | None = None):
    """An engine of `path` split over `tensor_parallel` (or options.tensor_parallel) processes, one per device.

    Under torchrun: every rank calls this; rank 0 gets the TensorParallelEngine, the other ranks serve it and exit
    when it closes. Elsewhere (a script, a notebook): this process becomes rank 0 and the others are spawned; close()
    (or a `with` block) stops them. tensor_parallel 1 gives a plain QwenEngine."""
    options = options or EngineOptions()
    if tensor_parallel is not None:
        options = dataclasses.replace(options, tensor_parallel=tensor_parallel)
    n = options.tensor_parallel
    if n == 1:
        return QwenEngine.from_pretrained(path, options)
    Shard(0, n).check(ModelConfig.from_pretrained(path))  # refuse a bad split before starting any process
    if "WORLD_SIZE" in os.environ:  # torchrun started every rank
        engine = QwenEngine.from_pretrained(path, options)
        if comm.current().rank == 0:
            return _ready(TensorParallelEngine(engine))
        comm.started()
        serve(engine)
        comm.teardown()
        sys.exit(0)
    return _spawn(Path(path), options)


def _spawn(path: Path, options: EngineOptions) -> TensorParallelEngine:
    n, ctx = options.tensor_parallel, mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{_free_port()}"
    workers, reports = [], []
    text = json.dumps(dataclasses.asdict(options))
    for rank in range(1, n):
        mine, theirs = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, args=(str(path), text, rank, n, init, theirs), daemon=True)
        p.start()
        theirs.close()
        workers.append(p)
        reports.append(mine)
    facade = None
    try:
        comm.setup(0, n, options.device, options.parallel_timeout_s, init)
        facade = TensorParallelEngine(QwenEngine.from_pretrained(path, options), workers, reports)
        return _ready(facade)
    except BaseException:
        if facade is None:
            for p in workers:
                p.kill()
            comm.teardown()
        else:
            facade.close()
        raise


def _ready(facade: TensorParallelEngine) -> TensorParallelEngine:
    """Wait until every rank has loaded its shard (or say which could not)."""
    try:
        comm.started()
    except Exception as e:
        facade._fail(f"the ranks did not all start ({type(e).__name__}: {e})")
    return facade


def _worker(path: str, options_json: str, rank: int, world: int, init: str, report) -> None:
    """A spawned follower: join the group, load this rank's shard, serve rank 0."""
    try:
        raw = json.loads(options_json)
        raw["graph_batch_sizes"] = tuple(raw["graph_batch_sizes"])
        options = EngineOptions(**raw)
        comm.setup(rank, world, options.device, options.parallel_timeout_s, init)
        engine = QwenEngine.from_pretrained(path, options)
        comm.started()
    except Exception as e:
        _report_and_exit(report, rank, f"could not start: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
    serve(engine, report)
    comm.teardown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- call arguments as JSON ------------------------------------------------------------------------------------------
def encode(x):
    """Call arguments -> JSON-able values: SamplingParams, BatchedRequest and Snapshot (its tensors sent apart)
    tagged, containers recursively. Anything else is refused rather than guessed."""
    if isinstance(x, SamplingParams):
        return {"__sampling__": dataclasses.asdict(x)}
    if isinstance(x, BatchedRequest):
        return {"__request__": dataclasses.asdict(x) | {"sampling": encode(x.sampling)}}
    if isinstance(x, Snapshot):
        return {
            "__snapshot__": {
                "tokens": x.tokens,
                "model": x.model,
                "dtype": x.dtype,
                "spec": comm.tensor_spec(x.tensors),
            }
        }
    if isinstance(x, (list, tuple)):
        return [encode(v) for v in x]
    if isinstance(x, dict):
        return {str(k): encode(v) for k, v in x.items()}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"a tensor-parallel call cannot carry a {type(x).__name__} argument")


def decode(x):
    if isinstance(x, list):
        return [decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__sampling__" in x:
        fields = x["__sampling__"]
        return SamplingParams(**fields | {"stop_token_ids": tuple(fields["stop_token_ids"])})
    if "__request__" in x:
        fields = x["__request__"]
        return BatchedRequest(**fields | {"sampling": decode(fields["sampling"])})
    if "__snapshot__" in x:
        s = x["__snapshot__"]
        return Snapshot(s["tokens"], s["spec"], s["model"], s["dtype"])  # tensors: the spec until _receive
    return {k: decode(v) for k, v in x.items()}
