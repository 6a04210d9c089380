"""Weight sync from FSDP2 shards into a rollout engine: the bucketed in-place path against the old gather + file + read.

    python -m bench.weight_sync --model ling-3-tiny --dtype bfloat16                          (one GPU)
    torchrun --nproc-per-node 8 -m bench.weight_sync --model kimi-linear-48b-a3b --layers 4  (8 GPUs)
    python -m bench.weight_sync --model tiny-kimi-linear --device cpu --dtype float32       (CPU smoke run)

Every rank builds the model (random init, `--layers` keeps the first N layers), wraps it with FSDP2 over all ranks
(`parallel.launch.parallelize_for_job`, dp_shard = world size; one process starts a world of one) and builds a
receiving torch engine (app.torch_engine, the same architecture on the same device). Then, each `--repeat` times:
- "bucketed" (the RL job's path, app.weight_sync.sync_weights): every parameter gathered on the device
  (`full_tensor`), packed into buckets of `--bucket-mb`, streamed into every rank's engine;
- "file" (the path before: app.distributed_trainer's policy() and rollout/vllm_process.py): the full state dict
  gathered into rank 0's host memory (`get_model_state_dict(full_state_dict, cpu_offload)`), written as one
  safetensors file (in /dev/shm when it exists), read back tensor by tensor into rank 0's engine.
It reports per path the bytes, the fastest seconds and GB/s (bytes / seconds: the rate a rank's engine is filled),
and the extra peak memory on the device (CUDA: max_memory_allocated above what was allocated before) and on the host
(CPU storages allocated by torch ops and alive at once, bench.live_bytes), beside the device's copy bandwidth (one
`copy_` of a `--copy-mb` tensor, read + write counted once: the rate a perfect in-place sync could reach).
Results of a run go to bench/RESULTS.md with the printed command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from app.torch_engine import TorchEngine
from app.weight_sync import sync_weights
from bench.live_bytes import LiveBytes
from models.decoder import HybridForCausalLM
from models.dtypes import DTYPES
from models.hf_io import key_rule
from models.presets import PRESETS, preset
from parallel.config import ParallelConfig
from parallel.launch import init_distributed, parallelize_for_job

PATHS = ("bucketed", "file")


def _single_process_world() -> None:
    """Outside torchrun: the environment of a world of one (init_distributed reads it)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def copy_bandwidth(device: torch.device, megabytes: int) -> float:
    """GB/s of one device-to-device `copy_` of `megabytes` MiB (the best of 3)."""
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        _synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return src.numel() / 1e9 / best


def file_path(model: torch.nn.Module, engine: TorchEngine, folder: str) -> int:
    """The old sync: full state dict on rank 0's host, one safetensors file, read back into rank 0's engine; returns
    the bytes written."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return 0
    config = engine.model.config
    tensors = {}
    for key, tensor in full.items():
        rule = key_rule(config, key, tensor.shape)
        tensors.update((name, part.contiguous().clone()) for name, part in zip(rule.disk_keys, rule.split(tensor)))
    del full
    path = os.path.join(folder, "update.safetensors")
    save_file(tensors, path)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    del tensors
    device = next(engine.model.parameters()).device

    def streamed():
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(device)

    engine.update_weights(streamed())
    os.remove(path)
    return nbytes


def measure(name: str, run, device: torch.device, repeat: int) -> dict:
    """The fastest of `repeat` runs of `run()` (returns bytes), its extra device and host peaks."""
    best, nbytes, device_peak, host_peak = float("inf"), 0, 0, 0
    for _ in range(repeat):
        _synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        with LiveBytes() as host:
            start = time.perf_counter()
            nbytes = run()
            _synchronize(device)
            seconds = time.perf_counter() - start
        best = min(best, seconds)
        host_peak = max(host_peak, host.peak)
        if device.type == "cuda":
            device_peak = max(device_peak, torch.cuda.max_memory_allocated(device) - before)
    return {"path": name, "bytes": nbytes, "seconds": best, "gb_per_s": nbytes / 1e9 / best,
            "device_peak_extra_bytes": device_peak, "host_peak_bytes": host_peak}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.weight_sync", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ling-3-tiny", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--copy-mb", type=int, default=1024)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)
    paths = args.paths.split(",")
    if not set(paths) <= set(PATHS) or not paths:
        parser.error(f"--paths: name one or more of {', '.join(PATHS)}, got {args.paths!r}")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")
    device_type = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device

    _single_process_world()
    job = init_distributed(ParallelConfig(dp_shard=int(os.environ["WORLD_SIZE"])), device_type)
    main_rank = job.rank == 0
    config = dataclasses.replace(preset(args.model), dtype=args.dtype)
    if args.layers is not None:
        config = dataclasses.replace(config, layer_types=config.layer_types[:args.layers],
                                     ffn_types=config.ffn_types[:args.layers])
    command = "python -m bench.weight_sync " + " ".join(sys.argv[1:] if argv is None else argv)
    if main_rank:
        print(f"command: {command}")
        print(f"model {args.model} ({config.num_layers} layers, {args.dtype}), {job.world_size} rank(s) on "
              f"{device_type}, FSDP2 over all ranks, bucket {args.bucket_mb} MiB")
    torch.manual_seed(0)
    with torch.device(job.device):
        model = parallelize_for_job(HybridForCausalLM(config), job)
        engine = TorchEngine(HybridForCausalLM(config), max_model_len=16)
    entries = [t.numel() * t.element_size() for t in engine.model.state_dict().values()]
    bucket = args.bucket_mb * 2**20
    runs = {
        "bucketed": lambda: sync_weights(engine, model, config, bucket).nbytes,
        "file": lambda: file_path(model, engine, folder),
    }
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as folder:
        results = [measure(name, runs[name], job.device, args.repeat) for name in paths]
    copy = copy_bandwidth(job.device, args.copy_mb)
    report = {"command": command, "model": args.model, "layers": config.num_layers, "dtype": args.dtype,
              "ranks": job.world_size, "device": device_type, "bucket_bytes": bucket, "model_bytes": sum(entries),
              "largest_entry_bytes": max(entries), "copy_gb_per_s": copy, "results": results}
    if main_rank:
        if args.json:
            print(json.dumps(report))
        else:
            print(f"model {sum(entries) / 1e9:.3f} GB, largest entry {max(entries) / 1e6:.1f} MB; device copy "
                  f"{copy:.1f} GB/s")
            print(f"{'path':<9} {'GB':>8} {'seconds':>9} {'GB/s':>8} {'device +peak GB':>16} {'host peak GB':>13}")
            for r in results:
                print(f"{r['path']:<9} {r['bytes'] / 1e9:>8.3f} {r['seconds']:>9.3f} {r['gb_per_s']:>8.2f} "
                      f"{r['device_peak_extra_bytes'] / 1e9:>16.3f} {r['host_peak_bytes'] / 1e9:>13.3f}")
            if len(results) == 2:
                print(f"bucketed is {results[1]['seconds'] / results[0]['seconds']:.1f}x faster than file")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
