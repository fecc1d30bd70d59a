"""With LINGUA_ZECO_FAILURES_NOW=1 a failing test's report is printed the moment it fails, not only in
the summary at the end: a GPU run cut by its time limit (the device's calls are capped, and autotuning
can eat the time) keeps the reason of every failure so far. The device scripts under setup/gpu set it, and
LINGUA_ZECO_FAILURES_FILE too: the same reports appended to that file, which also keeps those of pytest-xdist's
worker processes (their terminal output is not shown).

With LINGUA_ZECO_ONE_CONFIG=1 every Triton autotuner (fla's and ours) runs the first of its configs that
survive its own pruning, without benchmarking or caching: the GPU tests check values, which any config must
get right, and tuning fla's kernels for each new dtype and head size took minutes a test (setup/gpu/*.sh set it
for tests, never for benchmarks).

Under pytest-xdist (README's `-n 2`) each worker and the processes it starts run torch on one thread: two
workers of two threads each on two cores spent their time switching. The files marked `slow` are handed out
first, so that the longest ones do not end the run on one worker while the other waits."""
import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # set before torch is imported here or in any subprocess
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items):
    """Files holding a `slow` test first, each file's tests kept together and in their order."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: the order within each group stays

if os.environ.get("LINGUA_ZECO_ONE_CONFIG") == "1":
    from triton.runtime.autotuner import Autotuner

    _prune = Autotuner.prune_configs

    def _first_config(self, kwargs):
        self.cache_results = False  # a one-config "tuning" must not land in the autotune cache
        return _prune(self, kwargs)[:1]
    Autotuner.prune_configs = _first_config


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and os.environ.get("LINGUA_ZECO_FAILURES_NOW") == "1":
        text = f"\nFAILED NOW {report.nodeid} ({report.when})\n{str(report.longrepr)[-4000:]}"
        writer = item.config.get_terminal_writer()  # pytest's own stdout, outside the output capture
        writer.line(text)
        writer.flush()
        path = os.environ.get("LINGUA_ZECO_FAILURES_FILE")
        if path:
            with open(path, "a") as f:  # one append per report: workers' lines do not interleave mid-report
                f.write(text + "\n")
