"""Gated DeltaNet math for Qwen3.5's linear-attention layers.

Layout everywhere: batch-first and padded on the right. A call carries B sequences of up to T new tokens;
``lengths[b]`` (1..T) says how many are real. Padding positions produce outputs nobody reads and never move
any state, so one ragged batch gives the same states as running each sequence alone.

Per value head the recurrent state S is a [dk, dv] float32 matrix and each token does

    S = S * exp(g);  d = beta * (v - S^T k);  S = S + k d^T;  o = S^T q

with q, k L2-normalised (eps 1e-6) and q scaled by dk**-0.5, as in the HF reference and in fla.
"""

from __future__ import annotations

import functools
import inspect
import os
from itertools import accumulate, pairwise
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from . import fused

__all__ = [
    "conv_inputs",
    "window_at",
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule",
    "gated_delta_rule",
    "gated_delta_rule_segments",
    "backend_name",
]

L2_EPS = 1e-6


# --------------------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------------------


def _valid_mask(lengths: torch.Tensor | None, B: int, T: int, device: torch.device) -> torch.Tensor | None:
    """[B, T] bool, True on real tokens; None when every position is real (saves the masking work)."""
    if lengths is None:
        return None
    lengths = lengths.to(device=device, dtype=torch.long)
    return torch.arange(T, device=device)[None, :] < lengths[:, None]


def _mask_padding(mask: torch.Tensor | None, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Zero every padding position (a fill, not a multiply, so garbage there, even NaN, cannot leak).

    With g = 0 and beta = 0 a token's update is the identity, which is what keeps states untouched; zeroing q, k
    and v as well keeps padding outputs clean and keeps inf/NaN out of the chunk matmuls."""
    if mask is None:
        return list(xs)
    pad = ~mask
    return [x.masked_fill(pad.view(pad.shape + (1,) * (x.dim() - 2)), 0) for x in xs]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # Same form as HF (rsqrt of sum of squares + eps) so the fp32 paths agree to rounding.
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def _prepare(q, k, v, g, beta, lengths):
    """fp32 copies with q/k normalised, q scaled, and padding neutralised."""
    B, T, _, dk = q.shape
    q = _l2norm(q.float()) * dk**-0.5
    k = _l2norm(k.float())
    v, g, beta = v.float(), g.float(), beta.float()
    mask = _valid_mask(lengths, B, T, q.device)
    q, k, v, g, beta = _mask_padding(mask, q, k, v, g, beta)
    return q, k, v, g, beta


def _initial_state(initial_state, B, H, dk, dv, device):
    if initial_state is None:
        return torch.zeros(B, H, dk, dv, dtype=torch.float32, device=device)
    # no copy: the recurrences below only rebind S (never write in place), so the caller's cache slot is safe
    return initial_state.to(device=device, dtype=torch.float32)


# --------------------------------------------------------------------------------------------------------------------
# short causal convolution
# --------------------------------------------------------------------------------------------------------------------


def conv_inputs(conv_state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[carried window | new inputs] [B, C, K-1+T] in x's dtype, from conv_state [B, C, K-1] and x [B, T, C]: the
    window after the first t new tokens is [..., t : t+K-1]."""
    return torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1)


def window_at(full: torch.Tensor, ends: torch.Tensor, width: int) -> torch.Tensor:
    """Each row's conv window after its first ends[b] new tokens: full[b, :, ends[b] : ends[b]+width]."""
    idx = ends.to(device=full.device, dtype=torch.long)[:, None] + torch.arange(width, device=full.device)[None, :]
    return full.gather(2, idx[:, None, :].expand(full.shape[0], full.shape[1], width))


def causal_conv1d(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over new tokens, continuing from the last K-1 inputs of each sequence.

    Prefill and decode share this one path: the carried state plays the role of left zero-padding for a fresh
    sequence and of history afterwards, so chained calls equal one long call. The new state is gathered at each
    sequence's own end so right padding never enters it.

    x [B, T, C], conv_state [B, C, K-1], weight [C, K], lengths [B] or None -> (y [B, T, C], state [B, C, K-1]).
    """
    B, T, C = x.shape
    K = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(B, C, K - 1)
    full = conv_inputs(conv_state, x)  # [B, C, K-1+T]
    y = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), groups=C)  # [B, C, T]
    y = F.silu(y).to(x.dtype).transpose(1, 2)

    if K == 1:
        return y, conv_state
    # sequence b's last K-1 real inputs sit at full[b, :, lengths[b] : lengths[b] + K - 1]
    new_state = full[:, :, T:] if lengths is None else window_at(full, lengths, K - 1)
    return y, new_state.to(conv_state.dtype).contiguous()


# --------------------------------------------------------------------------------------------------------------------
# gated delta rule: chunked (prefill) and per-token (decode / reference)
# --------------------------------------------------------------------------------------------------------------------


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence: the cheapest form for one decode token and the plainest statement of the math,
    which the chunked form is tested against.

    q, k [B, T, H, dk] (raw, normalised here), v [B, T, H, dv], g/beta [B, T, H], initial_state [B, H, dk, dv]
    -> (o [B, T, H, dv] in v's dtype, final_state [B, H, dk, dv] float32).
    """
    B, T, H, dk = q.shape
    dv, out_dtype = v.shape[-1], v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, lengths)
    S = _initial_state(initial_state, B, H, dk, dv, q.device)
    o = torch.empty(B, T, H, dv, dtype=torch.float32, device=q.device)
    decay = g.exp()
    for t in range(T):
        S = S * decay[:, t, :, None, None]
        k_t = k[:, t].unsqueeze(-2)  # [B, H, 1, dk]
        pred = (k_t @ S).squeeze(-2)  # S^T k: what the memory already says for this key
        delta = beta[:, t, :, None] * (v[:, t] - pred)  # [B, H, dv]
        S = S + k_t.transpose(-1, -2) * delta.unsqueeze(-2)
        o[:, t] = (q[:, t].unsqueeze(-2) @ S).squeeze(-2)
    return o.to(out_dtype), S


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    lengths: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as the per-token loop, but prefill becomes batched matmuls plus one small loop over chunks.

    Inside a chunk (positions i, j; G_i = cumulative log-decay from the chunk start, S0 = state entering it):
      the deltas obey  d_i + sum_{j<i} beta_i exp(G_i-G_j) (k_i.k_j) d_j = beta_i (v_i - exp(G_i) S0^T k_i),
      a unit lower-triangular system (the WY / UT transform), so D = U - W S0 with U, W solved once for all
      chunks, independent of S0.  Then
      o_i   = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i-G_j) (q_i.k_j) d_j
      S_end = exp(G_last) S0 + sum_j exp(G_last-G_j) k_j d_j^T.
    Every exponent used is <= 0, so strong decays underflow to 0 instead of overflowing, and differences
    G_i - G_j are summed as segments rather than subtracted (see below).

    Shapes and dtypes as recurrent_gated_delta_rule. T need not be a multiple of chunk_size: the tail is padded
    with g = beta = 0 tokens, which are identities.
    """
    B, T, H, dk = q.shape
    dv, out_dtype = v.shape[-1], v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, lengths)
    S = _initial_state(initial_state, B, H, dk, dv, q.device)

    L = chunk_size
    N = -(-T // L)
    pad = N * L - T
    # -> [B, H, N, L, d] and [B, H, N, L]
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)).reshape(B, H, N, L, -1) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(1, 2), (0, pad)).reshape(B, H, N, L) for x in (g, beta))

    G = g.cumsum(dim=-1)  # [B, H, N, L]
    # seg[i, j] = sum_{j<m<=i} g_m = G_i - G_j, summed directly: after one strongly decaying token G is large and
    # G_i - G_j would cancel catastrophically in fp32 (1e-3 errors at |G| ~ 1e4); the segment sum does not.
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    seg = torch.where(causal.tril(-1), g.unsqueeze(-1), 0.0).cumsum(dim=-2)  # [B, H, N, L, L]
    decay = torch.where(causal, seg, float("-inf")).exp()  # 1 on the diagonal, 0 above it

    # Unit lower-triangular system: the solver reads only the strict lower part and assumes ones on the diagonal.
    system = (k @ k.transpose(-1, -2)) * decay * beta.unsqueeze(-1)
    rhs = torch.cat([v * beta.unsqueeze(-1), k * (beta * G.exp()).unsqueeze(-1)], dim=-1)
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    U, W = sol[..., :dv], sol[..., dv:]  # D = U - W @ S0

    attn = (q @ k.transpose(-1, -2)) * decay  # intra-chunk, includes the diagonal
    q_in = q * G.exp().unsqueeze(-1)  # reads of the entering state
    k_out = k * seg[..., -1, :].exp().unsqueeze(-1)  # writes, decayed to the chunk end (G_last - G_j)
    chunk_decay = G[..., -1:].exp().unsqueeze(-1)  # [B, H, N, 1, 1]

    o = torch.empty(B, H, N, L, dv, dtype=torch.float32, device=q.device)
    for n in range(N):
        D = U[:, :, n] - W[:, :, n] @ S
        o[:, :, n] = q_in[:, :, n] @ S + attn[:, :, n] @ D
        S = S * chunk_decay[:, :, n] + k_out[:, :, n].transpose(-1, -2) @ D

    o = o.reshape(B, H, N * L, dv)[:, :, :T].transpose(1, 2)
    return o.to(out_dtype).contiguous(), S


# --------------------------------------------------------------------------------------------------------------------
# dispatch: fla's Triton kernels on CUDA when installed, our torch code otherwise
# --------------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _load_fla():
    """(chunk, fused_recurrent) from fla, or None. Imported lazily and only for CUDA tensors: CPU never touches
    fla/triton. POCKETLAB_NO_FLA=1 forces the torch path (for A/B checks)."""
    if os.environ.get("POCKETLAB_NO_FLA", "") not in ("", "0"):
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    except Exception:
        return None
    return fla_chunk, fla_recurrent


def _fla_ops(device: torch.device | str):
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _load_fla()


def backend_name(device: torch.device | str) -> str:
    """Which implementation gated_delta_rule uses on `device`: "fla" or "torch" (for the README and bench)."""
    return "fla" if _fla_ops(device) is not None else "torch"


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The entry point the model calls; same contract as chunk_gated_delta_rule.

    fla's kernels take raw q/k and normalise them in-kernel (use_qk_l2norm_in_kernel=True, eps 1e-6), apply
    `scale` to q afterwards, take g as log-decay and keep the state as [B, H, dk, dv] float32, which is exactly
    our contract. Arguments go by keyword because fla's positional order differs between its two entry points
    (fused_recurrent has gk/gv before beta). float32 prompts run our chunk code: fla's chunk kernels multiply
    in TF32 there (~1e-3 off), which would break the float32 parity contract.
    """
    ops = _fla_ops(q.device)
    T = q.shape[1]
    if ops is None or (T > 1 and v.dtype == torch.float32):  # fla's chunk kernels take TF32 dots in float32
        if T == 1:
            return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, lengths)
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state, lengths)
    q, k, v, g, beta, state = _fla_inputs(q, k, v, g, beta, initial_state, lengths)
    fla_chunk, fla_recurrent = ops
    if T > 1:
        o, final_state = _fla_chunk_packed(fla_chunk, q, k, v, g, beta, state, q.shape[-1] ** -0.5)
    else:
        o, final_state = fla_recurrent(
            **{name: x.contiguous() for name, x in dict(q=q, k=k, v=v, g=g, beta=beta).items()},
            scale=q.shape[-1] ** -0.5,
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
    return o.to(v.dtype), final_state.float()


def gated_delta_rule_segments(q, k, v, g, beta, initial_state, lengths, ends, rule=gated_delta_rule):
    """`rule` over the T tokens cut at `ends` (ascending, the last T), each segment a call of its own from the
    state the one before ended in: (outputs [B, T, H, dv], the state after each end). Prefill hands those states
    to the prefix cache, and a prompt resumed from one continues as this forward did. With fla, bf16 and the
    default rule, one pass (`_fla_segments`) gives the bits of the per-segment chunk calls."""
    parts = _fla_parts() if rule is gated_delta_rule and _fla_ops(q.device) is not None else None
    if parts is not None and v.dtype != torch.float32:
        q, k, v, g, beta, state = _fla_inputs(q, k, v, g, beta, initial_state, lengths)
        o, states = _fla_segments(parts, q, k, v, g, beta, state, ends)
        return o.to(v.dtype), states
    outs, states, state = [], [], initial_state
    for lo, hi in pairwise([0, *ends]):
        seg = None if lengths is None else (lengths - lo).clamp(0, hi - lo)  # rows that ended stay unchanged
        o, state = rule(*(x[:, lo:hi] for x in (q, k, v, g, beta)), state, seg)
        outs.append(o)
        states.append(state)
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0], states


def _fla_inputs(q, k, v, g, beta, initial_state, lengths):
    """What fla's kernels take: padding zeroed, q/k in v's dtype, g float32, the state a float32 [B, H, dk, dv]
    (fla only reads h0 and writes the final state to a fresh tensor: no defensive copy needed)."""
    B, T, H, dk = q.shape
    q, k, v, g, beta = _mask_padding(_valid_mask(lengths, B, T, q.device), q, k, v, g, beta)
    if initial_state is None:
        state = torch.zeros(B, H, dk, v.shape[-1], dtype=torch.float32, device=q.device)
    else:
        state = initial_state.to(torch.float32).contiguous()
    return q.to(v.dtype), k.to(v.dtype), v, g.float(), beta, state


FLA_CHUNK = 64  # the delta rule's chunk length in fla (its default), which the chunk indices count in
FLA_L2NORM_ROWS = 65536  # fla's in-kernel L2 norm compiles once per this many rows (head vectors) of q or k


def _fla_chunk_packed(fla_chunk, q, k, v, g, beta, state, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunk kernels over B padded rows as ONE sequence-packed call (batch 1, row b = tokens [bT, (b+1)T)),
    so that no kernel specialises on the batch size (fla's cumsum takes it as a compile-time constant) and each
    prompt-batch size stops compiling its own kernels. The packing is built from B and T alone, on the device,
    so it also runs inside a graph capture. Past one block of FLA_L2NORM_ROWS rows q and k are normalised here
    instead of in fla's kernel, whose variants grow with the row count."""
    B, T, H = q.shape[:3]
    in_kernel = B * T * H <= FLA_L2NORM_ROWS
    if not in_kernel:
        q, k = _l2norm_as(q), _l2norm_as(k)
    n = -(-T // FLA_CHUNK)
    chunk = torch.arange(B * n, device=q.device)
    o, final_state = fla_chunk(
        **{
            name: x.reshape(1, B * T, *x.shape[2:]).contiguous()
            for name, x in dict(q=q, k=k, v=v, g=g, beta=beta).items()
        },
        scale=scale,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=in_kernel,
        cu_seqlens=torch.arange(0, (B + 1) * T, T, device=q.device),
        chunk_indices=torch.stack([chunk // n, chunk % n], dim=1),  # (row, chunk within the row) per chunk
        chunk_size=FLA_CHUNK,
    )
    return o.reshape(B, T, *o.shape[2:]), final_state


@functools.lru_cache(maxsize=1)
def _fla_parts() -> SimpleNamespace | None:
    """fla's chunk forward in its pieces (the q/k norm, the chunk-local decay cumsum, the intra-chunk WY solve, the
    state recurrence, the outputs), as fla 0.6 composes them inside its chunk entry point; None where this fla
    has no such pieces (then segments run as calls of their own)."""
    if _load_fla() is None:
        return None
    try:
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
    except Exception:
        return None
    parts = SimpleNamespace(
        l2norm=l2norm_fwd,
        cumsum=chunk_local_cumsum,
        intra=chunk_gated_delta_rule_fwd_intra,
        states=chunk_gated_delta_rule_fwd_h,
        outputs=chunk_fwd_o,
        log2e=RCP_LN2,
    )
    return parts if takes_our_arguments(parts) else None


_PART_ARGUMENTS = dict(  # the keywords `_fla_segments` passes each piece
    cumsum=("g", "chunk_size", "scale", "cu_seqlens", "chunk_indices"),
    intra=("k", "v", "g", "beta", "cu_seqlens", "chunk_indices", "chunk_size"),
    states=(
        "k",
        "w",
        "u",
        "g",
        "initial_state",
        "output_final_state",
        "cu_seqlens",
        "chunk_indices",
        "chunk_offsets",
        "chunk_size",
    ),  # fmt: skip
    outputs=("q", "k", "v", "h", "g", "scale", "cu_seqlens", "chunk_indices", "chunk_size"),
)


def takes_our_arguments(parts) -> bool:
    """Whether each of fla's pieces still takes the keywords we pass (their signatures through fla's wrappers): an
    fla whose internals moved on falls back to one call per segment instead of failing inside a prefill."""
    for name, keywords in _PART_ARGUMENTS.items():
        try:
            accepted = inspect.signature(getattr(parts, name)).parameters
        except (TypeError, ValueError):
            return False
        if any(k not in accepted for k in keywords):
            return False
    return True


@functools.lru_cache(maxsize=64)
def _segment_packing(B: int, lengths: tuple[int, ...], device: torch.device) -> tuple:
    """Index tensors for B rows cut into segments of `lengths` tokens, packed segment-major (sequence s * B + b:
    row b's tokens of segment s): the whole packing's (cu_seqlens, chunk_indices), then per segment the
    (cu_seqlens, chunk_indices, chunk_offsets) of its B sequences alone. chunk_indices are (sequence, chunk)
    pairs. Kept per shape (read-only): every linear layer of a forward, and every forward of that shape, reuses
    them rather than paying a host-to-device copy (which waits for the GPU) each."""
    chunks = [-(-n // FLA_CHUNK) for n in lengths]
    lists: list[list[int] | list[tuple[int, int]]] = [
        list(accumulate((n for n in lengths for _ in range(B)), initial=0)),
        [(s * B + b, c) for s, n in enumerate(chunks) for b in range(B) for c in range(n)],
    ]
    for n, c in zip(lengths, chunks, strict=True):
        lists += [
            [n * b for b in range(B + 1)],
            [(b, i) for b in range(B) for i in range(c)],
            [c * b for b in range(B + 1)],
        ]
    flat = torch.tensor([y for values in lists for x in values for y in (x if isinstance(x, tuple) else (x,))],
                        device=device)  # fmt: skip
    views, at = [], 0
    for values in lists:
        pairs = bool(values) and isinstance(values[0], tuple)
        n = len(values) * (2 if pairs else 1)
        views.append(flat[at : at + n].view(-1, 2) if pairs else flat[at : at + n])
        at += n
    return tuple(views[:2]), [tuple(views[i : i + 3]) for i in range(2, len(views), 3)]


def _fla_segments(parts, q, k, v, g, beta, state, ends) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The per-segment calls of `_fla_chunk_packed` in one pass. Packed segment-major, all segments' chunk-local
    work (q/k norm, decay cumsum, WY solve, outputs) is one launch each; only the state recurrence, the one part
    that crosses chunks, runs per segment, from the state the segment before ended in. Every chunk sees what its
    own call would, so the bits are those calls' (q/k are normed in fla's kernel or by us by the row count of the
    whole pass, not of each segment)."""
    B, T, H = q.shape[:3]
    bounds = list(pairwise([0, *ends]))
    (cu, chunks), per_segment = _segment_packing(B, tuple(hi - lo for lo, hi in bounds), q.device)
    row_major = B == 1 or len(bounds) == 1  # segment-major is then the rows' own order

    def packed(x):  # [B, T, ...] -> [1, B * T, ...], segment-major
        if row_major:
            return x.reshape(1, B * T, *x.shape[2:]).contiguous()
        return torch.cat([x[:, lo:hi].reshape(B * (hi - lo), *x.shape[2:]) for lo, hi in bounds])[None]

    q, k, v, g, beta = (packed(x) for x in (q, k, v, g, beta))
    if B * T * H <= FLA_L2NORM_ROWS:
        q, k = parts.l2norm(q)[0], parts.l2norm(k)[0]
    else:
        q, k = _l2norm_as(q), _l2norm_as(k)
    index = dict(cu_seqlens=cu, chunk_indices=chunks, chunk_size=FLA_CHUNK)
    g = parts.cumsum(g, chunk_size=FLA_CHUNK, scale=parts.log2e, cu_seqlens=cu, chunk_indices=chunks)
    w, u, _ = parts.intra(k=k, v=v, g=g, beta=beta, **index)
    hs, vs, states = [], [], []
    for (lo, hi), (cu_s, chunks_s, offsets_s) in zip(bounds, per_segment, strict=True):
        at = slice(B * lo, B * hi)
        h, v_new, state = parts.states(
            k=k[:, at], w=w[:, at], u=u[:, at], g=g[:, at], initial_state=state, output_final_state=True,
            cu_seqlens=cu_s, chunk_indices=chunks_s, chunk_offsets=offsets_s, chunk_size=FLA_CHUNK,
        )  # fmt: skip
        hs.append(h)
        vs.append(v_new)
        states.append(state)
    h, v_new = (torch.cat(x, dim=1) if len(x) > 1 else x[0] for x in (hs, vs))
    o = parts.outputs(q=q, k=k, v=v_new, h=h, g=g, scale=q.shape[-1] ** -0.5, **index)
    if row_major:
        return o.view(B, T, *o.shape[2:]), states
    o = [o[0, B * lo : B * hi].view(B, hi - lo, *o.shape[2:]) for lo, hi in bounds]
    return torch.cat(o, dim=1), states


@fused.compiled_in_graphs
def _l2norm_as(x: torch.Tensor) -> torch.Tensor:
    """Our L2 norm in float32, rounded back to x's dtype (as fla's in-kernel norm stores it)."""
    return _l2norm(x.float()).to(x.dtype)
