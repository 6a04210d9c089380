"""What one rank decides, every rank learns (the default process group; without one, this process alone).

    share(fn)           rank 0 runs fn; its result, or the exception it raised, comes back on every rank
    first_found(value)  the first non-None of every rank's `value`, in rank order, on every rank
    all_values(value)   every rank's `value`, in rank order, on every rank
    gather_outcomes(fn) every rank runs fn; rank 0 gets each rank's (True, result) or (False, exception)

All are collectives: every rank must call them in the same order. Values travel pickled between the ranks'
memories (never through a file).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["distributed", "is_main", "rank_and_size", "share", "first_found", "all_values", "gather_outcomes"]

T = TypeVar("T")


def distributed() -> bool:
    """A default process group exists (a torchrun launch)."""
    return dist.is_available() and dist.is_initialized()


def is_main() -> bool:
    """This process is rank 0 (or runs alone)."""
    return not distributed() or dist.get_rank() == 0


def rank_and_size() -> tuple[int, int]:
    """This process's rank and the number of ranks ((0, 1) without a process group)."""
    return (dist.get_rank(), dist.get_world_size()) if distributed() else (0, 1)


def share(fn: Callable[[], T]) -> T:
    """fn() on rank 0, its result on every rank; an exception raised by fn (any BaseException, e.g. a stop signal's)
    is raised on every rank."""
    if not distributed():
        return fn()
    payload: list[Any] = [None]
    if is_main():
        try:
            payload[0] = (True, fn())
        except BaseException as e:  # every rank must leave the broadcast, then all raise it (a stop signal too)
            payload[0] = (False, e)
    dist.broadcast_object_list(payload, src=0)
    ok, value = payload[0]
    if not ok:
        raise value
    return value


def all_values(value: T) -> list[T]:
    """Every rank's `value`, in rank order, on every rank."""
    if not distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def first_found(value: T | None) -> T | None:
    """The first non-None `value` over the ranks (rank order), on every rank."""
    return next((v for v in all_values(value) if v is not None), None)


def _portable(e: BaseException) -> BaseException:
    """`e` if it pickles, else a RuntimeError with its type and message (it must travel to rank 0)."""
    try:
        pickle.dumps(e)
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(e).__name__}: {e}")
    return e


def gather_outcomes(fn: Callable[[], T]) -> list[tuple[bool, Any]] | None:
    """fn() on every rank; on rank 0 every rank's outcome in rank order, (True, result) or (False, the exception fn
    raised: any BaseException, so that a stop signal on one rank reaches rank 0 too), None on the other ranks. No
    rank raises here: rank 0 decides (e.g. inside `share`) and every rank learns it."""
    try:
        outcome: tuple[bool, Any] = (True, fn())
    except BaseException as e:  # every rank must reach the gather
        outcome = (False, _portable(e))
    if not distributed():
        return [outcome]
    outcomes: list[Any] | None = [None] * dist.get_world_size() if is_main() else None
    dist.gather_object(outcome, outcomes, dst=0)
    return outcomes
