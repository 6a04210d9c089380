"""Known limits of fla's kernels on this machine: one rule per limit, read by the code and the tests that must avoid it.

GDN backward (fla 0.6.0, `fla.ops.common.chunk_o.chunk_bwd_dqkwg`): the gated `chunk_bwd_dqkwg` kernel gives wrong
results with triton >= 3.4.0, < 3.7.1 on Hopper GPUs (fla-org/flash-linear-attention#640), so fla raises RuntimeError
there unless tilelang is installed (its backend then replaces the kernel). Gated DeltaNet's chunk backward calls it
with a gate; KDA's backward does not (its own kernels), so KDA trains on such machines.
"""

from __future__ import annotations

import importlib.util
from importlib import metadata

import torch
from packaging.version import InvalidVersion, Version

__all__ = ["GDN_BACKWARD_TRITON_RANGE", "gdn_backward_limit", "gdn_backward_rule"]

#: Triton versions [from, to) in which fla refuses GDN's backward on Hopper.
GDN_BACKWARD_TRITON_RANGE = ("3.4.0", "3.7.1")
_HOPPER_MAJOR = 9


def _installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cuda_capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def gdn_backward_limit() -> str | None:
    """Why fla's Gated DeltaNet chunk backward cannot run on this machine (its triton, its CUDA device, tilelang
    importable or not), or None when it can; see `gdn_backward_rule`."""
    return gdn_backward_rule(_installed("triton"), _cuda_capability(), importlib.util.find_spec("tilelang") is not None)


def gdn_backward_rule(triton_version: str | None, capability: tuple[int, int] | None, has_tilelang: bool) -> str | None:
    """fla's rule for GDN's backward: the reason it refuses (naming the versions and the fix) for triton
    `triton_version` (None: not installed) on a CUDA device of compute `capability` (None: no CUDA device), or None."""
    if triton_version is None or capability is None or capability[0] != _HOPPER_MAJOR or has_tilelang:
        return None
    low, high = GDN_BACKWARD_TRITON_RANGE
    try:
        # Compared as fla compares (packaging's order): "3.7.1+git1234" is >= 3.7.1, "3.7.1rc1" is not.
        version = Version(triton_version)
    except InvalidVersion:
        return None
    if not Version(low) <= version < Version(high):
        return None
    fla = _installed("fla-core") or "?"
    return (
        f"fla {fla} refuses Gated DeltaNet's chunk backward on Hopper (compute capability "
        f"{capability[0]}.{capability[1]}) with triton {triton_version} (>= {low}, < {high} computes it wrong, "
        f"fla-org/flash-linear-attention#640): install triton >= {high} or tilelang"
    )
