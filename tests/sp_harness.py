"""The harness of the P-rank sequence-parallel tests (test_sp_gla.py, test_sp_simple_gla.py,
test_sp_delta.py): every rank runs an SP operator on its slice of one global sequence, forward and
backward; the slices are put back together along the sequence and compared with a reference computed
on the whole sequence (single device, float64 oracle). What differs between the attention variants
(their inputs, the operator, the reference, the tolerances) stays in the test files."""
from __future__ import annotations

from typing import Callable, Hashable, Sequence

import pytest
import torch

from lingua_zeco.comm import AllScanArgs
from lingua_zeco.sp import SPContext
from local_ranks import run_on_ranks

BROKEN_MIN_ERR = 1e-2  # a variant broken on purpose must miss the reference by at least this much


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest entry of the reference b."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def rank_slice(tensors: Sequence[torch.Tensor], rank: int, t_local: int) -> list[torch.Tensor]:
    """Rank `rank`'s tokens of [B, T, ...] tensors: the contiguous slice rank * t_local ... + t_local."""
    return [t[:, rank * t_local:(rank + 1) * t_local] for t in tensors]


def fwd_bwd(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], do: torch.Tensor) -> list[torch.Tensor]:
    """[o, d inputs...] of o = fn(*inputs) on fresh leaf copies of the inputs, backward of sum(o * do)."""
    ins = [t.detach().clone().requires_grad_() for t in inputs]
    o = fn(*ins)
    (o * do).sum().backward()
    return [o.detach()] + [t.grad for t in ins]


def rank_results(rank: int, t_local: int, variants: Sequence[Hashable],
                 global_inputs: Callable[[Hashable], Sequence[torch.Tensor]],
                 run: Callable[..., torch.Tensor]) -> dict:
    """{variant: [o, d inputs...]} on this rank: for every variant, global_inputs(variant) (the operator's
    inputs, then the output gradient `do`) is cut to this rank's slice and run(variant, *slice) is
    differentiated. Called inside the worker that run_on_ranks starts."""
    out = {}
    for variant in variants:
        *ins, do = rank_slice(global_inputs(variant), rank, t_local)
        out[variant] = fwd_bwd(lambda *x, v=variant: run(v, *x), ins, do)
    return out


def on_ranks(worker: Callable, P: int, *args, timeout_s: float = 240.0) -> list:
    """worker(rank, P, *args) on P gloo ranks; P = 1 runs here, without a process group."""
    return run_on_ranks(worker, P, *args, timeout_s=timeout_s) if P > 1 else [worker(0, 1, *args)]


def gather(per_rank: list[dict], key: Hashable) -> list[torch.Tensor]:
    """Every rank's results for `key`, concatenated along the sequence (dim 1) in rank order."""
    return [torch.cat([r[key][i] for r in per_rank], dim=1) for i in range(len(per_rank[0][key]))]


def rel_errors(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], names: Sequence[str],
               suffix: str = "") -> dict[str, float]:
    assert len(got) == len(want) == len(names), (len(got), len(want), names)
    return {f"{n}{suffix}": max_rel(a, b) for n, a, b in zip(names, got, want)}


def expect_close(errs: dict[str, float], tol: float, what: str) -> None:
    bad = {n: e for n, e in errs.items() if e > tol}
    assert not bad, f"{what} differs from the reference beyond {tol:g}: {bad}"


def expect_caught(errs: dict[str, float], names: Sequence[str], what: str) -> None:
    """A variant broken on purpose (S_in dropped, ...) must fail the same comparison, in every one of `names`."""
    assert all(errs[n] > BROKEN_MIN_ERR for n in names), f"{what} went unnoticed: {errs}"


def expect_equal(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], names: Sequence[str], what: str) -> None:
    for n, a, b in zip(names, got, want, strict=True):
        assert torch.equal(a, b), f"{what}: {n} differs"


def expect_all_close(per_rank: list[dict], variants: Sequence[Hashable], want: Callable[[Hashable], list],
                     names: Sequence[str], tol: float, what: str, dtype: torch.dtype | None = None) -> None:
    """Every variant's gathered results against want(variant) (all within tol; the output of `dtype`)."""
    for variant in variants:
        got = gather(per_rank, variant)
        assert dtype is None or got[0].dtype == dtype, f"{variant}: output {got[0].dtype}, not {dtype}"
        expect_close(rel_errors(got, want(variant), names), tol, f"{what} {variant}")


def expect_pairs_equal(per_rank: list[dict], names: Sequence[str], oracle_o: torch.Tensor, tol: float,
                       what: str) -> None:
    """Results keyed (*variant, 1) and (*variant, 0) (the same input two ways, e.g. with and without empty
    documents) must be bit-identical, and the first output within tol of oracle_o."""
    for base in dict.fromkeys(key[:-1] for key in per_rank[0]):
        first, second = (gather(per_rank, (*base, flag)) for flag in (1, 0))
        expect_equal(first, second, names, f"{base} {what}")
        assert max_rel(first[0], oracle_o) < tol, f"{base} {what}: differs from the oracle"


def gla_inputs(P: int, t_local: int, B: int, H: int, K: int, V: int, seed: int, gate_per_key: bool = True):
    """q, k [B, T, H, K], v [B, T, H, V], log forget gate (slow decay: states reach far across ranks)
    [B, T, H, K] (GLA) or [B, T, H] (simple GLA, one decay per head and token), do [B, T, H, V]; T = P * t_local."""
    gen = torch.Generator().manual_seed(seed)
    T = P * t_local
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, *((K,) if gate_per_key else ()), generator=gen) + 2)
    do = torch.randn(B, T, H, V, generator=gen)
    return q, k, v, g, do


def expect_matches_reference(per_rank: list[dict], variants: Sequence[tuple], refs: dict, names: Sequence[str],
                             tol: float, what: str, broken: Callable[[tuple], bool] = lambda variant: False,
                             caught: Sequence[str] = ("o", "dg")) -> None:
    """Variants (method, algo, varlen): the gathered results against refs[varlen] = (reference results,
    float64 oracle results: all of them or only o, compared as `<name>_vs_fp64`), all within tol; a
    variant broken on purpose (`broken(variant)`) must instead miss the reference in every one of `caught`."""
    for variant in variants:
        got = gather(per_rank, variant)
        ref, oracle = refs[variant[2]]
        oracle = oracle if isinstance(oracle, (list, tuple)) else [oracle]
        errs = {**rel_errors(got, ref, names), **rel_errors(got[:len(oracle)], oracle, names[:len(oracle)], "_vs_fp64")}
        if broken(variant):
            expect_caught(errs, caught, f"{what}: the broken variant {variant}")
        else:
            expect_close(errs, tol, f"{what}: {variant}")


def docs_for(P: int, t_local: int) -> torch.Tensor:
    """Boundaries that cross ranks, fall inside one, and one exactly at a rank's first token."""
    T = P * t_local
    cuts = {0, T, 5, t_local + 3, 2 * t_local, T - 2}
    return torch.tensor(sorted(c for c in cuts if 0 <= c <= T))


def docs_with_empty(P: int, t_local: int, inside: int, after: int, before_end: int) -> torch.Tensor:
    """Zero-length documents at the start, `inside` rank 0, at rank 1's first token and at the end; the
    others end `after` tokens into rank 1 and `before_end` tokens before the end."""
    T = P * t_local
    return torch.tensor(sorted([0, 0, inside, inside, t_local, t_local, min(t_local + after, T), T - before_end, T, T]))


def autocast_worker(rank, P, op, inputs: dict, docs, variants, t_local: int) -> dict:
    """Variants (method, scan algorithm, varlen) of the SP operator `op` under CPU bf16 autocast; the
    backward runs outside it (fwd_bwd), as the trainer does. inputs[varlen]: the global inputs, then do."""
    def run(variant, *ins):
        method, algo, varlen = variant
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return op(*ins, sp=SPContext(method=method, scan=AllScanArgs(algorithm=algo, n_blocks=2, node_size=1)),
                      cu_seqlens=docs if varlen else None)
    return rank_results(rank, t_local, variants, lambda variant: inputs[variant[2]], run)


def empty_docs_worker(rank, P, op, inputs, docs, methods, t_local: int) -> dict:
    """Each (method, scan algorithm) of `op` (method none on one rank) on `docs` with its zero-length
    documents (key flag 1) and without them (0): what expect_pairs_equal compares."""
    variants = [(m, a, empty) for m, a in (methods if P > 1 else [("none", "chain")]) for empty in (1, 0)]

    def run(variant, *ins):
        method, algo, empty = variant
        return op(*ins, sp=SPContext(method=method, scan=AllScanArgs(algorithm=algo, n_blocks=2)),
                  cu_seqlens=docs if empty else docs.unique())
    return rank_results(rank, t_local, variants, lambda _: inputs, run)


def grads_or_skip(fn):
    """fn() -> gradients. fla 0.6.0 refuses its gated backward on Hopper with Triton 3.4 ≤ v < 3.7.1
    (fla bug report #640; simple GLA and Gated DeltaNet, the GPU image has 3.6): call it once the forward
    checks have passed, so that on such a stack the test skips the gradient part with that reason."""
    try:
        return list(fn())
    except RuntimeError as e:
        if "#640" in str(e):
            pytest.skip(f"forward checked; fla's gated backward unavailable here: {str(e)[:120]}")
        raise
