"""With LINGUA_ZECO_FAILURES_NOW=1 a failing test's report is printed the moment it fails, not only in
the summary at the end: a GPU run cut by its time limit (the device's calls are capped, and autotuning
can eat the time) keeps the reason of every failure so far. The device scripts under setup/gpu set it."""
import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and os.environ.get("LINGUA_ZECO_FAILURES_NOW") == "1":
        writer = item.config.get_terminal_writer()  # pytest's own stdout, outside the output capture
        writer.line(f"\nFAILED NOW {report.nodeid} ({report.when})")
        writer.line(str(report.longrepr)[-4000:])
        writer.flush()
