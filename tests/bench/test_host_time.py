"""bench.host_time: the cProfile report names the step's functions with their time."""

import time

from bench.host_time import host_profile


def _slow_part():
    time.sleep(0.05)


def test_report_names_the_function_that_took_the_time():
    calls = []
    report = host_profile(lambda: (_slow_part(), calls.append(1)), rows=5, sync=lambda: calls.append("sync"))
    assert report.startswith("host under cProfile: ") and float(report.split()[3]) >= 0.05
    assert "by own time:" in report and "by time inside:" in report and "_slow_part" in report
    assert calls == ["sync", 1, "sync"]
