"""Memory plan: the bytes an engine will hold, computed from the config and options before anything is allocated, so a
configuration that cannot fit is refused up front, with the numbers and the largest max_slots / max_seq_len that do fit,
and `max_slots="auto"` takes as many slots as `memory_fraction` of the free device memory holds.

What is counted: weights (every tensor the loader keeps, in the engine's dtype), the slot caches (max_slots + 1 rows:
the scratch row; K/V per attention layer, conv window and fp32 recurrent state per Gated DeltaNet layer, the MTP head's
K/V and hidden queue with speculative decoding), the prefix-cache budget (a cap: counted whole), CUDA graph pools (each
captured step keeps its logits, prompt graphs one buffer of hidden states; plus the workspace of the largest graphed
forward and a hybrid's rows aside for steps launched ahead), and the workspace of the largest single forward (one
prompt's prefill chunk, or a decode step of every slot). batch_prefill of many long prompts at once needs more workspace
than that: the estimate is for the engine's own steps, not for every call a user may make. With tensor_parallel > 1
every figure is one rank's (its shard of the weights and caches), against its device.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from .cache import linear_state_bytes
from .config import DTYPES, MAX_SPECULATIVE_TOKENS, EngineOptions, ModelConfig
from .graphs import aside_rows, batch_buckets, key_buckets, prompt_shapes
from .loader import expected_shapes
from .parallel.shard import Shard

AUTO_MAX_SLOTS = 1024  # max_slots="auto" never goes beyond this


def device_free_bytes(device: str) -> int:
    """Free memory of `device`: torch.cuda.mem_get_info on CUDA, available RAM on the CPU. Tests patch this."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class MemoryPlan:
    """Bytes per part of an engine of `options` (max_slots resolved), against `free` x memory_fraction."""

    options: EngineOptions
    weights: int
    per_slot: int  # one slot row of every cache bank
    prefix_cache: int
    graphs: int
    workspace: int
    free: int  # device bytes free before the engine allocates (weights already resident excluded)

    @property
    def slot_caches(self) -> int:
        return (self.options.slot_count + 1) * self.per_slot

    @property
    def total(self) -> int:
        return self.weights + self.slot_caches + self.prefix_cache + self.graphs + self.workspace

    @property
    def budget(self) -> int:
        return int(self.free * self.options.memory_fraction)

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def describe(self) -> str:
        o = self.options
        return (
            f"{gib(self.total)} needed: weights {gib(self.weights)}, slot caches {gib(self.slot_caches)} "
            f"({o.max_slots} slots + 1 scratch x {gib(self.per_slot)} at max_seq_len={o.max_seq_len}), prefix cache "
            f"{gib(self.prefix_cache)}, CUDA graphs {gib(self.graphs)}, workspace {gib(self.workspace)}; "
            f"{gib(self.budget)} usable ({o.memory_fraction:g} of {gib(self.free)} free on {o.device})"
        )


def gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def plan(cfg: ModelConfig, options: EngineOptions, free: int, weights_resident: bool = False) -> MemoryPlan:
    """The plan of `options` exactly as given (max_slots an int). weights_resident: the weights are already on the
    device (an engine built from tensors in memory), so `free` no longer includes them."""
    o, elem = options, DTYPES[options.dtype].itemsize
    vocab = cfg.vocab_size  # logits are gathered whole on every rank
    cfg = Shard(0, o.tensor_parallel).local_config(cfg)  # tensor parallelism: one rank's part of the model
    weights = 0 if weights_resident else _weight_bytes(cfg, elem)
    kv_layers = len(cfg.attention_layers) + (1 if o.speculative_tokens else 0)  # the MTP head's own K/V region
    per_slot = kv_layers * 2 * cfg.num_key_value_heads * o.max_seq_len * cfg.head_dim * elem
    per_slot += linear_state_bytes(cfg, elem)
    if o.speculative_tokens:  # the MTP hidden-state queue and its (count, end)
        per_slot += (MAX_SPECULATIVE_TOKENS + 1) * cfg.hidden_size * elem + 16
    rows = o.slot_count * (1 + o.speculative_tokens)  # a decode step of every slot (with its drafts)
    workspace = _forward_bytes(cfg, max(min(o.prefill_chunk, o.max_seq_len), rows), o.max_seq_len, elem)
    workspace += rows * vocab * 4  # float32 logits
    graphs = 0
    if o.cuda_graphs and torch.device(o.device).type == "cuda":
        sizes = batch_buckets(o)
        outputs = sum(sizes) * len(key_buckets(o.max_seq_len)) * (1 + o.speculative_tokens) * vocab * 4
        prompts = prompt_shapes(sizes, o.prefill_graph_tokens)
        outputs += (o.prefill_graph_tokens * cfg.hidden_size * elem) if prompts else 0  # their one output buffer
        tokens = max([rows] + [b * T for b, T in prompts])  # the largest graphed forward
        graphs = outputs + _forward_bytes(cfg, tokens, o.max_seq_len, elem)
        graphs += aside_rows(cfg, o) * linear_state_bytes(cfg, elem)  # a hybrid's steps launched ahead store there
    prefix = o.prefix_cache_bytes if o.prefix_cache else 0
    return MemoryPlan(o, weights, per_slot, prefix, graphs, workspace, free)


def _weight_bytes(cfg: ModelConfig, elem: int) -> int:
    """Every tensor the loader keeps, in the engine's dtype (A_log, dt_bias stay fp32: a few bytes)."""
    return sum(_numel(shape) * elem for shape in expected_shapes(cfg).values())


def _forward_bytes(cfg: ModelConfig, tokens: int, keys: int, elem: int) -> int:
    """Activations of one forward of `tokens` tokens against `keys` cached keys: the widest layer's inputs and outputs
    (residual, normed, projections, MLP's gate/up/act, MoE's per-pair buffers) and the boolean attention mask (SDPA's
    fused kernels do not materialize the scores)."""
    q = cfg.num_attention_heads * cfg.head_dim * (2 if cfg.is_hybrid else 1)
    widths = 4 * cfg.hidden_size + q + 2 * cfg.num_key_value_heads * cfg.head_dim + 3 * cfg.intermediate_size
    if cfg.is_moe:  # per (token, expert) pair: gate | up, silu * up, the expert's output (and its fp32 sum)
        k, i, d = cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.hidden_size
        widths += k * (3 * i + d) + 2 * d + cfg.num_experts + 1 + 3 * cfg.shared_expert_intermediate_size
    return tokens * widths * elem + tokens * keys


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def resolve(cfg: ModelConfig, options: EngineOptions, weights_resident: bool = False) -> MemoryPlan:
    """The plan the engine will run: max_slots="auto" becomes the most slots that fit; a configuration that does not
    fit is a ValueError with the numbers and the largest max_slots and max_seq_len that would."""
    free = device_free_bytes(options.device)

    def at(**change) -> MemoryPlan:
        return plan(cfg, dataclasses.replace(options, **change), free, weights_resident)

    if options.max_slots == "auto":
        n = _largest(lambda n: at(max_slots=n).fits, AUTO_MAX_SLOTS)
        if n == 0:
            raise ValueError(f"max_slots='auto': not even one slot fits: {at(max_slots=1).describe()}")
        return at(max_slots=n)
    p = at()
    if not p.fits:
        slots = _largest(lambda n: at(max_slots=n).fits, options.slot_count)
        seq = _largest(lambda n: at(max_seq_len=n).fits, options.max_seq_len, least=2)
        hint = [f"max_slots={slots} at max_seq_len={options.max_seq_len}"] if slots else []
        hint += [f"max_seq_len={seq} at max_slots={options.max_slots}"] if seq >= 2 else []
        raise ValueError(
            f"this engine does not fit: {p.describe()}. "
            + (f"Largest that fit: {' or '.join(hint)}" if hint else "Even one slot of 2 tokens does not fit")
            + " (or raise memory_fraction, shrink prefix_cache_bytes, use a smaller dtype)"
        )
    return p


def _largest(fits, hi: int, least: int = 1) -> int:
    """The largest n in [least, hi] with fits(n) (monotone: more never fits where fewer does not); least - 1 if none."""
    lo = least - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
