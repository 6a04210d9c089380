"""The environment the kernel libraries read, set once per process from a model's `KernelSettings`, before the first
kernel compiles and before fla or flash-attn-4 are imported (the RL job: `app.job`; the benchmarks:
`bench.kernel_cache`).

These settings cannot travel as arguments like the rest of `KernelSettings`: Triton reads `TRITON_CACHE_DIR`
whenever it looks up a compiled kernel (and the processes a job starts, vLLM's among them, inherit it); fla reads
`FLA_CONFIG_DIR` at each lookup of a tuned config, and `FLA_CACHE_MODE` and `FLA_TENSOR_CACHE_SIZE` once, when it is
imported; flash-attn-4 reads its cache variables when `flash_attn.cute` is imported. None of them takes these as
arguments, so `use_kernel_environment` sets them, and nothing sets them on import.

`FLA_TENSOR_CACHE_SIZE`: fla memoises per-call chunk indices by the identity of `cu_seqlens` in queues of 4
entries; tree execution issues more distinct packed calls per layer than that (`models.tree.core_calls`), and every
miss costs a host-device copy, i.e. a stream synchronisation. Set to `FLA_TENSOR_CACHE_SIZE` unless the user set it;
a process that never calls `use_kernel_environment` runs fla's default (the same results, more synchronisations).
"""

from __future__ import annotations

import os
from pathlib import Path

from models.ops.kernel_cache import KernelCache, use_kernel_cache
from models.ops.settings import KernelSettings

__all__ = ["FLA_TENSOR_CACHE_ENV", "FLA_TENSOR_CACHE_SIZE", "use_kernel_environment"]

FLA_TENSOR_CACHE_ENV = "FLA_TENSOR_CACHE_SIZE"
#: The tensor cache entries fla keeps unless the user set `FLA_TENSOR_CACHE_ENV` (module docstring).
FLA_TENSOR_CACHE_SIZE = 64


def use_kernel_environment(settings: KernelSettings, default_cache: str | Path | None, setting: str) -> KernelCache:
    """Set this process's kernel environment from `settings` (module docstring) and return the kernel cache chosen:
    fla's tensor cache size, Triton's cache folder (`settings.kernel_cache`, named `setting` in messages, else the
    user's TRITON_CACHE_DIR, else `default_cache`: `models.ops.kernel_cache.use_kernel_cache`) with flash-attn-4's
    cache in it, and, on a GPU, fla's configs tuned for it (`settings.tuned_configs`). Raises OSError when the cache
    folder cannot be created."""
    os.environ.setdefault(FLA_TENSOR_CACHE_ENV, str(FLA_TENSOR_CACHE_SIZE))
    return use_kernel_cache(settings.kernel_cache, default_cache, setting, settings.tuned_configs)
