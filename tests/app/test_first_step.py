"""The first step of each phase on a GPU (app.first_step.FirstStepWatch): the kernel cache named once, a heartbeat
while the step runs that stops with it, the step's time; nothing without a kernel cache (CPU jobs)."""

import time

from app.first_step import FirstStepWatch
from models.ops.kernel_cache import KernelCache


def test_first_steps_are_announced_timed_and_beat_until_they_end(tmp_path):
    lines = []
    watch = FirstStepWatch(KernelCache(tmp_path, "train.kernel_cache", 0), lines.append, interval=0.02)
    with watch.step("SFT", "SFT step 1"):
        time.sleep(0.15)
        (tmp_path / "abc123").mkdir()
    assert lines[0] == watch.cache.describe() and str(tmp_path) in lines[0] and "empty" in lines[0]
    beats = [line for line in lines if "running for" in line]
    assert beats and all(line.startswith("SFT step 1: running for ") and str(tmp_path) in line for line in beats)
    assert lines[-1].startswith("SFT step 1: ") and "the kernel cache now holds 1 entries" in lines[-1]
    count = len(lines)
    time.sleep(0.1)
    assert len(lines) == count, "the heartbeat went on after the step"

    with watch.step("SFT", "SFT step 2"):
        time.sleep(0.05)
    assert len(lines) == count, "only the first step of a phase is watched"
    with watch.step("RL", "RL step 1"):
        pass
    assert len(lines) == count + 1 and lines[-1].startswith("RL step 1: ")


def test_a_failing_first_step_stops_the_heartbeat_and_prints_no_time(tmp_path):
    lines = []
    watch = FirstStepWatch(KernelCache(tmp_path, "default", 3), lines.append, interval=0.02)
    try:
        with watch.step("RL", "RL step 1"):
            raise RuntimeError("kernel failed")
    except RuntimeError:
        pass
    count = len(lines)
    time.sleep(0.08)
    assert len(lines) == count and lines == [watch.cache.describe()] and "(3 entries: " in lines[0]


def test_without_a_kernel_cache_nothing_is_printed():
    lines = []
    watch = FirstStepWatch(None, lines.append, interval=0.01)
    with watch.step("SFT", "SFT step 1"):
        time.sleep(0.05)
    assert lines == []
