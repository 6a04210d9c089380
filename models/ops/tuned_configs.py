"""fla's Triton kernels run configs tuned on the GPUs measured here, read from files, instead of autotuning them.

fla 0.6.0 autotunes a kernel the first time it meets an autotuning key (head counts, head dims, chunk size, dtypes:
never the number of rows) and keeps that choice for the process and, through Triton's cache, for later processes.
So the first call's shapes choose the config for every later call: a benchmark started after a small test ran with
configs timed on a few hundred rows (seen on the H200: `chunk_gla_fwd_kernel_o` and five other KDA kernels were
tuned on calls of a few hundred rows and then ran 60,664-row microbatches). Autotuning also takes most of a cold first
step (bench/RESULTS.md, "GPU: the RL job's first step").

fla reads chosen configs from files instead when told to (`fla.ops.utils.cache`: `FLA_CONFIG_DIR`, and
`FLA_CACHE_MODE`, read once when fla is imported): `<FLA_CONFIG_DIR>/<kernel>.json`, one entry per autotuning key.
`fla_configs/<GPU>/` holds such files, written by `write_tuned_configs` from the Triton cache of a run at
production shapes on that GPU (`python -m bench.tuned_configs`), with `manifest.json` naming the GPU, the triton and
fla versions and the run. `use_tuned_configs` points fla at the folder of the GPU in use in strict mode (an exact
key match; any other key autotunes as before) when the versions match and the user set neither variable (a folder
set here before is not the user's: `models.ops.own_env`). The RL job and the benchmarks call it through
`models.ops.kernel_environment.use_kernel_environment`, with `KernelSettings.tuned_configs` as the folder of folders.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import defaultdict
from importlib import metadata
from pathlib import Path

from models.ops.own_env import set_own, users_value

__all__ = ["CONFIG_DIR_ENV", "CACHE_MODE_ENV", "TUNED_CONFIGS", "MANIFEST", "gpu_folder_name", "use_tuned_configs",
           "write_tuned_configs"]

CONFIG_DIR_ENV = "FLA_CONFIG_DIR"
CACHE_MODE_ENV = "FLA_CACHE_MODE"
#: One folder per GPU (`gpu_folder_name`), each with one JSON file per kernel and MANIFEST.
TUNED_CONFIGS = Path(__file__).parent / "fla_configs"
MANIFEST = "manifest.json"
_AUTOTUNE_SUFFIX = ".autotune.json"


def gpu_folder_name(device_name: str) -> str:
    """fla's name for a GPU's config folder (`fla.ops.utils.cache.sanitize_gpu_name`): 'NVIDIA H200' ->
    'NVIDIA_H200'."""
    return re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_") or "unknown_gpu"


def _versions() -> dict[str, str]:
    return {"triton": metadata.version("triton"), "fla": metadata.version("fla-core")}


def use_tuned_configs(device_name: str, root: Path = TUNED_CONFIGS) -> str:
    """Point fla at the tuned configs of `device_name` (the GPU in use) for this process and the processes it
    starts, before fla is imported. Returns what was done, as a line for the job's log: the folder, or why not (no
    folder for this GPU, other triton or fla versions, the user's own FLA_CONFIG_DIR or FLA_CACHE_MODE, fla already
    imported)."""
    user_dir = users_value(CONFIG_DIR_ENV)
    if user_dir is not None:
        return f"fla kernel configs: {CONFIG_DIR_ENV}={user_dir} (the user's)"
    folder = root / gpu_folder_name(device_name)
    if not (folder / MANIFEST).is_file():
        return f"fla kernel configs: none tuned for {device_name} here: fla autotunes on first use"
    recorded = json.loads((folder / MANIFEST).read_text())
    installed = _versions()
    if any(recorded.get(name) != version for name, version in installed.items()):
        return (f"fla kernel configs: {folder} was tuned with triton {recorded.get('triton')} and fla "
                f"{recorded.get('fla')}, this is triton {installed['triton']} and fla {installed['fla']}: fla "
                "autotunes on first use")
    if os.environ.get(CACHE_MODE_ENV, "strict") != "strict":
        return f"fla kernel configs: {CACHE_MODE_ENV}={os.environ[CACHE_MODE_ENV]} (the user's)"
    if "fla" in sys.modules and os.environ.get(CACHE_MODE_ENV) is None:
        return "fla kernel configs: not used: fla was imported before the kernel cache was chosen"
    set_own(CONFIG_DIR_ENV, str(folder))
    os.environ[CACHE_MODE_ENV] = "strict"
    return f"fla kernel configs: {folder} (tuned on {recorded.get('tuned_on', 'an unnamed run')})"


def _best(configs_timings: list) -> dict:
    """The config Triton's autotuner picks from an `.autotune.json`'s timings: the least [median, p20, p80]."""
    return min(configs_timings, key=lambda entry: entry[1])[0]


def write_tuned_configs(triton_cache: Path, out: Path, device_name: str, tuned_on: str) -> dict[str, int]:
    """fla config files (`fla.ops.utils.cache.KernelConfigFile`) from every `<kernel>.autotune.json` of a Triton
    cache folder: `out/<kernel>.json` with one entry per autotuning key (the config its timings chose), and
    MANIFEST. Returns the number of keys per kernel."""
    from fla.ops.utils.cache import AutotuneKey

    entries: dict[str, dict[str, dict]] = defaultdict(dict)
    for path in sorted(Path(triton_cache).glob(f"*/*{_AUTOTUNE_SUFFIX}")):
        kernel = path.name[: -len(_AUTOTUNE_SUFFIX)]
        record = json.loads(path.read_text())
        config = {k: v for k, v in _best(record["configs_timings"]).items() if k != "pre_hook"}
        key_hash = AutotuneKey.key_hash(record["key"])
        if entries[kernel].get(key_hash, {"config": config})["config"] != config:
            raise ValueError(f"{path}: key {record['key']} of {kernel} has two different tuned configs in "
                             f"{triton_cache}; tune into an empty cache")
        entries[kernel][key_hash] = {"autotune_key": record["key"], "config": config}
    out.mkdir(parents=True, exist_ok=True)
    versions = _versions()
    for kernel, by_key in entries.items():
        data = {"kernel_name": kernel, "triton_version": versions["triton"], "autotune_entries": by_key}
        (out / f"{kernel}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    manifest = {"gpu": device_name, **versions, "tuned_on": tuned_on}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return {kernel: len(by_key) for kernel, by_key in entries.items()}
