"""Checkpoints of a run, one folder per step in one format for one process and for N ranks:

    <dir>/step-12/
        .metadata, __0_0.distcp, __1_0.distcp ...   the trainer's tensors: model, AdamW state, KL reference
                                                    (parallel.checkpoint.TrainingState: DCP, one shard file per rank)
        job.json                                    the job's own state: step counters, run name, RNG states

A checkpoint holds what the next step depends on. The rollout engine holds no state of its own: a resumed run starts a
fresh engine from the checkpointed weights. DCP reshards on load, so a run moves between one process and N ranks.

- Atomic: a checkpoint is written into `step-N.tmp` (shards, then job.json, each flushed to disk) and renamed to
  `step-N`, so a folder named `step-N` is complete. A run killed while writing leaves `step-N.tmp`; the next run
  removes it.
- Resume: the newest checkpoint whose files are all there and readable. Newer ones with missing, truncated or
  unreadable files are reported (one line each) and skipped. An error: one that would run code, one of an earlier
  Arbor format (`state.pt`, or DCP without job.json), one written for another model.
- Own folders only: a fresh run removes the `step-N` / `step-N.tmp` folders that hold checkpoint files only, nothing
  else in `<dir>` (app.folder_lock keeps other runs out of it).
- Never runs code from a file: job.json is JSON; tensors go through `parallel.checkpoint`'s checked DCP reader.
- Finite: a checkpoint with a NaN or inf tensor is refused before anything is written (`check_finite` does the same
  for other writers, e.g. the HF export).
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from app.config_loader import ConfigError
from parallel.checkpoint import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    TrainingState,
    UnsafeCheckpointError,
    read_metadata,
    save_tensors,
    saved_tensors,
)
from parallel.ranks import first_found, share

__all__ = ["Checkpointer", "Restored", "CheckpointError", "NonFiniteError", "check_finite", "first_non_finite",
           "rng_state", "set_rng_state", "FORMAT"]

FORMAT = "arbor-checkpoint-1"
_STEP = re.compile(r"^step-(\d+)$")
_OWN_FOLDER = re.compile(r"^step-\d+(\.old)?(\.tmp)?$")
#: Files of this format and of the earlier ones (state.pt; DCP without job.json).
_OWN_FILE = re.compile(r"^(\.metadata(\.tmp)?|__\d+_\d+\.distcp|job\.json|state\.pt)$")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; the message names the folder and what to do."""


class NonFiniteError(ConfigError):
    """Weights with NaN or inf values, refused by a checkpoint or an export."""


def _encoded(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _decoded(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """States of Python's, numpy's and torch's global generators (and CUDA's when present), as JSON values."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss], "numpy": [name, keys.tolist(), pos, has_gauss, cached],
             "torch": _encoded(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = [_encoded(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_decoded(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_decoded(s) for s in state["cuda"]])


def first_non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """Name of the first floating-point tensor with a NaN or inf (this rank's shard of a DTensor), else None."""
    for name, t in tensors.items():
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            return name
    return None


def check_finite(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise NonFiniteError naming `what` (e.g. "the Hugging Face export") and the first non-finite tensor."""
    name = first_non_finite(tensors)
    if name is not None:
        raise NonFiniteError(f"{what} refused: {name} has non-finite values (NaN or inf), nothing was written; the "
                             "training diverged (a smaller `train.lr` / `train.sft_lr` may help)")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _own(folder: Path) -> bool:
    """A folder of checkpoint files only (this format or an earlier one), named step-N[.tmp]."""
    return (_OWN_FOLDER.match(folder.name) is not None and folder.is_dir() and not folder.is_symlink()
            and all(p.is_file() and not p.is_symlink() and _OWN_FILE.match(p.name) for p in folder.iterdir()))


def _refused(path: Path, e: UnsafeCheckpointError) -> CheckpointError:
    return CheckpointError(f"`checkpoint.resume`: refused {path}: {e}; delete it to resume from an earlier checkpoint")


@dataclass
class Restored:
    """What `Checkpointer.restore` found."""

    job: dict[str, Any]
    """The job's state, as given to `save`."""
    path: Path
    notes: list[str] = field(default_factory=list)
    """One line per unfinished write removed and per checkpoint skipped."""


class Checkpointer:
    """Checkpoints in folder `root`, keeping the newest `keep`. `save`, `restore` and `remove_all` are collectives
    under a process group (rank 0 handles the folders)."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""
        if not self.root.is_dir():
            return []
        found = (_STEP.match(p.name) for p in self.root.iterdir())
        return sorted(int(m.group(1)) for m in found if m and (self.root / m.group(0) / "job.json").is_file())

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def save(self, step: int, state: TrainingState, job: dict[str, Any]) -> Path:
        """Write the checkpoint of `step`: `state`'s tensors and `job` (JSON values; rank 0's is kept), replacing an
        existing one; prune to the newest `keep`. Raises NonFiniteError, writing nothing, if a tensor is not finite."""
        tensors = state.tensors()
        bad = first_found(first_non_finite(tensors))
        if bad is not None:
            raise NonFiniteError(f"checkpoint of step {step} refused: {bad} has non-finite values (NaN or inf); "
                                 f"{self.root} keeps the earlier checkpoints (resume from one with a smaller "
                                 "`train.lr` / `train.sft_lr`)")
        final = self.path(step)
        tmp = final.with_name(final.name + ".tmp")
        text = share(lambda: self._begin(tmp, final, step, job))
        save_tensors(tensors, tmp)
        share(lambda: self._finish(tmp, final, text))
        return final

    def _begin(self, tmp: Path, final: Path, step: int, job: dict[str, Any]) -> str:
        text = json.dumps({"format": FORMAT, "step": step, "job": job})
        for folder in (final, tmp):
            if folder.exists() and not _own(folder):
                raise CheckpointError(f"`checkpoint.dir`: {folder} is in the way of the checkpoint of step {step} and "
                                      "holds other files than a checkpoint's: move it out of the checkpoint folder")
        self.root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        return text

    def _finish(self, tmp: Path, final: Path, text: str) -> None:
        with open(tmp / "job.json", "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():
            old = final.with_name(final.name + ".old.tmp")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(self.root)
        for s in self.steps()[: -self.keep]:
            if _own(self.path(s)):
                shutil.rmtree(self.path(s))

    def restore(self, state_for: Callable[[set[str]], TrainingState]) -> Restored:
        """Load the newest usable checkpoint into `state_for(groups)`, where `groups` are the saved ones ("model",
        "optimizer", "reference"); unfinished writes are removed first.

        Raises:
            CheckpointError: no usable checkpoint; or the newest readable one is of an earlier format, would run
                code, or does not fit the model.
        """
        notes = share(self._remove_unfinished)
        skipped: list[str] = []
        for path in share(self._candidates):
            checked = share(lambda: self._check(path))
            if isinstance(checked, str):
                skipped.append(f"{path.name}: {checked}")
                continue
            job, groups = checked
            try:
                state_for(groups).load(path)
            except CorruptCheckpointError as e:
                skipped.append(f"{path.name}: {e}")
                continue
            except CheckpointException as e:
                exception = next(iter(e.failures.values()))[0]
                first_sentence = str(exception).split(". ")[0].splitlines()[0][:120] if str(exception) else ""
                skipped.append(f"{path.name}: reading it failed ({type(exception).__name__}: {first_sentence})")
                continue
            except UnsafeCheckpointError as e:
                raise _refused(path, e) from None
            except CheckpointMismatchError as e:
                raise CheckpointError(f"`checkpoint.resume`: {e}: the checkpoint was written for another model; "
                                      "resume with the config that wrote it, or run without --resume to start fresh"
                                      ) from None
            notes += [f"skipped the incomplete checkpoint {s}" for s in skipped]
            return Restored(job, path, notes)
        detail = f" is complete ({'; '.join(skipped)})" if skipped else ""
        raise CheckpointError(f"`checkpoint.resume`: no checkpoint in {self.root}{detail}; run without --resume to "
                              "start fresh")

    def _remove_unfinished(self) -> list[str]:
        notes = []
        if self.root.is_dir():
            for p in sorted(self.root.iterdir()):
                if p.name.endswith(".tmp") and _own(p):
                    shutil.rmtree(p)
                    notes.append(f"removed the unfinished checkpoint write {p}")
        return notes

    def _candidates(self) -> list[Path]:
        """The `step-N` folders, newest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
        return [p for _, p in sorted(found, reverse=True)]

    def _check(self, path: Path) -> tuple[dict[str, Any], set[str]] | str:
        """(job state, saved groups) of a complete checkpoint, else what is wrong with it."""
        if (path / "state.pt").exists():
            raise CheckpointError(
                f"`checkpoint.resume`: {path} is a checkpoint of Arbor's earlier single-process format (state.pt, a "
                "pickle, which this version never loads): finish that run with the version that wrote it, or run "
                "without --resume to start fresh (which removes it)")
        if not (path / "job.json").is_file():
            if (path / ".metadata").is_file():
                raise CheckpointError(
                    f"`checkpoint.resume`: {path} is a checkpoint of Arbor's earlier distributed format (DCP without "
                    "job.json; its job state is a pickle, which this version never loads): finish that run with the "
                    "version that wrote it, or run without --resume to start fresh (which removes it)")
            return "no job.json"
        try:
            saved = json.loads((path / "job.json").read_text())
        except (OSError, ValueError) as e:
            return f"job.json is unreadable ({e})"
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            return f"job.json is not of format {FORMAT}"
        try:
            metadata = read_metadata(path)
        except CorruptCheckpointError as e:
            return str(e)
        except UnsafeCheckpointError as e:
            raise _refused(path, e) from None
        return saved["job"], {key.split("/", 1)[0] for key in metadata.state_dict_metadata}

    def load(self, path: Path | None = None) -> dict[str, Any]:
        """The newest checkpoint (or `path`), whole, on the CPU of this process: the job's state plus "model",
        "optimizer" and "reference" (None when not saved), each {name: tensor}. For tests and inspection."""
        path = path or self.latest()
        if path is None:
            raise FileNotFoundError(f"no checkpoint in {self.root}")
        groups: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optimizer": {}, "reference": {}}
        for key, tensor in saved_tensors(path).items():
            group, name = key.split("/", 1)
            groups[group][name] = tensor
        job = json.loads((path / "job.json").read_text())["job"]
        return {**job, **groups, "reference": groups["reference"] or None}

    def remove_all(self) -> int:
        """Delete this format's (and earlier formats') checkpoint folders and unfinished writes in `root`, nothing
        else; returns how many checkpoints were removed."""
        return share(self._remove_own)

    def _remove_own(self) -> int:
        removed = 0
        if self.root.is_dir():
            for p in self.root.iterdir():
                if _own(p):
                    shutil.rmtree(p)
                    removed += _STEP.match(p.name) is not None
        return removed
