"""Write fla's tuned kernel configs for a GPU from the Triton cache of a run at production shapes
(`models.ops.tuned_configs`).

    python -m bench.tuned_configs --kernel-cache DIR --tuned-on "WHAT RAN" [--out DIR]

Run it after a benchmark that started from a cache without autotuning records (`*.autotune.json`: delete them and
keep the compiled kernels, or start empty), so that every fla kernel was tuned on the run's own shapes, e.g.
`python -m bench.speed --scale 0.01 --modes flat,duplicate --kernel-cache DIR` (a 60,664-row microbatch of
ling-3-tiny first). Writes `--out/<GPU folder>/` (default: the repository's `models/ops/fla_configs`), one JSON file
per kernel and `manifest.json` with the GPU, the triton and fla versions and `--tuned-on`; prints the keys per kernel.
Run it on the machine that tuned them: the manifest takes the GPU's name and the installed versions from there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from models.ops.tuned_configs import TUNED_CONFIGS, gpu_folder_name, write_tuned_configs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel-cache", required=True, metavar="DIR", help="the run's Triton cache folder")
    parser.add_argument("--tuned-on", required=True, help="the run that tuned them (its command), for the manifest")
    parser.add_argument("--out", type=Path, default=TUNED_CONFIGS, help="folder of the per-GPU folders")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device here: run this on the machine whose run filled the cache")
    gpu = torch.cuda.get_device_name()
    cache = Path(args.kernel_cache)
    if not cache.is_dir():
        sys.exit(f"error: --kernel-cache: {cache} is not a folder")
    out = args.out / gpu_folder_name(gpu)
    try:
        keys = write_tuned_configs(cache, out, gpu, args.tuned_on)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if not keys:
        sys.exit(f"error: {cache} holds no autotuning records (*.autotune.json)")
    for kernel, n in sorted(keys.items()):
        print(f"{n:3d} key(s)  {kernel}")
    print(f"wrote {len(keys)} kernels' configs to {out}")


if __name__ == "__main__":
    main()
