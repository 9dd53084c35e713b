"""Batch-invariant linear and RMSNorms: torch's accuracy, and each row bitwise the same in any batch
(natively on CUDA, through Triton's interpreter on the CPU; conftest turns the interpreter on there)."""

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from invariance import assert_rows_invariant  # noqa: E402

from pocketlab.layers import activations  # noqa: E402
from pocketlab.layers import invariant as inv  # noqa: E402
from pocketlab.layers import norm as torch_norm  # noqa: E402
from pocketlab.layers.attention import write_kv  # noqa: E402
from pocketlab.layers.invariant import elementwise, matmul  # noqa: E402
from pocketlab.layers.invariant.rotate import norm_rotate_store  # noqa: E402
from pocketlab.layers.rotary import Rotary, apply_rotary, norm_and_rotate  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
# (N, K) with K split in slices (one shape per dtype: the tiles differ), and one slice with N and K off the tiles
SPLIT_SHAPE = {torch.float32: (40, 300), torch.bfloat16: (40, 1030)}
PLAIN_SHAPE = (100, 70)


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEV, dtype)


def close(got, want, dtype):
    """float32: a few ulps of the output scale; 16-bit: a couple of rounding steps."""
    tol = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * max(1.0, want.float().abs().max().item()), err


def test_order_fills_the_gpu_and_tiles_k_exactly():
    """The Qwen3-8B decode shapes launch enough programs at few rows to fill an H200, the K slices cover K
    exactly once, and the test shapes below do reach both the split-K and the one-slice paths."""
    shapes_8b = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]
    for N, K in shapes_8b + [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            o = inv.order(N, K, dtype)
            assert o.block_k >= 16 and o.k_per_split % o.block_k == 0
            assert (o.split_k - 1) * o.k_per_split < K <= o.split_k * o.k_per_split
            if (N, K) in shapes_8b and dtype == torch.bfloat16:
                assert -(-N // matmul.DECODE_BLOCK_N) * o.split_k >= 192, (N, K, o)
    for dtype, shape in SPLIT_SHAPE.items():
        assert inv.order(*shape, dtype).split_k > 1 and inv.order(*PLAIN_SHAPE, dtype).split_k == 1


def test_the_launch_follows_the_rows_and_the_order_does_not():
    """Few rows run a program per K slice, many rows all slices in one program; the order is M's business
    nowhere (it takes no M)."""
    cpu = torch.device("cpu")
    assert inv.tiles(matmul.MANY_ROWS - 1, 64, torch.bfloat16, cpu).mode == matmul.LAST_SUMS
    assert inv.tiles(matmul.MANY_ROWS, 64, torch.bfloat16, cpu).mode == matmul.IN_PROGRAM


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("M", [1, 3, 17, 64, 130, 200])
def test_linear_matches_f_linear(dtype, split, M):
    (N, K), bias = SPLIT_SHAPE[dtype] if split else PLAIN_SHAPE, M % 2 == 1
    x, w = randn(M, K, dtype=dtype, seed=M), randn(N, K, dtype=dtype, scale=K**-0.5, seed=N)
    b = randn(N, dtype=dtype, seed=1) if bias else None
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    close(inv.linear(x, w, b), want, dtype)


def test_linear_keeps_leading_dims_and_checks_its_inputs():
    x, w = randn(2, 3, 20), randn(24, 20)
    assert inv.linear(x, w).shape == (2, 3, 24) and inv.linear(x[:0], w).shape == (0, 3, 24)
    close(inv.linear(x.transpose(0, 1), w), F.linear(x.transpose(0, 1), w), torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        inv.linear(x, randn(24, 21))
    with pytest.raises(ValueError, match="share a dtype"):
        inv.linear(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        inv.linear(x, w, randn(23))
    with pytest.raises(ValueError, match="supports"):
        inv.linear(x.double(), w.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split,bias", [(True, False), (True, True), (False, True)])
def test_linear_rows_are_batch_invariant(dtype, split, bias):
    N, K = SPLIT_SHAPE[dtype] if split else PLAIN_SHAPE
    x, w = cancelling(randn(20, K, seed=3), randn(N, K, scale=K**-0.5, seed=1))
    w, b = w.to(dtype), randn(N, dtype=dtype, seed=2) if bias else None
    assert_rows_invariant(lambda x: inv.linear(x, w, b), x.to(dtype))


def cancelling(x, w):
    """x @ w.T with a huge first term that the last one cancels: every partial sum in between rounds at that
    scale, so a change of summation order moves the results by far more than a bf16 ulp (with plain random
    data, a few fp32 ulps would rarely show through the bf16 rounding)."""
    x[:, 0] = x[:, -1] = 2.0**12
    w[:, 0], w[:, -1] = 1.0, -1.0
    return x, w


def test_both_launches_give_each_row_the_same_bits():
    """A row gets the same bits from a program per slice (few rows) as from all slices in one program (many
    rows): the batches below cross MANY_ROWS both ways, with the 130 real rows placed anywhere in them."""
    N, K = SPLIT_SHAPE[torch.float32]
    x, w = randn(130, K, seed=3), randn(N, K, scale=K**-0.5, seed=1)
    b = randn(N, seed=2)
    close(inv.linear(x, w, b), F.linear(x, w, b), torch.float32)
    x, w = cancelling(x, w)
    assert_rows_invariant(lambda x: inv.linear(x, w, b), x)
    for rows in (1, 7, 64, 127):
        assert torch.equal(inv.linear(x[:rows], w, b), inv.linear(x, w, b)[:rows])


def test_gpu_launches_keep_the_bits():
    """On the GPU the tile's M and N extent, warps and stages are free (each element is one chain of MMA
    steps); the launches the sweep tries must all give the default launch's bits."""
    if DEV != "cuda":
        pytest.skip("the GPU's launch choices (the interpreter keeps one tile shape)")
    from pocketlab.layers.invariant import sweep

    for dtype in (torch.bfloat16, torch.float16):
        for N, K in [(6144, 4096), (4096, 12288), (1000, 2000)]:
            x, w = randn(300, K, dtype=dtype), randn(N, K, dtype=dtype, scale=K**-0.5, seed=1)
            o = inv.order(N, K, dtype)
            want = inv.linear(x[:64], w)
            for t in sweep.FEW + sweep.MANY:
                y = matmul.launch(x, w, None, torch.empty(300, N, dtype=dtype, device=DEV), o, t)
                assert torch.equal(y[:64], want), (N, K, dtype, t)


NORM_CASES = [(torch.float32, 100), (torch.bfloat16, 100), (torch.float16, 48), (torch.bfloat16, 4000)]


def norm_inputs(dtype, N, M=6):
    x = randn(M, N, scale=3.0, seed=N)
    x[:, 0] = 2.0**10  # an outlier channel, as real activations have: the sum of squares turns order-sensitive
    x = x.to(dtype)
    gate = randn(M, N, dtype=dtype, scale=2.0, seed=N + 2)
    weight = (1.0 + 0.1 * randn(N, seed=N + 3)).to(dtype)
    return x, gate, weight


@pytest.mark.parametrize("dtype,N", NORM_CASES)
def test_norms_match_layers_norm(dtype, N):
    """Same rounding points as pocketlab.layers.norm: a few ulps apart, in every flavour."""
    x, gate, weight = norm_inputs(dtype, N)
    for offset in (False, True):
        close(inv.rms_norm(x, weight, EPS, offset), torch_norm._rms_norm(x, weight, EPS, offset), dtype)
    close(inv.gated_rms_norm(x, gate, weight, EPS), torch_norm.gated_rms_norm(x, gate, weight, EPS), dtype)


def test_norms_round_where_torch_rounds():
    """bf16 activations with a float32 weight: w * round(x) is float32, as in torch (type promotion); the
    Qwen3.5 (1 + w) flavour and the gated norm come back in x's dtype."""
    x, gate, weight = norm_inputs(torch.bfloat16, 64)
    w32 = weight.float()
    y, y_ref = inv.rms_norm(x, w32, EPS), torch_norm._rms_norm(x, w32, EPS)
    assert y.dtype == y_ref.dtype == torch.float32
    close(y, y_ref, torch.float32)
    assert inv.rms_norm(x, w32, EPS, True).dtype == torch.bfloat16
    assert inv.gated_rms_norm(x, gate, w32, EPS).dtype == torch.bfloat16
    close(inv.gated_rms_norm(x, gate, w32, EPS), torch_norm.gated_rms_norm(x, gate, w32, EPS), torch.bfloat16)


def test_long_rows_loop_over_blocks(monkeypatch):
    """Rows longer than MAX_BLOCK are reduced block by block in one program."""
    monkeypatch.setattr(inv.norm, "MAX_BLOCK", 32)
    x, gate, weight = norm_inputs(torch.float32, 100)
    close(inv.rms_norm(x, weight, EPS), torch_norm._rms_norm(x, weight, EPS), torch.float32)
    assert_rows_invariant(lambda x, g: inv.gated_rms_norm(x, g, weight, EPS), x, gate)


def test_norms_check_their_inputs():
    x, gate, weight = norm_inputs(torch.float32, 16)
    with pytest.raises(ValueError, match="weight"):
        inv.rms_norm(x, weight[:-1], EPS)
    with pytest.raises(ValueError, match="gate"):
        inv.gated_rms_norm(x, gate[:-1], weight, EPS)
    with pytest.raises(ValueError, match="supports"):
        inv.rms_norm(x.double(), weight.double(), EPS)


@pytest.mark.parametrize(
    "dtype,N,M",
    [(torch.float32, 1000, 6), (torch.bfloat16, 4000, 6), (torch.float16, 2000, 6), (torch.float32, 32, 40)],
)
@pytest.mark.parametrize("offset", [False, True])
def test_norm_rows_are_batch_invariant(dtype, N, M, offset):
    """float32 is the sharp check: another order of the sum of squares moves most of a row's outputs by an ulp.
    Through 16-bit rounding that shows in only about one output in 10^4, so there the test mainly checks the
    16-bit loads, casts and garbage rows (long rows give it some chance to see an order change too). Rows of
    32 share programs 32 at a time: 40 rows (and the checker's batches of them) span several programs, so a row
    moves between programs and between places in a program's tile."""
    x, gate, weight = norm_inputs(dtype, N, M)
    assert_rows_invariant(lambda x: inv.rms_norm(x, weight, EPS, offset), x)
    if not offset:
        assert_rows_invariant(lambda x, g: inv.gated_rms_norm(x, g, weight, EPS), x, gate)


class LaunchSpy:
    """Stands in for a Triton kernel: records each launch's grid and tile constants, then runs the kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches.append((grid, meta["ROWS"], meta["BLOCK"]))
            return self.kernel[grid](*args, **meta)

        return launch


@pytest.mark.parametrize("N", [32, 100, 1500])
def test_norm_and_elementwise_tiles_depend_on_the_row_length_only(monkeypatch, N):
    """Rows per program and block width follow from N alone, never from the row count: the same tile, hence
    the same layout and reduction order on a GPU, for a decode step of one row and a prefill of hundreds.
    Short rows share a program; only the grid grows with the rows."""
    spies = {}
    for module, name in [(inv.norm, "_rms_norm_rows"), (elementwise, "_swiglu"), (elementwise, "_sigmoid_gate")]:
        spies[name] = LaunchSpy(getattr(module, name))
        monkeypatch.setattr(module, name, spies[name])
    weight, row_counts = torch.ones(N, device=DEV), (1, 5, 24)
    for M in row_counts:
        x = randn(M, 2 * N, seed=M)
        inv.rms_norm(x[:, :N], weight, EPS)
        inv.swiglu(x)
        inv.sigmoid_gate(x[:, :N], x[:, N:])
    for name, spy in spies.items():
        tiles = {(rows, block) for _, rows, block in spy.launches}
        assert len(tiles) == 1, (name, tiles)
        ((rows, block),) = tiles
        assert [grid[0] for grid, _, _ in spy.launches] == [-(-M // rows) for M in row_counts]
        assert block >= min(N, 1024) and (rows > 1) == (N <= 100), (name, rows, block)


def elementwise_inputs(dtype, M, N, seed=0):
    """[M, 2N] activations with some large values (softplus's linear branch, saturated sigmoids)."""
    x = randn(M, 2 * N, scale=4.0, seed=seed)
    x[:, ::7] *= 8.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N", [(40, 48), (3, 1500), (300, 4)])
def test_elementwise_match_torch_and_rows_are_batch_invariant(dtype, M, N):
    """swiglu, sigmoid_gate and decay_and_beta against the torch steps they replace (a rounding step or two
    apart: torch's CPU sigmoid differs in the last bit between its SIMD lanes and scalar tail), on strided
    inputs, with short rows packed many to a program (N = 48, 4) and long ones split over column blocks
    (N = 1500), sigmoid_gate's gate also as one column (the MoE shared expert's); then every row bitwise the same
    in any batch."""
    x = elementwise_inputs(dtype, M, N)
    gate_up, left, right = x, x[:, :N], x[:, N:]  # left and right: strided views
    neg_A, dt_bias = -torch.rand(N, device=DEV) * 4, randn(N, seed=9)
    close(inv.swiglu(gate_up), activations.swiglu(gate_up.float()), dtype)
    close(inv.sigmoid_gate(left, right), activations.sigmoid_gate(left.float(), right.float()), dtype)
    close(inv.sigmoid_gate(left, right[:, :1]), activations.sigmoid_gate(left.float(), right[:, :1].float()), dtype)
    (g, beta), (g_ref, beta_ref) = (
        f(left, right, neg_A, dt_bias) for f in (inv.decay_and_beta, activations.decay_and_beta)
    )
    assert g.dtype == torch.float32 and beta.dtype == dtype
    close(g, g_ref, torch.float32)
    close(beta, beta_ref, dtype)
    assert_rows_invariant(inv.swiglu, gate_up)
    assert_rows_invariant(lambda x: inv.sigmoid_gate(x[:, :N], x[:, N:]), x)
    assert_rows_invariant(lambda x: inv.decay_and_beta(x[:, :N], x[:, N:], neg_A, dt_bias), x)


@pytest.mark.parametrize("B,T", [(3, 1), (1, 1), (2, 5)])
def test_per_head_gates_are_read_where_the_projection_left_them(B, T):
    """Qwen3.5's attention gate ([q_h | gate_h] per head) and the Gated DeltaNet's z are per-head slices of a wider
    projection row: as [rows, n] they would be copied (a kernel of its own in every step), as [tokens, heads, n]
    they are a view, and the gated kernels read them there, to the bit what they give on a contiguous copy."""
    H, n, extra = 4, 16, 24
    proj = randn(B, T, H * 2 * n + extra, seed=B + T).to(torch.bfloat16)  # [q_h | gate_h] per head, then k, v
    _, gate = proj[..., : H * 2 * n].view(B, T, H, 2 * n).chunk(2, dim=-1)
    z = proj[..., extra : extra + H * n].reshape(B, T, H, n)  # a slice of the row: z of the Gated DeltaNet
    x = randn(B, T, H, n, seed=7).to(torch.bfloat16)
    weight = (1.0 + 0.1 * randn(n, seed=8)).to(torch.bfloat16)
    for g in (gate, z):
        rows, inner = elementwise.head_rows(g)
        assert inner == H and rows.data_ptr() == g.data_ptr()  # a view, no copy
        assert torch.equal(inv.sigmoid_gate(x, g), inv.sigmoid_gate(x, g.contiguous()))
        assert torch.equal(inv.gated_rms_norm(x, g, weight, EPS), inv.gated_rms_norm(x, g.contiguous(), weight, EPS))
    close(inv.sigmoid_gate(x, gate), activations.sigmoid_gate(x.float(), gate.float()), torch.bfloat16)
    close(inv.gated_rms_norm(x, z, weight, EPS), torch_norm.gated_rms_norm(x, z, weight, EPS), torch.bfloat16)


def test_the_checker_catches_batch_variant_functions():
    """The checker must fail a matmul that splits K by the batch size, as cuBLAS does for few rows, and a
    norm whose sum of squares runs in an order picked by the row count; and pass them when each row is computed
    alone (the same call whatever the batch)."""

    def one_row_at_a_time(fn, x):
        return torch.cat([fn(row[None]) for row in x])

    x, w = randn(9, 256, seed=4), randn(24, 256, seed=5)

    def split_k_linear(x, splits):
        return sum(xs @ ws.T for xs, ws in zip(x.chunk(splits, -1), w.chunk(splits, -1), strict=True))

    with pytest.raises(AssertionError, match="differs from the full batch"):
        assert_rows_invariant(lambda x: split_k_linear(x, 4 if len(x) < 8 else 1), x)
    assert_rows_invariant(lambda x: one_row_at_a_time(lambda x: split_k_linear(x, 4), x), x)

    def norm(x, sequential):
        squares = x.pow(2)
        total = squares.cumsum(-1)[:, -1] if sequential else squares.sum(-1)
        return x * torch.rsqrt(total / x.shape[-1] + EPS)[:, None]

    with pytest.raises(AssertionError, match="differs from the full batch"):
        assert_rows_invariant(lambda x: norm(x, sequential=len(x) % 2 == 1), x)
    assert_rows_invariant(lambda x: one_row_at_a_time(lambda x: norm(x, sequential=False), x), x)


def test_bench_lists_the_tiles(capsys):
    """The H200 benchmark's CPU side: the tile table (and, without CUDA, nothing else)."""
    from pocketlab.layers.invariant import bench

    table = bench.config_table(torch.bfloat16)
    assert len(table) == 1 + len(bench.QWEN3_8B) and table[3].split()[:3] == ["gate_up", "24576", "4096"]
    if not torch.cuda.is_available():
        bench.main(["--rows", "1"])
        assert "timings skipped" in capsys.readouterr().out


ROTATE_CASES = {  # (heads, kv heads, head_dim, rotary dims, q/k norm, (1 + w) norm, q heads interleaved with a gate)
    "qwen3": (4, 2, 32, 32, True, False, False),
    "qwen3.5": (4, 1, 32, 8, True, True, True),
    "qwen2": (2, 2, 16, 16, False, False, False),
}


def rotate_inputs(case, dtype, B=3, T=5, seed=0):
    H, KV, D, rot, norm, offset, gated = ROTATE_CASES[case]
    qkv = randn(B, T, H * D * (2 if gated else 1) + 2 * KV * D, dtype=dtype, scale=2.0, seed=seed)
    q, k, v = qkv.split([H * D * (2 if gated else 1), KV * D, KV * D], dim=-1)
    q = q.view(B, T, H, 2 * D)[..., :D] if gated else q.view(B, T, H, D)  # strided heads, as the gated layer has
    k, v = k.view(B, T, KV, D), v.view(B, T, KV, D)
    positions = torch.arange(B * T, device=DEV).view(B, T) % 7 + 3
    cos, sin = Rotary(rot, 1e4, 16, DEV, dtype).table(positions)
    norms = (1 + 0.1 * randn(D, dtype=dtype, seed=1), 1 + 0.1 * randn(D, dtype=dtype, seed=2), EPS, offset)
    return q, k, v, positions, (cos, sin), norms if norm else None


@pytest.mark.parametrize("case", list(ROTATE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rotate_store_matches_the_torch_path(case, dtype):
    """The fused q/k norm + RoPE + K/V write gives torch's q (norm_and_rotate) and fills the cache where write_kv
    does, to a rounding step; the rest of the cache is untouched."""
    q, k, v, positions, rope, norms = rotate_inputs(case, dtype)
    B, T, KV, D = k.shape
    slots = torch.tensor([2, 0, 1], device=DEV)[:, None].expand(B, T)
    caches = [torch.full((3, KV, 16, D), 7.0, dtype=dtype, device=DEV) for _ in range(4)]
    got_q = norm_rotate_store(q, k, v, caches[0], caches[1], (slots, positions), rope, norms)
    if norms is None:
        want_q, want_k = apply_rotary(q, *rope), apply_rotary(k, *rope)
    else:
        want_q, want_k = norm_and_rotate(q, k, norms[0], norms[1], *rope, norms[2], norms[3])
    write_kv(caches[2], caches[3], want_k, v, (slots, positions))
    close(got_q, want_q, dtype)
    close(caches[0], caches[2], dtype)
    assert torch.equal(caches[1], caches[3])  # v is copied, not computed


def test_norm_rotate_store_rows_are_batch_invariant():
    """A token's q comes out bitwise the same whatever tokens share the launch."""

    q, k, v, positions, (cos, sin), norms = rotate_inputs("qwen3", torch.float32, B=12, T=1)
    q[:, :, :, 0] = 2.0**10  # an outlier channel: the sum of squares turns order-sensitive
    caches = [torch.zeros(1, k.shape[2], 16, k.shape[3], device=DEV) for _ in range(2)]

    def fn(q, k, v, cos, sin):
        zeros = torch.zeros(len(q), 1, dtype=torch.long, device=DEV)  # every token writes slot 0, position 0
        targets = (zeros, zeros)
        return norm_rotate_store(q, k, v, *caches, targets, (cos, sin), norms)

    assert_rows_invariant(fn, q.contiguous(), k.contiguous(), v.contiguous(), cos, sin)
