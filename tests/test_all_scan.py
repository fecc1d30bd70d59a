"""All-Scan against a local float64 reference, for many group sizes, both directions, both algorithms."""
import pytest
import torch
import torch.distributed as dist

from lingua_zeco.comm import AllScanArgs, all_scan, chain_time, choose_algorithm, gather_scan, tree_time
from local_ranks import run_on_ranks

SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]
CASES = [("chain", 1), ("chain", 3), ("chain", 8), ("tree", 1)]


def reference(xs, as_, p, reverse, matrix=False):
    """float64 exclusive scan: y ← a_r ⊙ y + x_r (decays [..., K]) or A_r @ y + x_r (matrix=True)."""
    order = range(len(xs)) if not reverse else range(len(xs) - 1, -1, -1)
    acc = torch.zeros_like(xs[0], dtype=torch.float64)
    for r in order:
        if r == p:
            return acc
        a = as_[r].double()
        acc = (a @ acc if matrix else a[..., None] * acc) + xs[r].double()


def contributions(world, shape=(2, 3, 5, 4), seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, generator=gen) for _ in range(world)]
    as_ = [torch.rand(shape[:-1], generator=gen) for _ in range(world)]
    return xs, as_


def _scan_worker(rank, world, sizes, cases):
    """Every subgroup [world - n, world) for each n; ranks outside a subgroup only join its creation."""
    xs, as_ = contributions(world)
    errors = {}
    for n in sizes:
        members = list(range(world - n, world))
        group = dist.new_group(members)
        if rank not in members:
            continue
        p = members.index(rank)
        sub_x, sub_a = xs[world - n:], as_[world - n:]
        for algo, nb in cases:
            for reverse in (False, True):
                y = all_scan(sub_x[p], sub_a[p], group=group, reverse=reverse, algorithm=algo, n_blocks=nb)
                err = (y.double() - reference(sub_x, sub_a, p, reverse)).abs().max().item()
                errors[(n, algo, nb, reverse)] = err
        for reverse in (False, True):
            y = gather_scan(sub_x[p], sub_a[p], group=group, reverse=reverse)
            errors[(n, "gather", 0, reverse)] = (y.double() - reference(sub_x, sub_a, p, reverse)).abs().max().item()
        work = all_scan(sub_x[p], sub_a[p], group=group, async_op=True)
        errors[(n, "async", 4, False)] = (work.wait().double() - reference(sub_x, sub_a, p, False)).abs().max().item()
    return errors


@pytest.mark.slow
def test_all_scan_matches_reference_for_all_group_sizes():
    results = run_on_ranks(_scan_worker, max(SIZES), SIZES, CASES, timeout_s=300)
    checked = 0
    for errs in results:
        for key, err in errs.items():
            assert err < 1e-5, f"all_scan wrong for (P, algorithm, n_blocks, reverse) = {key}: max error {err}"
            checked += 1
    assert checked == sum(n * (2 * len(CASES) + 3) for n in SIZES)


def _broken_worker(rank, world):
    xs, as_ = contributions(world)
    y = all_scan(xs[rank], torch.ones_like(as_[rank]), algorithm="chain")  # wrong decays on purpose
    return (y.double() - reference(xs, as_, rank, False)).abs().max().item()


def test_reference_catches_a_wrong_decay():
    errs = run_on_ranks(_broken_worker, 3)
    assert errs[0] == errs[1] == 0.0 and errs[2] > 1e-2  # rank 1 sees x_0 only: no decay involved


def test_bad_shapes_are_refused_before_any_communication():
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., K, V\]"):
        all_scan(torch.zeros(2, 3, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="algorithm"):
        all_scan(torch.zeros(2, 3, 4), torch.zeros(2, 3), algorithm="ring")


def test_auto_prefers_tree_when_latency_dominates_and_chain_for_few_ranks():
    mib = 1 << 20
    args = AllScanArgs(algorithm="auto", n_blocks=0, alpha_s=30e-6, beta_Bps=150e9, tree_round_extra_s=0.0)
    assert choose_algorithm(256, mib, args) == "tree"
    assert choose_algorithm(2, mib, args) == "chain"
    assert chain_time(256, mib, 4, 30e-6, 150e9) > 10 * tree_time(256, mib, 30e-6, 150e9)


def _hier_worker(rank, world, node_sizes):
    xs, as_ = contributions(world, seed=3)
    errors = {}
    for G in node_sizes:
        for reverse in (False, True):
            args = AllScanArgs(algorithm="hier", node_size=G, n_blocks=2)
            y = all_scan(xs[rank], as_[rank], reverse=reverse, args=args)
            errors[(G, reverse)] = (y.double() - reference(xs, as_, rank, reverse)).abs().max().item()
    return errors


@pytest.mark.slow
def test_hierarchical_scan_matches_reference():
    node_sizes = [1, 2, 3, 4, 6, 12]
    results = run_on_ranks(_hier_worker, 12, node_sizes, timeout_s=300)
    for rank, errs in enumerate(results):
        assert len(errs) == 2 * len(node_sizes)
        for key, err in errs.items():
            assert err < 1e-5, f"hierarchical all_scan wrong for (node_size, reverse) = {key} on rank {rank}: {err}"


def test_hierarchical_refuses_a_node_size_that_does_not_divide():
    results = run_on_ranks(_hier_bad_worker, 3)
    assert all("node_size=2 must divide the group size 3" in r for r in results)


def _hier_bad_worker(rank, world):
    try:
        all_scan(torch.zeros(2, 3), torch.zeros(2), args=AllScanArgs(algorithm="hier", node_size=2))
    except ValueError as e:
        return str(e)
    return "no error"


def test_auto_across_nodes_uses_inter_node_costs():
    from lingua_zeco.comm.all_scan import estimate
    args = AllScanArgs(algorithm="auto", node_size=8, alpha_s=45e-6, beta_Bps=300e9,
                       alpha_inter_s=60e-6, beta_inter_Bps=50e9, tree_round_extra_s=0.0)
    est = estimate(256, 1 << 20, args)
    assert set(est) == {"chain", "tree", "hier"}
    assert est["tree"] < est["hier"] < est["chain"]  # pure alpha-beta: the tree has the fewest hops
    assert choose_algorithm(256, 1 << 20, args) == "tree"
    # with the measured software cost of a tree round, chaining inside the node saves rounds
    measured = AllScanArgs(algorithm="auto", node_size=8)
    assert choose_algorithm(256, 1 << 20, measured) == "hier"
    assert choose_algorithm(8, 1 << 20, measured) == "chain" == choose_algorithm(2, 1 << 20, measured)
    # the chain pays the inter-node hop once per node boundary: 31 of them at P = 256
    flat = estimate(256, 1 << 20, AllScanArgs(node_size=256))
    assert est["chain"] > flat["chain"]


def _sp_groups_worker(rank, world, sp, node_size):
    """Several SP groups x DP, as the trainer builds them: every algorithm on every SP group at once."""
    from lingua_zeco.distributed import DistributedArgs, setup

    scan = AllScanArgs(algorithm="hier", node_size=node_size, n_blocks=2)
    env = setup(DistributedArgs(sp_size=sp, all_scan=scan))
    members = dist.get_process_group_ranks(env.sp_group)
    xs, as_ = contributions(world, seed=5)  # indexed by global rank: each SP group scans its own data
    sub_x, sub_a = [xs[r] for r in members], [as_[r] for r in members]
    p = env.sp_rank
    errors = {}
    for algo in ("chain", "tree", "hier", "auto"):
        for reverse in (False, True):
            args = AllScanArgs(algorithm=algo, node_size=node_size, n_blocks=2)
            y = all_scan(xs[rank], as_[rank], env.sp_group, reverse=reverse, args=args)
            errors[(algo, reverse)] = (y.double() - reference(sub_x, sub_a, p, reverse)).abs().max().item()
    for reverse in (False, True):
        y = gather_scan(xs[rank], as_[rank], env.sp_group, reverse=reverse)
        errors[("gather", reverse)] = (y.double() - reference(sub_x, sub_a, p, reverse)).abs().max().item()
        for algo in ("chain", "tree"):  # transport=auto: here (CPU) it must fall back to point-to-point
            args = AllScanArgs(algorithm=algo, transport="auto", node_size=node_size, n_blocks=2)
            y = all_scan(xs[rank], as_[rank], env.sp_group, reverse=reverse, args=args)
            errors[(f"{algo}_auto", reverse)] = (y.double() - reference(sub_x, sub_a, p, reverse)).abs().max().item()
    return errors


@pytest.mark.parametrize("world,sp,node_size", [(4, 2, 1), pytest.param(8, 4, 2, marks=pytest.mark.slow)])
def test_every_algorithm_on_several_sp_groups(world, sp, node_size):
    """hier once made its sub-groups lazily inside one SP group; new_group is collective over the
    world, so SP groups that built different sub-groups mixed up their gloo connections."""
    results = run_on_ranks(_sp_groups_worker, world, sp, node_size, timeout_s=180)
    for rank, errs in enumerate(results):
        assert len(errs) == 14
        bad = {k: e for k, e in errs.items() if e > 1e-5}
        assert not bad, f"rank {rank} of {world} (SP groups of {sp}, node_size={node_size}): {bad}"


def _library_groups_worker(rank, world):
    """A library user's own SP groups [0, 1] and [2, 3]: hier refuses sub-groups not made up front
    (instead of cross-wiring), and is exact once init_node_groups has made them on every rank."""
    from lingua_zeco.comm import init_node_groups

    lists = [[0, 1], [2, 3]]
    groups = [dist.new_group(r) for r in lists]
    members = lists[rank // 2]
    args = AllScanArgs(algorithm="hier", node_size=1)
    xs, as_ = contributions(world, seed=7)
    try:
        all_scan(xs[rank], as_[rank], groups[rank // 2], args=args)
        refusal = "no error"
    except RuntimeError as e:
        refusal = str(e)
    init_node_groups(lists, 1)
    y = all_scan(xs[rank], as_[rank], groups[rank // 2], args=args)
    ref = reference([xs[r] for r in members], [as_[r] for r in members], members.index(rank), False)
    return refusal, (y.double() - ref).abs().max().item()


def test_hier_sub_groups_must_be_made_up_front():
    for refusal, err in run_on_ranks(_library_groups_worker, 4):
        assert "init_node_groups" in refusal and err < 1e-5, (refusal, err)


def _scratch_worker(rank, world):
    """The scans stage, send and fold in persistent scratch buffers. Repeated calls make no new
    buffers, no result is a scratch buffer, and a result kept from an earlier call (as autograd keeps
    them) is not overwritten by later calls; decay and matrix transitions, every algorithm."""
    from lingua_zeco.comm import MATRIX, pair_scan
    from lingua_zeco.comm.buffers import buffer_count, buffer_ptrs

    xs, as_ = contributions(world, seed=3)
    gen = torch.Generator().manual_seed(4)
    As = [0.5 * torch.randn(2, 3, 5, 5, generator=gen) for _ in range(world)]
    calls = [(f"{algo}{nb}-{rev}", lambda algo=algo, nb=nb, rev=rev: all_scan(
                 xs[rank], as_[rank], reverse=rev, algorithm=algo, n_blocks=nb), False, rev)
             for algo, nb in (("chain", 1), ("chain", 3), ("tree", 1)) for rev in (False, True)]
    calls += [(f"gather-{rev}", lambda rev=rev: gather_scan(xs[rank], as_[rank], reverse=rev), False, rev)
              for rev in (False, True)]
    calls += [(f"matrix-{algo}{nb}-{rev}", lambda algo=algo, nb=nb, rev=rev: pair_scan(
                  xs[rank], As[rank], reverse=rev, args=AllScanArgs(algorithm=algo, n_blocks=nb)), True, rev)
              for algo, nb in (("chain", 1), ("chain", 3), ("tree", 1)) for rev in (False, True)]
    calls += [(f"matrix-gather-{rev}", lambda rev=rev: gather_scan(xs[rank], As[rank], reverse=rev,
                                                                   transition=MATRIX), True, rev)
              for rev in (False, True)]
    first = {name: fn() for name, fn, _, _ in calls}
    kept = {name: y.clone() for name, y in first.items()}
    n_buffers = buffer_count()
    out = {"new_buffers": 0, "aliased": [], "overwritten": [], "errors": {}}
    for _ in range(2):
        for name, fn, matrix, rev in calls:
            y = fn()
            ref = reference(xs, As, rank, rev, matrix=True) if matrix else reference(xs, as_, rank, rev)
            out["errors"][name] = max(out["errors"].get(name, 0.0), (y.double() - ref).abs().max().item())
            if y.data_ptr() in buffer_ptrs() or first[name].data_ptr() in buffer_ptrs():
                out["aliased"].append(name)
    out["new_buffers"] = buffer_count() - n_buffers
    out["overwritten"] = [n for n in first if not torch.equal(first[n], kept[n])]
    return out


def test_scratch_buffers_are_reused_and_never_returned():
    for rank, res in enumerate(run_on_ranks(_scratch_worker, 3, timeout_s=120)):
        assert res["new_buffers"] == 0, f"rank {rank}: repeated scans allocated {res['new_buffers']} new buffers"
        assert not res["aliased"], f"rank {rank}: results that are scratch buffers: {res['aliased']}"
        assert not res["overwritten"], f"rank {rank}: kept results changed by later scans: {res['overwritten']}"
        bad = {k: e for k, e in res["errors"].items() if e > 1e-5}
        assert not bad, f"rank {rank}: wrong scans {bad}"


def _transport_worker(rank, world):
    """CPU: transport=auto and nccl carry the scan over gloo; symm is refused with the reason."""
    xs, as_ = contributions(world, seed=11)
    out = {}
    for tp in ("nccl", "auto"):
        for algo in ("chain", "tree"):
            y = all_scan(xs[rank], as_[rank], args=AllScanArgs(algorithm=algo, transport=tp, node_size=world))
            out[(tp, algo)] = (y.double() - reference(xs, as_, rank, False)).abs().max().item()
    try:
        all_scan(xs[rank], as_[rank], args=AllScanArgs(transport="symm"))
        out["symm"] = "no error"
    except ValueError as e:
        out["symm"] = str(e)
    return out


def test_transports_on_cpu():
    for r in run_on_ranks(_transport_worker, 3):
        assert "needs CUDA tensors" in r.pop("symm") and len(r) == 4
        assert all(e < 1e-5 for e in r.values()), r
    with pytest.raises(ValueError, match="all_scan.transport='ib'; choose one of nccl, symm, auto"):
        all_scan(torch.zeros(2, 3), torch.zeros(2), args=AllScanArgs(transport="ib"))


def test_in_one_node_needs_to_know_the_node():
    results = run_on_ranks(_one_node_worker, 4)
    assert results[0] == [False, True, False, True], results[0]


def _one_node_worker(rank, world):
    import os
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    from lingua_zeco.comm import in_one_node
    low, high = dist.new_group([0, 1]), dist.new_group([1, 2])
    return [in_one_node(dist.group.WORLD, AllScanArgs()),           # node size unknown: not assumed
            in_one_node(dist.group.WORLD, AllScanArgs(node_size=4)),
            in_one_node(high, AllScanArgs(node_size=2)),            # ranks 1 and 2 straddle nodes [0,1] [2,3]
            in_one_node(low, AllScanArgs(node_size=2))]


def test_auto_takes_symm_in_one_node_only_and_symm_by_name_does_not_warn(monkeypatch):
    """Where symmetric memory can run (CUDA tensors), auto tries symm first, with nccl behind it, on a group known
    to sit in one node, and nccl alone across nodes or where symm cannot run; symm by name is one link, silently."""
    import importlib
    import warnings

    mod = importlib.import_module("lingua_zeco.comm.all_scan")  # the module: the package exports its function

    def links(transport, one_node, unavailable=None):
        monkeypatch.setattr(mod, "symm_unavailable", lambda x: unavailable)
        monkeypatch.setattr(mod, "in_one_node", lambda group, args: one_node)
        return [type(link).__name__ for link in mod._links(AllScanArgs(transport=transport), torch.zeros(4), None,
                                                           0, 2, False)]

    assert links("auto", True) == ["SymmLink", "P2PLink"]
    assert links("auto", False) == ["P2PLink"]
    assert links("auto", True, "tensors on cpu") == ["P2PLink"]
    assert links("symm", False) == ["SymmLink"]
    assert links("nccl", True) == ["P2PLink"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AllScanArgs(transport="symm").check()
