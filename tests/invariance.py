"""assert_rows_invariant: a row-wise function must give each row bitwise the same result in any batch.

Shared by the kernel tests and the engine's batch-invariance tests: run the function on the whole batch, then
on batches built from it (one row, a prime count, reversed, shuffled, doubled, padded with garbage rows) and
compare every real row with torch.equal.
"""

import torch


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def row_batches(M: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """(name, index) pairs: each index lists the source row of every batch row, -1 for a garbage row."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.arange(M)
    prime = next(p for p in (13, 7, 5, 3, 2, 1) if p <= M)
    some = rows[torch.randperm(M, generator=gen)[: min(M, 5)]]
    bucket = 16 if len(some) <= 8 else 64
    padded = torch.full((bucket,), -1)
    padded[torch.randperm(bucket, generator=gen)[: len(some)]] = some
    batches = [(f"row {r} alone", torch.tensor([r])) for r in sorted({0, M // 2, M - 1})]
    batches += [
        (f"{prime} rows from row 1", (torch.arange(prime) + 1) % M),
        ("reversed", rows.flip(0)),
        ("shuffled", rows[torch.randperm(M, generator=gen)]),
        ("every row twice", torch.cat([rows, rows])),
        ("garbage rows first", torch.cat([torch.full((3,), -1), rows])),
        (f"{len(some)} rows scattered in a bucket of {bucket}", padded),
    ]
    return batches


def _gather(t: torch.Tensor, index: torch.Tensor, gen: torch.Generator, garbage_scale: float) -> torch.Tensor:
    """t's rows at index; garbage rows (index -1) hold random values of another scale."""
    out = t[index.clamp(min=0).to(t.device)].clone()
    garbage = (index < 0).to(t.device)
    noise = torch.randn(out.shape, generator=gen) * garbage_scale
    out[garbage] = noise.to(t.device, t.dtype)[garbage]
    return out


def assert_rows_invariant(fn, *inputs: torch.Tensor, garbage_scale: float = 100.0, seed: int = 0):
    """fn(*inputs), inputs row-aligned along dim 0, returns a tensor or a tuple of tensors with those rows.
    Raises AssertionError naming the batch and the rows whose result differs by even one bit."""
    M = inputs[0].shape[0]
    if any(t.shape[0] != M for t in inputs):
        raise ValueError("assert_rows_invariant: the inputs must share their row count (dim 0)")
    full = _as_tuple(fn(*inputs))
    gen = torch.Generator().manual_seed(seed)
    for name, index in row_batches(M, seed):
        outs = _as_tuple(fn(*(_gather(t, index, gen, garbage_scale) for t in inputs)))
        real = (index >= 0).nonzero().squeeze(1)
        for k, (want_all, got_all) in enumerate(zip(full, outs, strict=True)):
            want, got = want_all[index[real].to(want_all.device)], got_all[real.to(got_all.device)]
            if not torch.equal(want, got):
                diff = (want.float() - got.float()).abs().reshape(len(real), -1).amax(1)
                bad = index[real][(diff != 0).cpu()].tolist()
                raise AssertionError(
                    f"{name}: output {k} differs from the full batch's in rows {bad[:8]} "
                    f"(max |diff| {diff.max().item():.3g})"
                )
