"""The first step of each phase on a GPU, made visible: there fla's Triton kernels compile and autotune (minutes on an
empty kernel cache, `models.ops.kernel_cache`), which would otherwise look like a hang.

At the job's first step one line names the kernel cache and how many entries it holds; while the first step of a phase
runs, a heartbeat line every `interval` seconds; after it, the step's time. Without a kernel cache (CPU jobs, ranks
other than the main one) it prints nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from models.ops.kernel_cache import KernelCache, cache_entries

__all__ = ["FirstStepWatch"]


class FirstStepWatch:
    def __init__(self, cache: KernelCache | None, say: Callable[[str], None], interval: float = 10.0) -> None:
        self.cache, self.say, self.interval = cache, say, interval
        self._phases: set[str] = set()

    @contextmanager
    def step(self, phase: str, label: str) -> Iterator[None]:
        """Around one step of `phase` ("SFT", "RL"); `label` names it in the lines ("SFT step 1")."""
        if self.cache is None or phase in self._phases:
            yield
            return
        if not self._phases:
            self.say(self.cache.describe())
        self._phases.add(phase)
        start = time.perf_counter()
        done = threading.Event()
        beat = threading.Thread(target=self._beat, args=(label, start, done), daemon=True)
        beat.start()
        try:
            yield
        finally:
            done.set()
            beat.join()
        entries = cache_entries(self.cache.folder)
        self.say(f"{label}: {time.perf_counter() - start:.1f} s, the first of its phase (kernel compilation and "
                 f"autotuning included; the kernel cache now holds {entries} entries)")

    def _beat(self, label: str, start: float, done: threading.Event) -> None:
        while not done.wait(self.interval):
            self.say(f"{label}: running for {time.perf_counter() - start:.0f} s (a first step compiles and autotunes "
                     f"the kernels not yet in {self.cache.folder})")
