"""Rich progress bars for the job: one bar per phase (SFT, RL steps), and per step a rollout bar (sequences sampled,
advanced by the engine as each turn level returns) and a training bar (microbatches)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from rollout.engine import Engine, GenerationRequest, GenerationResult

__all__ = ["JobProgress", "CountingEngine"]


class JobProgress:
    """Progress bars, or nothing when disabled (the console still prints step lines)."""

    def __init__(self, console: Console, enabled: bool) -> None:
        self.console = console
        self.bars = Progress(
            SpinnerColumn(), TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console, disable=not enabled,
        )

    def __enter__(self) -> "JobProgress":
        self.bars.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bars.__exit__(*exc)

    def phase(self, name: str, total: int, done: int):
        return self.bars.add_task(name, total=total, completed=done, info="")

    def transient(self, name: str, total: int | None):
        return self.bars.add_task(name, total=total, info="")

    def advance(self, task, amount: float = 1, info: str | None = None) -> None:
        if info is None:
            self.bars.advance(task, amount)
        else:
            self.bars.update(task, advance=amount, info=info)

    def remove(self, task) -> None:
        self.bars.remove_task(task)

    def print(self, *args, **kwargs) -> None:
        self.console.print(*args, **kwargs)


class CountingEngine(Engine):
    """Passes calls to `inner` and advances a progress task by the sequences each generate call returns."""

    def __init__(self, inner: Engine, progress: JobProgress, task) -> None:
        self.inner, self.progress, self.task = inner, progress, task

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        results = self.inner.generate(requests)
        self.progress.advance(self.task, sum(len(r.completions) for r in results))
        return results

    def reseed(self, seed: int) -> None:
        self.inner.reseed(seed)

    def update_weights(self, named_tensors: Iterable) -> None:
        self.inner.update_weights(named_tensors)
