"""With LINGUA_ZECO_FAILURES_NOW=1 a failing test's report is printed the moment it fails, not only in
the summary at the end: a GPU run cut by its time limit (the device's calls are capped, and autotuning
can eat the time) keeps the reason of every failure so far. The device scripts under setup/gpu set it, and
LINGUA_ZECO_FAILURES_FILE too: the same reports appended to that file, which also keeps those of pytest-xdist's
worker processes (their terminal output is not shown).

With LINGUA_ZECO_ONE_CONFIG=1 every Triton autotuner (fla's and ours) runs the first of its configs that
survive its own pruning, without benchmarking or caching: the GPU tests check values, which any config must
get right, and tuning fla's kernels for each new dtype and head size took minutes a test (setup/gpu/*.sh set it
for tests, never for benchmarks)."""
import os

import pytest

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
