"""all_scan.overlap=auto: the chooser times both modes, the group agrees on the faster one, and every
scan stays exact while it measures (gloo ranks; the clock is given, so the timings are known)."""
import torch.distributed as dist

from lingua_zeco.comm import AllScanArgs
from lingua_zeco.sp.overlap import OverlapChooser
from local_ranks import run_on_ranks

from test_all_scan import contributions, reference


class GivenClock:
    """Spans of known length per mode and rank; counts how often it was asked to time."""

    def __init__(self, overlapped_s: float, blocking_s: float):
        self.len = {True: overlapped_s, False: blocking_s}
        self.started = 0

    def start(self, overlapped):
        self.started += 1
        return overlapped

    def stop(self, span):
        return span

    def seconds(self, span):
        return self.len[span]


def _chooser_worker(rank, world, per_rank_s):
    clock = GivenClock(*per_rank_s[rank])
    chooser = OverlapChooser(warmup=2, trials=3, clock=clock)
    xs, as_ = contributions(world, seed=4)
    args = AllScanArgs(algorithm="chain")
    errs = []
    for _ in range(12):
        for reverse in (False, True):
            y = chooser.scan(xs[rank], as_[rank], dist.group.WORLD, reverse, args).wait()
            errs.append((y.double() - reference(xs, as_, rank, reverse)).abs().max().item())
    return max(errs), clock.started, chooser.decisions()


def test_the_group_agrees_on_the_mode_with_the_smaller_summed_median():
    # rank 1 alone would block (4 > 3), the group's sums say overlap (1 + 4 < 3 + 3)
    results = run_on_ranks(_chooser_worker, 2, [(1.0, 3.0), (4.0, 3.0)])
    for err, started, decisions in results:
        assert err < 1e-5
        assert started == 2 * 2 * 3  # two directions × two modes × three trials, nothing after the decision
        assert [d["overlapped"] for d in decisions] == [True, True]
        assert decisions[0]["summed_median_s"] == [5.0, 6.0]


def test_blocking_wins_when_it_is_faster():
    results = run_on_ranks(_chooser_worker, 3, [(2.0, 1.0), (2.0, 1.5), (1.0, 1.0)])
    assert all([d["overlapped"] for d in r[2]] == [False, False] for r in results)


def _reinit_worker(rank, world):
    clock = GivenClock(1.0, 3.0)
    chooser = OverlapChooser(warmup=1, trials=2, clock=clock)
    xs, as_ = contributions(1, seed=4)
    args = AllScanArgs(algorithm="chain")

    def scans():
        for _ in range(6):
            chooser.scan(xs[0], as_[0], None, False, args).wait()

    scans()
    first = clock.started
    # a second run in the same process: the new world group gets the old one's name ("0")
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    scans()
    return first, clock.started, [d["group"] for d in chooser.decisions()]


def test_a_new_process_group_is_measured_again_not_given_a_destroyed_ones_decision():
    [(first, total, groups)] = run_on_ranks(_reinit_worker, 1)
    assert first == 2 * 2  # two modes × two trials, one direction
    assert total == 2 * first, "the re-made group reused the destroyed group's decision (keyed by its name)"
    assert groups == ["0", "0"]
