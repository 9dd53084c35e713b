"""The fused linears (layers.invariant.matmul; layers.gemv at decode's few rows): matmul and residual add or SwiGLU
in one kernel give what the unfused torch steps give, and each row the same bits in any batch (natively on CUDA,
through Triton's interpreter on the CPU)."""

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from invariance import assert_rows_invariant  # noqa: E402

from pocketlab.layers import gemv, gemv_tma, matmul_tma  # noqa: E402
from pocketlab.layers import invariant as inv  # noqa: E402
from pocketlab.layers import linear as torch_linear  # noqa: E402
from pocketlab.layers.invariant import matmul  # noqa: E402
from pocketlab.layers.norm import RMSNorm, _rms_norm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (N, K): K in several slices at few rows, and a shape off the tiles in one slice
SHAPES = {torch.float32: [(40, 300), (100, 70)], torch.bfloat16: [(40, 1030), (100, 70)]}
EPILOGUES = ["plain", "bias", "residual", "swiglu"]


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEV, dtype)


def inputs(M, N, K, dtype, epilogue, seed=0):
    """x [M, K], the weight (2N rows for swiglu) and the fused extras."""
    x = randn(M, K, dtype=dtype, seed=seed)
    w = randn(2 * N if epilogue == "swiglu" else N, K, dtype=dtype, scale=K**-0.5, seed=seed + 1)
    extras = dict(
        residual=randn(M, N, dtype=dtype, seed=seed + 3) if epilogue == "residual" else None,
        swiglu=epilogue == "swiglu",
    )
    bias = randn(N, dtype=dtype, seed=seed + 4) if epilogue == "bias" else None
    return x, w, bias, extras


def fp32_matmul(x, w, bias=None):
    """x @ w^T summed in float32 and rounded once to x's dtype, as cuBLAS does for 16-bit inputs."""
    return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)


def scaled_matmul(x, eps):
    """fp32_matmul with x's rows normed by a unit RMSNorm as one scalar a row on the fp32 sums (the norm's weight
    folded into w), the bias added after, one rounding."""
    rsqrt = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)

    def matmul(a, w, bias=None):
        y = F.linear(a.float(), w.float()) * rsqrt
        return (y if bias is None else y + bias.float()).to(x.dtype)

    return matmul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_fused_linear_matches_the_unfused_torch_steps(dtype, epilogue):
    """Against the unfused torch steps (layers.linear.composed: matmul, SwiGLU or residual add), at rows that
    take a program per K slice and at rows that take every slice in one program."""
    for N, K in SHAPES[dtype]:
        for M in (1, 5, matmul.MANY_ROWS + 3):
            x, w, bias, extras = inputs(M, N, K, dtype, epilogue, seed=M)
            want = torch_linear.composed(fp32_matmul, x, w, bias, **extras)
            assert_matches_the_unfused_steps(inv.linear(x, w, bias, **extras), want, dtype, (N, K, M))


def assert_matches_the_unfused_steps(got, want, dtype, where):
    """float32: a few ulps. bf16: every rounding in the same place, so the two differ only where the float32 sums'
    order tips a rounding (well under 1% of the outputs, by an ulp or two); a rounding moved or missed would change
    about a third of them."""
    assert got.shape == want.shape and got.dtype == dtype, where
    err = (got.float() - want.float()).abs()
    if dtype == torch.float32:
        assert err.max() <= 3e-6 * max(1.0, want.abs().max().item()), (where, err.max())
    else:  # two bf16 ulps at most (a tipped gate rounding carries through silu and the product)
        assert (err / want.float().abs().clamp(min=1e-3)).max() <= 2**-6, (where, err.max())
        tipped = (got != want).sum().item()  # one tipped element is over 1% of the smallest outputs (80 values)
        assert tipped <= max(1, 0.01 * got.numel()), (where, tipped, got.numel())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_gemv_matches_the_unfused_torch_steps(dtype, epilogue):
    """layers.gemv (decode's few rows, each weight row streamed once) against the unfused torch steps, at every row
    count it takes, with K and N off its tiles."""
    for N, K in SHAPES[dtype]:
        for M in range(1, gemv.MAX_ROWS + 1):
            x, w, bias, extras = inputs(M, N, K, dtype, epilogue, seed=M)
            want = torch_linear.composed(fp32_matmul, x, w, bias, **extras)
            assert_matches_the_unfused_steps(gemv.gemv(x, w, bias, **extras), want, dtype, (N, K, M))


@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_tma_ring_matmul_matches_the_unfused_torch_steps(epilogue, monkeypatch):
    """The few-row matmul through a TMA ring as W @ x^T (POCKETLAB_MATMUL_TMA, layers.matmul_tma), reached through
    the default engine's linear, against the unfused torch steps: rows padded to 16 and to 32 columns of the dot,
    N off the 64-row tile (the gate rows past N), K over two slices and off the 128-wide tile (zero fill), plain
    projections only when switched in; rows TMA cannot read (off 16-byte alignment) and no rows at all keep the
    invariant matmul."""
    monkeypatch.setenv("POCKETLAB_MATMUL_TMA", "64:3:0:1")
    real, taken = matmul_tma.launch, []
    monkeypatch.setattr(matmul_tma, "launch", lambda *a, **k: taken.append(1) or real(*a, **k))
    linear = torch_linear.fused_at_few_rows(inv.linear)
    N, K = 72, 1096
    assert matmul.order(N, K, torch.bfloat16).split_k == 2
    for M in (3, 20):
        x, w, bias, extras = inputs(M, N, K, torch.bfloat16, epilogue, seed=M)
        want = torch_linear.composed(fp32_matmul, x, w, bias, **extras)
        assert_matches_the_unfused_steps(linear(x, w, bias, **extras), want, torch.bfloat16, (N, K, M))
    assert len(taken) == 2
    monkeypatch.setenv("POCKETLAB_MATMUL_TMA", "64:3:0:0")
    linear(x, w, bias, **extras)
    linear(x[:, 1 : K - 7], w[:, 1 : K - 7], bias, **extras)  # off 16-byte alignment
    assert len(taken) == 2 + (epilogue in ("residual", "swiglu"))
    residual = extras["residual"]
    empty = matmul_tma.linear(x[:0], w, bias, ring=matmul_tma.DEFAULT_RING,
                              **extras | {"residual": None if residual is None else residual[:0]})  # fmt: skip
    assert empty.shape == (0, N) and len(taken) == 2 + (epilogue in ("residual", "swiglu"))


def test_a_ring_runs_short_k_in_one_slice_only_for_weights_of_many_tiles():
    """`Ring(one_slice_k=K)`: a weight of K up to it and at least ONE_SLICE_TILES tiles runs in one slice (the 8B
    qkv and o_proj at 4,096); a longer K (down, 12,288) or fewer tiles (0.6B o_proj's 16) keep the order's slices.
    The default ring's 1,024 takes 0.6B's qkv, not 8B's."""
    many = matmul_tma.ONE_SLICE_TILES
    for (N, K), tiles, split in [((6144, 4096), 96, 1), ((4096, 4096), many, 1), ((4096, 12288), many, 4),
                                 ((1024, 2048), 16, 4), ((4096, 4096), many - 1, 4)]:  # fmt: skip
        o = matmul_tma.ring_order(matmul.order(N, K, torch.bfloat16), K, tiles, 4096)
        assert (o.split_k, o.k_per_split) == (split, -(-K // 128 // split) * 128), (N, K, tiles)
    assert matmul_tma.ring_order(matmul.order(6144, 4096, torch.bfloat16), 4096, 96, 0).split_k == 2
    default = matmul_tma.DEFAULT_RING.one_slice_k  # 0.6B's qkv in one slice, not two; 8B's keeps its two
    assert matmul_tma.ring_order(matmul.order(4096, 1024, torch.bfloat16), 1024, many, default).split_k == 1
    assert matmul_tma.ring_order(matmul.order(6144, 4096, torch.bfloat16), 4096, 96, default).split_k == 2


@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_a_ring_of_one_slice_matches_the_unfused_torch_steps(epilogue, monkeypatch):
    """The ring with short K in one slice sums all of K in one program, not the invariant order's four slices:
    here ONE_SLICE_TILES is one, so two tiles of 64 rows over a K of 18 steps take it."""
    monkeypatch.setattr(matmul_tma, "ONE_SLICE_TILES", 1)
    monkeypatch.setenv("POCKETLAB_MATMUL_TMA", "64:2:0:1:2:4096")
    chosen, real = [], matmul_tma.ring_order
    monkeypatch.setattr(matmul_tma, "ring_order", lambda *a: chosen.append(real(*a)) or chosen[-1])
    linear = torch_linear.fused_at_few_rows(inv.linear)
    N, K = 72, 2304
    assert matmul.order(N, K, torch.bfloat16).split_k == 4
    x, w, bias, extras = inputs(5, N, K, torch.bfloat16, epilogue)
    want = torch_linear.composed(fp32_matmul, x, w, bias, **extras)
    assert_matches_the_unfused_steps(linear(x, w, bias, **extras), want, torch.bfloat16, (N, K, 5))
    assert [o.split_k for o in chosen] == [1]


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("offset", [False, True], ids=["w*x", "(1+w)*x"])
def test_tma_ring_norms_rows_by_the_squares_its_residual_epilogue_left(epilogue, offset, monkeypatch):
    """Batches of 2-64 rows on sm_90: the ring's residual epilogue stores each row's sum of squares over its tile of
    columns beside the residual stream it writes, and the next projection, its pre-norm's weight folded in (a unit
    norm), scales its fp32 sums by rsqrt(mean(x^2) + eps) from them, with no norm launch: against that arithmetic
    in torch over the folded weight. A tensor no epilogue wrote, or a norm not folded, runs the norm's own launch.
    Rows of rms 0.01-10; a stream of 18 column tiles (the last partial), K in two slices."""
    monkeypatch.setenv("POCKETLAB_MATMUL_TMA", "64:3:0:1")
    linear, dtype = torch_linear.fused_at_few_rows(inv.linear), torch.bfloat16
    N, K, inner = 40, 1096, 200
    for M in (3, 20):
        scales = torch.logspace(-2, 1, M, device=DEV, dtype=dtype)[:, None]
        stream = randn(M, K, dtype=dtype, seed=M) * scales
        h = linear(randn(M, inner, dtype=dtype, seed=M + 1), randn(K, inner, dtype=dtype, scale=0.01, seed=M + 2),
                   residual=stream)  # fmt: skip
        sums = getattr(h, matmul_tma.SQUARES)
        assert sums.shape == (18, M) and torch.allclose(sums.sum(0), h.float().pow(2).sum(-1), rtol=1e-5)
        _, w, bias, extras = inputs(M, N, K, dtype, epilogue, seed=M)
        norm = RMSNorm(randn(K, dtype=dtype, seed=M + 7), 1e-2, offset)
        folded = norm.fold_into(w.clone())
        calls: list[int] = []
        norm.norm = lambda *a, run=norm.norm, calls=calls: calls.append(1) or run(*a)
        want = torch_linear.composed(scaled_matmul(h, norm.eps), h, folded, bias, **extras)
        assert_matches_the_unfused_steps(linear(h, folded, bias, norm=norm, **extras), want, dtype, (M, offset))
        assert calls == []
        copy = h.clone()  # the same values, but no epilogue's output: no sums come with it
        want = torch_linear.composed(fp32_matmul, norm(copy), folded, bias, **extras)
        assert_matches_the_unfused_steps(linear(copy, folded, bias, norm=norm, **extras), want, dtype, (M, "copy"))
        assert len(calls) == 2
        weighted = RMSNorm(norm.weight * 2, norm.eps)
        assert not weighted.unit and matmul_tma.carried_squares(h, weighted) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_tma_ring_gemv_matches_the_unfused_torch_steps(dtype, epilogue, monkeypatch):
    """layers.gemv's one-row calls through the TMA ring (POCKETLAB_GEMV_TMA, layers.gemv_tma) against the
    same steps, without and with both pre-norm flavours: N and K off the ring's tiles (the descriptor's zero fill),
    K over several laps of a three-tile ring. Rows TMA cannot read (not 16-byte aligned) and several rows keep
    layers.gemv's own launch."""
    monkeypatch.setenv("POCKETLAB_GEMV_TMA", "8,64,3")
    real, taken = gemv_tma.launch, []
    monkeypatch.setattr(gemv_tma, "launch", lambda *a, **k: taken.append(1) or real(*a, **k))
    for N, K in [(40, 1032), (100, 72)]:
        x, w, bias, extras = inputs(1, N, K, dtype, epilogue, seed=N)
        x = x * 3.0  # rms 3: a norm left out shows
        for norm in (None, RMSNorm(randn(K, dtype=dtype, seed=N + 7), 1e-2, False),
                     RMSNorm(randn(K, dtype=dtype, seed=N + 8), 1e-2, True)):  # fmt: skip
            normed = x if norm is None else _rms_norm(x.float(), norm.weight.float(), norm.eps, norm.offset)
            want = torch_linear.composed(lambda a, b, c=None: fp32_matmul(a, b, c).to(dtype), normed, w, bias, **extras)
            got = gemv.gemv(x, w, bias, norm=norm, **extras)
            assert_matches_the_unfused_steps(got, want, dtype, (N, K, norm is not None and norm.offset))
    assert len(taken) == 6
    x, w, bias, extras = inputs(2, 40, 1032, dtype, epilogue)
    gemv.gemv(x, w, bias, **extras)  # two rows
    gemv.gemv(x[:1, 1:1025], w[:, 1:1025], bias, **extras | dict(residual=None))  # rows off 16-byte alignment
    assert len(taken) == 6


def test_one_row_gemvs_of_small_weights_take_the_ring_where_tma_is(monkeypatch):
    """Unswitched, a one-row GEMV takes layers.gemv_tma.ONE_ROW_RING where the device has TMA and the weight is at
    most RING_MAX_BYTES with rows of at most RING_MAX_K and at least RING_MIN_N of them; a larger weight, longer
    rows, fewer rows, several input rows, a device without TMA or POCKETLAB_GEMV_TMA=0 keep layers.gemv's own
    launch, and the switch's own ring wins over the rule."""
    rings = []
    monkeypatch.setattr(gemv_tma, "launch", lambda x, w, b, y, ring, *a: rings.append(ring))
    monkeypatch.delenv("POCKETLAB_GEMV_TMA", raising=False)
    x, w, _, _ = inputs(2, 40, 256, torch.float32, "plain")
    monkeypatch.setattr(gemv_tma, "RING_MAX_BYTES", w.numel() * w.element_size())
    monkeypatch.setattr(gemv_tma, "RING_MAX_K", w.shape[1])
    monkeypatch.setattr(gemv_tma, "RING_MIN_N", w.shape[0])
    for tma in (True, False):
        monkeypatch.setattr(gemv_tma, "has_tma", lambda device, tma=tma: tma)
        gemv.gemv(x[:1], w)
        gemv.gemv(x[:1], torch.cat([w, w[:1]]))  # one weight row past the limit
        gemv.gemv(torch.cat([x[:1], x[:1, :8]], 1), torch.cat([w[:20], w[:20, :8]], 1))  # half the bytes, longer rows
        gemv.gemv(x[:1], w[:-1])  # one weight row short of the minimum
        gemv.gemv(x, w)  # two rows
    monkeypatch.setattr(gemv_tma, "has_tma", lambda device: True)
    monkeypatch.setenv("POCKETLAB_GEMV_TMA", "0")
    gemv.gemv(x[:1], w)
    monkeypatch.setenv("POCKETLAB_GEMV_TMA", "8:64:3")
    gemv.gemv(x[:1], torch.cat([w, w[:1]]))
    assert rings == [gemv_tma.ONE_ROW_RING, gemv_tma.Ring(8, 64, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("offset", [False, True], ids=["w*x", "(1+w)*x"])
def test_gemv_norms_its_input_in_the_launch(dtype, epilogue, offset):
    """With a pre-norm the GEMV reads norm(x), never rounding the normed row: against the float32 norm, then the
    float32-summed matmul rounded once, then the epilogue, at every row count and with K off the tiles. Rows of
    very different scales, so a norm summed over part of K, a missing eps or weight, or a misplaced scale shows."""
    for N, K in SHAPES[dtype]:
        for M in range(1, gemv.MAX_ROWS + 1):
            x, w, bias, extras = inputs(M, N, K, dtype, epilogue, seed=M)
            x = x * torch.logspace(-2, 1, M, device=DEV, dtype=dtype)[:, None]  # rms 0.01 .. 10 by row
            norm = RMSNorm(randn(K, dtype=dtype, seed=M + 7), 1e-2, offset)  # eps large enough to count
            normed = _rms_norm(x.float(), norm.weight.float(), norm.eps, offset)
            want = torch_linear.composed(lambda a, b, c=None: fp32_matmul(a, b, c).to(dtype), normed, w, bias, **extras)
            got = gemv.gemv(x, w, bias, norm=norm, **extras)
            assert_matches_the_unfused_steps(got, want, dtype, (N, K, M, offset))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("offset", [False, True], ids=["w*x", "(1+w)*x"])
def test_fused_matmul_norms_rows_by_a_unit_norm(dtype, epilogue, offset):
    """A norm whose weight went into the projection (RMSNorm.fold_into) runs inside the matmul's launch at one row
    where one program covers all of K: the row's fp32 sums scaled by rsqrt(mean(x^2) + eps), then the one rounding
    and the epilogue. Against that arithmetic in torch over the folded weight (every rounding in the same place),
    and in float32 against the norm with its weight before the original one. Rows of rms 0.01-10; at more rows, or
    K split over programs, the norm runs as its own kernel, once."""
    for N, K in SHAPES[dtype]:  # (40, 300 or 1030): two slices, (100, 70): one
        for M in (1, 5, matmul.MANY_ROWS + 3):
            x, w, bias, extras = inputs(M, N, K, dtype, epilogue, seed=M)
            x = x * torch.logspace(-2, 1, M, device=DEV, dtype=dtype)[:, None]
            norm = RMSNorm(randn(K, dtype=dtype, seed=M + 7), 1e-2, offset)
            exact = _rms_norm(x.float(), norm.weight.float(), norm.eps, offset)
            folded = norm.fold_into(w.clone())
            calls: list[int] = []
            norm.norm = lambda *a, run=norm.norm, calls=calls: calls.append(1) or run(*a)
            got = inv.linear(x, folded, bias, norm=norm, **extras)
            assert norm.unit and len(calls) == (M > 1 or matmul.order(N, K, dtype).split_k > 1)
            if calls:  # the norm kernel's rounded row, then the plain launch
                want = torch_linear.composed(lambda a, b, c=None: fp32_matmul(a, b, c), norm(x), folded, bias, **extras)
            else:
                want = torch_linear.composed(scaled_matmul(x, norm.eps), x, folded, bias, **extras)
            assert_matches_the_unfused_steps(got, want, dtype, (N, K, M, offset))
            if dtype == torch.float32:  # the norm's weight moved into the projection changes no result
                unfolded = torch_linear.composed(lambda a, b, c=None: fp32_matmul(a, b, c), exact, w, bias, **extras)
                assert_matches_the_unfused_steps(got, unfolded, dtype, (N, K, M, offset, "unfolded"))


@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_gemv_two_tiles_ahead_sum_as_one(epilogue):
    """Two weight tiles in flight (ahead=2) sum as one does: the same bits, normed or not, at one and several rows."""
    N, K = 40, 200  # four 64-wide tiles, the last one partial
    for M in (1, 3):
        x, w, bias, extras = inputs(M, N, K, torch.bfloat16, epilogue, seed=M)
        residual = extras["residual"]
        epi = matmul.epilogue_of(residual, extras["swiglu"])
        base = dataclasses.replace(gemv.launch_for(M, N, K, x.device), block_k=64)
        for norm in (None, RMSNorm(randn(K, dtype=torch.bfloat16, seed=5), 1e-6, True)):
            y1, y2 = (torch.empty(M, N, dtype=x.dtype, device=DEV) for _ in range(2))
            want = gemv.launch(x, w, bias, y1, base, epi, residual, norm)
            got = gemv.launch(x, w, bias, y2, dataclasses.replace(base, ahead=2), epi, residual, norm)
            assert torch.equal(got, want), (epilogue, M, norm is not None)


@pytest.mark.parametrize("epilogue", ["swiglu", "residual", "bias"])
def test_gemv_rows_are_batch_invariant(epilogue):
    """With one launch (ROWS rows a program) each row's bits are its own in any batch of up to ROWS rows: rows
    never mix in the lanes, and every row sums its lanes in the same order."""
    N, K = SHAPES[torch.bfloat16][0]
    x, w, bias, extras = inputs(gemv.MAX_ROWS, N, K, torch.bfloat16, epilogue)
    residual = extras.pop("residual")
    epi = matmul.SWIGLU if extras["swiglu"] else matmul.RESIDUAL if residual is not None else matmul.PLAIN
    t = gemv.launch_for(gemv.MAX_ROWS, N, K, x.device)

    def run(index):
        y = torch.empty(len(index), N, dtype=x.dtype, device=DEV)
        return gemv.launch(x[index], w, bias, y, t, epi, None if residual is None else residual[index])

    solo = [run([i]) for i in range(len(x))]
    for index in ([3, 1], [2, 0, 3], [3, 2, 1, 0], [1, 1, 1, 1]):
        got = run(index)
        for row, i in enumerate(index):
            assert torch.equal(got[row], solo[i][0]), (epilogue, index, row)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("epilogue", ["swiglu", "residual", "bias"])
def test_fused_rows_are_batch_invariant(dtype, epilogue):
    """Each row's bits are its own in any batch: the K slices in a fixed order, epilogues row by row."""
    N, K = SHAPES[dtype][0]
    x, w, bias, extras = inputs(20, N, K, dtype, epilogue)
    residual = extras.pop("residual")
    if residual is None:
        assert_rows_invariant(lambda x: inv.linear(x, w, bias, **extras), x)
    else:
        assert_rows_invariant(lambda x, r: inv.linear(x, w, bias, residual=r, **extras), x, residual)


def test_both_launches_give_a_fused_row_the_same_bits():
    """A program per K slice (few rows) and every slice in one program (many rows) agree bit for bit, SwiGLU
    included."""
    N, K = SHAPES[torch.bfloat16][0]
    x, w, _, extras = inputs(matmul.MANY_ROWS + 2, N, K, torch.bfloat16, "swiglu")
    many = inv.linear(x, w, **extras)
    for rows in (1, 7, matmul.MANY_ROWS - 1):
        assert torch.equal(inv.linear(x[:rows], w, **extras), many[:rows])


@pytest.mark.parametrize("linear", [inv.linear, gemv.gemv], ids=["matmul", "gemv"])
def test_fused_linears_check_their_inputs(linear):
    x, w, _, extras = inputs(3, 40, 64, torch.float32, "residual")
    with pytest.raises(ValueError, match="residual"):
        linear(x, w, residual=extras["residual"][:, :-1])
    with pytest.raises(ValueError, match="swiglu"):
        linear(x, w[:-1], swiglu=True)
    with pytest.raises(ValueError, match="swiglu"):
        linear(x, w, residual=extras["residual"], swiglu=True)


def test_gemv_refuses_more_rows_than_a_launch_holds_and_column_major_weights():
    x, w, _, _ = inputs(3, 40, 64, torch.float32, "plain")
    with pytest.raises(ValueError, match="at most"):
        gemv.gemv(torch.cat([x, x]), w)
    with pytest.raises(ValueError, match="row-major"):
        gemv.gemv(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="norm weight"):
        gemv.gemv(x, w, norm=RMSNorm(randn(63), 1e-6))


def test_the_default_kernels_take_the_gemv_at_few_rows_and_fuse_only_decode_rows_with_something_to_fuse(monkeypatch):
    """fused_at_few_rows sends every call of up to gemv_rows rows (row-major weights) to the GEMV, decode-sized
    calls with a residual add or SwiGLU to the fused matmul, the rest to torch (the fused matmul's TMA form off)."""
    monkeypatch.setenv("POCKETLAB_MATMUL_TMA", "0")
    calls = []

    def kernel(name):
        return lambda x, w, *a, **k: calls.append((name, x.shape[0])) or F.linear(x, w)

    run = torch_linear.fused_at_few_rows(kernel("fused"), kernel("gemv"), gemv_rows=2)
    w, most = randn(8, 16), torch_linear.FUSED_MAX_ROWS
    run(randn(2, 16), w)
    run(randn(2, 16), w.t().contiguous().t())  # column-major: not the GEMV's layout
    run(randn(3, 16), w)
    run(randn(most + 1, 16), w, residual=randn(most + 1, 8))
    run(randn(most, 16), w, residual=randn(most, 8))
    run(randn(1, 16), w, residual=randn(1, 8))
    monkeypatch.setattr(torch_linear, "GEMV_MAX_BYTES", w.numel() * w.element_size() - 1)  # w: one byte over
    run(randn(1, 16), w, residual=randn(1, 8))
    assert calls == [("gemv", 2), ("fused", most), ("gemv", 1), ("fused", 1)]


def test_few_row_matmuls_take_the_tma_ring_where_tma_is(monkeypatch):
    """Unswitched, a matmul of up to matmul_tma.MAX_ROWS rows takes DEFAULT_RING where the device has TMA; more
    rows, no TMA or POCKETLAB_MATMUL_TMA=0 take none, and the switch's ring is taken as it says."""
    monkeypatch.delenv("POCKETLAB_MATMUL_TMA", raising=False)
    most, dev = matmul_tma.MAX_ROWS, torch.device(DEV)
    rings = []
    for tma in (True, False):
        monkeypatch.setattr(gemv_tma, "has_tma", lambda device, tma=tma: tma)
        rings += [matmul_tma.ring_for(most, dev), matmul_tma.ring_for(most + 1, dev)]
    monkeypatch.setattr(gemv_tma, "has_tma", lambda device: True)
    monkeypatch.setenv("POCKETLAB_MATMUL_TMA", "0")
    rings.append(matmul_tma.ring_for(2, dev))
    monkeypatch.setenv("POCKETLAB_MATMUL_TMA", "128:3:0:1")
    rings.append(matmul_tma.ring_for(2, dev))
    assert rings == [matmul_tma.DEFAULT_RING, None, None, None, None, matmul_tma.Ring(128, 3, 0, True)]
    # which calls a ring takes: by default plain ones at any row count, those with an epilogue from two rows
    ring, plain_off = matmul_tma.DEFAULT_RING, matmul_tma.Ring(plain=False, min_rows=1)
    assert [ring.takes(1, True), ring.takes(2, True), ring.takes(1, False)] == [False, True, True]
    assert [plain_off.takes(1, True), plain_off.takes(5, False)] == [True, False]


def test_gpu_fused_launches_keep_the_bits():
    """On the GPU every launch the sweeps try (tile rows and columns, warps, stages, one program per slice or all
    slices in one) gives a fused row the default launch's bits."""
    if DEV != "cuda":
        pytest.skip("the GPU's launch choices (the interpreter keeps one tile shape)")
    from pocketlab.layers.invariant import sweep

    for epilogue in ["swiglu", "residual", "plain"]:
        for N, K in [(1536, 4096), (1024, 6144)]:
            x, w, _, extras = inputs(200, N, K, torch.bfloat16, epilogue)
            fused = matmul.Fused(extras["residual"], getattr(matmul, epilogue.upper()))
            o = inv.order(N, K, torch.bfloat16)
            want = inv.linear(x[:16], w, swiglu=extras["swiglu"],
                              residual=None if extras["residual"] is None else extras["residual"][:16])  # fmt: skip
            for t in sweep.FUSED_FEW + [matmul.tiles(200, N, x.dtype, x.device, extras["swiglu"])]:
                y = matmul.launch(x, w, None, torch.empty(200, N, dtype=x.dtype, device=DEV), o, t, fused)
                assert torch.equal(y[:16], want), (epilogue, N, K, t)


def test_gpu_tma_matmul_gives_the_invariant_kernels_bits():
    """On the GPU the TMA ring (layers.matmul_tma) sums each element as the invariant matmul does (the same slices,
    the same chain of MMA steps in each): its rows equal that kernel's bit for bit, at 1-64 rows, K in one slice
    and in eight, with each epilogue (shapes where the one-slice rule keeps the invariant order's slices)."""
    if DEV != "cuda":
        pytest.skip("the GPU's MMA chains (the interpreter sums another way)")
    for epilogue in ["swiglu", "residual", "plain"]:
        for N, K in [(1536, 4096), (16384, 1024)]:
            assert inv.order(N, K, torch.bfloat16).split_k == (8 if K == 4096 else 1)
            x, w, _, extras = inputs(64, N, K, torch.bfloat16, epilogue)
            for M in (1, 7, 32, 64):
                some = dict(
                    swiglu=extras["swiglu"], residual=None if extras["residual"] is None else extras["residual"][:M]
                )
                got = matmul_tma.linear(x[:M], w, ring=matmul_tma.DEFAULT_RING, **some)
                assert torch.equal(got, inv.linear(x[:M], w, **some)), (epilogue, N, K, M)


FIVE_A_LAYER = {  # a decode step's Triton launches per layer with the fused kernels, in order
    "linear_attention": ["_gemv", "_recurrent_step", "_gemv", "_gemv", "_gemv"],  # conv in in_proj, norm in the step
    "full_attention": ["_gemv", "_partial_attention", "_gemv", "_gemv", "_gemv"],  # norms, RoPE, K/V, output gate
}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts the interpreter's launches")
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3_5"])
def test_a_decode_layer_is_five_launches(make_engine, monkeypatch, preset):
    """Issue 14's kernels a layer, pinned: one decode step with the fused kernels runs five Triton launches in every
    layer, Qwen3's or Qwen3.5's, Gated DeltaNet or attention (a fold undone brings back its launch: the gated norm
    after the state step, the output gate after the attention)."""
    engine = make_engine(preset, fused_linear="triton", linear_decode="triton", decode_attention="triton")
    layers = decode_launches_by_layer(engine, monkeypatch)
    kinds = engine.cfg.layer_types or ["full_attention"] * engine.cfg.num_hidden_layers
    assert len(layers) == len(kinds) and (preset == "tiny-qwen3" or {*kinds} == {*FIVE_A_LAYER})
    for kind, got in zip(kinds, layers, strict=True):
        assert got == list(FIVE_A_LAYER[kind]), kind


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts the interpreter's launches")
@pytest.mark.parametrize("fold", ["auto", "never"])
def test_a_gate_up_past_the_gemv_limit_keeps_five_launches_with_its_norm_folded(make_engine, monkeypatch, fold):
    """As at 8B and 9B, whose 201 MB gate_up is past the GEMV's limit and takes the fused matmul: with the norm's
    weight in gate_up (`fold_norm_weights`, "auto") the layer stays at five launches; without, the norm is a sixth."""
    monkeypatch.setattr(torch_linear, "GEMV_MAX_BYTES", 48 << 10)  # tiny-qwen3: gate_up 64 KiB, the others 32 or less
    options = dict(fused_linear="triton", linear_decode="triton", decode_attention="triton", fold_norm_weights=fold)
    norm = [] if fold == "auto" else ["_rms_norm_rows"]
    want = ["_gemv", "_partial_attention", "_gemv", *norm, "_matmul", "_gemv"]
    assert decode_launches_by_layer(make_engine("tiny-qwen3", **options), monkeypatch) == [want, want]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts the interpreter's launches")
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3_5"])
def test_a_batched_decode_step_norms_in_the_projections_where_the_ring_leaves_row_squares(make_engine, monkeypatch,
                                                                                           preset):  # fmt: skip
    """Where few-row matmuls take the TMA ring (sm_90; here switched in), "auto" folds every pre-norm's weight into
    the projection that reads it, and a batched decode step launches one norm, the first layer's: every other norm
    reads the row squares that the residual epilogue before it left."""
    monkeypatch.setenv("POCKETLAB_MATMUL_TMA", "64:3:0")
    options = dict(fused_linear="triton", linear_decode="triton", decode_attention="triton", dtype="bfloat16")
    engine = make_engine(preset, **options)
    assert all(layer.input_norm.unit and layer.post_norm.unit for layer in engine.model.layers)
    layers = decode_launches_by_layer(engine, monkeypatch, slots=2)
    assert [kernels.count("_rms_norm_rows") for kernels in layers] == [1] + [0] * (len(layers) - 1), layers


def decode_launches_by_layer(engine, monkeypatch, slots: int = 1) -> list[list[str]]:
    """The Triton launches (kernel names, in order) of each decoder layer in one decode step of `slots` slots, each
    after a 9-token prompt."""
    from conftest import random_prompt
    from triton.runtime.interpreter import InterpretedFunction

    from pocketlab.models.qwen3 import DecoderLayer
    from pocketlab.requests import BatchedRequest

    requests = [BatchedRequest(s, random_prompt(9, seed=2 + s), slot_id=s) for s in range(slots)]
    engine.batch_prefill(requests)  # each request's first token kept on it
    launches, layers = [], []
    run, call = InterpretedFunction.run, DecoderLayer.__call__

    def counted_call(layer, *args):
        before = len(launches)
        out = call(layer, *args)
        layers.append(launches[before:])
        return out

    monkeypatch.setattr(
        InterpretedFunction, "run", lambda self, *a, **k: launches.append(self.fn.__name__) or run(self, *a, **k)
    )
    monkeypatch.setattr(DecoderLayer, "__call__", counted_call)
    engine.batch_decode_step(requests)
    return layers


def compiled_in_a_process(code: str) -> str:
    """What `code` prints, run by a Python of its own with Triton compiling for the GPU (sm_90 on the CPU through
    gemv_sweep), not interpreting: this process's kernels are the interpreter's."""
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = os.environ | {"TRITON_INTERPRET": "0"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_the_resources_table_compiles_the_kernel_the_jit_builds():
    """gemv_sweep's sm_90 table (compiled on the CPU) marks pointers, sizes and strides divisible by 16 as the JIT
    finds them at the Qwen shapes. Only then does the fused matmul's 32-row SwiGLU tile pipeline its loads: its four
    stages keep three sets of x, gate and up tiles in shared memory, 120 KiB, one program an SM. Unmarked, the
    compile pipelines nothing and the table would describe another kernel. (A process of its own: the kernels here
    are the interpreter's.)"""
    usage = compiled_in_a_process(
        "from pocketlab.layers import gemv_sweep; from pocketlab.layers.invariant import matmul; "
        "print(gemv_sweep.fused_matmul_usage(matmul.Tiles(32, 64, 4, 4, matmul.LAST_SUMS), matmul.SWIGLU))"
    )
    stage = (32 * 128 + 2 * 64 * 128) * 2  # x, gate and up tiles of BLOCK_K 128, bf16
    assert f"{3 * stage} B shared" in usage, usage


def test_the_resources_table_counts_the_loop_of_the_fmas():
    """gemv_sweep's loop counts (`loop_ops`, machine code compiled on the CPU) find the one-row GEMV's K loop by its
    backward branch: one loop with FMAs, BLOCK_N x BLOCK_K / 128 threads of them a step (twice with the SwiGLU's up
    rows), and each thread's share of the weight tiles in 16-byte loads besides one load of x."""
    launches = [(4, 512, 1), (2, 1024, 1), (2, 512, 2)]  # (BLOCK_N, BLOCK_K, EPILOGUE)
    out = compiled_in_a_process(
        "import json; from pocketlab.layers import gemv, gemv_sweep as s; "
        f"print(json.dumps([s.loop_ops(s.gemv_code(gemv.Launch(1, n, k, 4), e)[1]) for n, k, e in {launches}]))"
    )
    for (n, k, epilogue), loops in zip(launches, json.loads(out), strict=True):
        with_fmas = [loop for loop in loops if loop["FFMA"]]
        assert len(with_fmas) == 1, (n, k, loops)
        step = with_fmas[0]
        assert step["FFMA"] == n * k // 128 * epilogue and step["LDG"] == epilogue * n * k * 2 // 128 // 16 + 1, loops


def test_the_resources_table_compiles_the_decode_attention():
    """gemv_sweep's decode-attention rows compile the kernel with the engine's arguments: a parameter the table's
    signature lacks fails the compile (a committed table once ended in such a traceback)."""
    out = compiled_in_a_process("from pocketlab.layers import gemv_sweep; gemv_sweep.attention_resources()")
    rows = [line for line in out.splitlines() if line.startswith("decode attention")]
    assert len(rows) == 5 and all(" registers " in row for row in rows), out
