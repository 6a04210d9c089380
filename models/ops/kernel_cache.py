"""The folder where Triton keeps the kernels it compiles and fla's autotuning results: `TRITON_CACHE_DIR`.

fla's Triton kernels compile on first use, and fla 0.6.0 autotunes them with `cache_results=True`
(`FLA_CACHE_RESULTS`, fla/utils/env.py), so the timings land beside the binaries as
`<folder>/<hash>/<kernel>.autotune.json` (triton/runtime/autotuner.py `check_disk_cache`). A folder that outlives
the run therefore spares the next run both the compilation and the autotuning (cold and warm first steps:
bench/RESULTS.md, "GPU: the RL job's first step"); copying it spares another machine with the same GPU, triton
and fla versions. torch.compile's Triton kernels go there too (inductor reads `TRITON_CACHE_DIR`).

Triton reads the variable each time it looks up a kernel, so setting it before the first kernel compiles is enough
(this module imports neither triton nor fla). The RL job (`train.kernel_cache`) and the benchmarks
(`--kernel-cache`) choose the folder as `KernelSettings.kernel_cache` and set it with the rest of the kernels'
environment (`models.ops.kernel_environment.use_kernel_environment`): `use_kernel_cache` here, which also points fla
at the kernel configs tuned for the GPU in use, where there are some (`models.ops.tuned_configs`): those kernels
then compile one config each and do not autotune.

FlashAttention-4's CuTe-DSL kernels (`train.attention_kernels = "fa4"`) compile in every process on first use, for
each phase's shapes, unless its own disk cache is on (off by default in flash-attn-4 4.0.0b36:
`FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED` / `_DIR`, read when flash_attn.cute is imported). `use_kernel_cache` turns it
on in the subfolder `flash-attn-4` of the chosen folder unless the user set that folder. With the two variables set
by hand (this code did not run on a GPU yet), a second RL job's first SFT and RL steps took about half as long
(bench/RESULTS.md, "GPU: the RL job's first step").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from models.ops.own_env import set_own, users_value
from models.ops.tuned_configs import TUNED_CONFIGS, use_tuned_configs

__all__ = ["TRITON_CACHE_ENV", "FA4_CACHE_ENV", "FA4_CACHE_ON_ENV", "FA4_SUBFOLDER", "KernelCache",
           "use_kernel_cache", "cache_entries"]

TRITON_CACHE_ENV = "TRITON_CACHE_DIR"
FA4_CACHE_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"
FA4_CACHE_ON_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
#: FlashAttention-4's compiled kernels, inside the kernel cache folder (not counted as Triton entries).
FA4_SUBFOLDER = "flash-attn-4"


@dataclass(frozen=True)
class KernelCache:
    folder: Path
    source: str
    """What chose the folder: the setting's name, `TRITON_CACHE_DIR`, or "default"."""
    entries: int
    """Kernels (cache entries) the folder held before this process compiled anything."""
    tuned: str = ""
    """What `models.ops.tuned_configs.use_tuned_configs` said (empty without a GPU)."""

    def describe(self) -> str:
        state = (f"{self.entries} entries: kernels and shapes not among them compile on first use"
                 if self.entries else
                 "empty: kernels compile and autotune on first use, minutes")
        line = f"kernel cache {self.folder} ({state}; from {self.source})"
        return f"{line}\n{self.tuned}" if self.tuned else line


def cache_entries(folder: Path) -> int:
    """Entries (one folder per compiled kernel or autotuning result) in a Triton cache folder."""
    try:
        return sum(1 for e in os.scandir(folder) if e.is_dir() and e.name != FA4_SUBFOLDER)
    except FileNotFoundError:
        return 0


def use_kernel_cache(folder: str | Path | None, default: str | Path | None, setting: str,
                     tuned_configs: Path = TUNED_CONFIGS) -> KernelCache:
    """Point Triton's cache at a folder (creating it) for this process and the processes it starts.

    Which folder wins: `folder` (an explicit setting, named `setting`), else the user's own `TRITON_CACHE_DIR` (not
    one set here before: `models.ops.own_env`), else `default`, else Triton's own default
    (`$TRITON_HOME/.triton/cache`, TRITON_HOME defaulting to the home folder). Also turns flash-attn-4's disk cache
    on in the folder's `FA4_SUBFOLDER` (module docstring) and, on a GPU, points fla at the configs tuned for it in
    `tuned_configs` (`models.ops.tuned_configs.use_tuned_configs`). Raises OSError when the folder cannot be created.
    """
    user = users_value(TRITON_CACHE_ENV)
    if folder is not None:
        chosen, source = Path(folder), setting
    elif user:
        chosen, source = Path(user), TRITON_CACHE_ENV
    elif default is not None:
        chosen, source = Path(default), "default"
    else:
        home = Path(os.environ.get("TRITON_HOME", "~")).expanduser()
        chosen, source = home / ".triton" / "cache", "Triton's default"
    chosen = chosen.expanduser().absolute()
    chosen.mkdir(parents=True, exist_ok=True)
    set_own(TRITON_CACHE_ENV, str(chosen))
    _share_with_fa4(chosen)
    return KernelCache(chosen, source, cache_entries(chosen), _tuned_configs(tuned_configs))


def _tuned_configs(root: Path) -> str:
    """`use_tuned_configs` for the GPU this process runs on: torchrun's LOCAL_RANK (`parallel.launch` sets that device
    later; naming it here, not the current device 0, keeps every rank off GPU 0), else the current one. "" without
    a GPU or for a LOCAL_RANK beyond the visible GPUs (`parallel.launch` says so)."""
    import torch

    if not torch.cuda.is_available():
        return ""
    local_rank = os.environ.get("LOCAL_RANK")
    index = int(local_rank) if local_rank is not None else torch.cuda.current_device()
    return use_tuned_configs(torch.cuda.get_device_name(index), root) if index < torch.cuda.device_count() else ""


def _share_with_fa4(folder: Path) -> None:
    """FlashAttention-4's disk cache on, in `folder`/FA4_SUBFOLDER, unless the user chose its folder (a user's
    FA4_CACHE_ON_ENV = 0 stays too)."""
    if users_value(FA4_CACHE_ENV) is not None:
        return
    os.environ.setdefault(FA4_CACHE_ON_ENV, "1")
    set_own(FA4_CACHE_ENV, str(folder / FA4_SUBFOLDER))
