"""Environment variables this code sets for the kernel libraries (Triton, fla, flash-attn-4), told apart from the
user's own.

A user's setting wins over a default of ours, but a value we set earlier is not the user's: a second job in the same
process must not take the first job's folder for a user's choice. So each value set here is recorded beside its
variable, in the environment too (`ARBOR_SET_<NAME>`), and processes started from this one inherit both.
"""

from __future__ import annotations

import os

__all__ = ["OWN_PREFIX", "own_name", "set_own", "users_value"]

OWN_PREFIX = "ARBOR_SET_"


def own_name(name: str) -> str:
    """The variable that records the value of `name` this code set."""
    return OWN_PREFIX + name


def users_value(name: str) -> str | None:
    """`name`'s value in the environment unless this code set it (None then, or when unset)."""
    value = os.environ.get(name)
    return None if value is not None and value == os.environ.get(own_name(name)) else value


def set_own(name: str, value: str) -> None:
    """Set `name` to `value`, recorded as ours."""
    os.environ[name] = os.environ[own_name(name)] = value
