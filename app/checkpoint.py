"""Checkpoints of a run, one folder per step in one format for one process and for N ranks:

    <dir>/step-12/
        .metadata, __0_0.distcp, __1_0.distcp ...   the trainer's tensors: model, AdamW state, KL reference
                                                    (parallel.checkpoint.TrainingState: DCP, one shard file per rank)
        job.json                                    the job's own state: step counters, run name, RNG states, and
                                                    the SHA-256 of every other file of the folder

A checkpoint holds what the next step depends on. The rollout engine holds no state of its own: a resumed run starts a
fresh engine from the checkpointed weights. DCP reshards on load, so a run moves between one process and N ranks.

- Atomic: a checkpoint is written into `step-N.tmp` (shards, then job.json, each flushed to disk) and renamed to
  `step-N`, so a folder named `step-N` is complete. A run killed while writing leaves `step-N.tmp`; the next run
  removes it. A write that fails (a full disk, any error of the writer on any rank) removes its `step-N.tmp`, keeps
  the older checkpoints and raises `CheckpointWriteError`.
- Resume: the newest checkpoint whose files are all there, readable, equal to their checksums and finite. Newer ones
  that are not are reported (one line each, naming the bad file) and skipped. An error: one that would run code,
  one of an earlier Arbor format (`state.pt`, or DCP without job.json), one written for another model.
- Own folders only: a fresh run moves the `step-N` folders it finds into `<dir>/previous-run` (replacing the set
  kept there) and deletes them once its own first checkpoint is written, so a fresh run killed early leaves the
  earlier run's checkpoints; nothing else in `<dir>` is touched (app.folder_lock keeps other runs out of it).
- Never runs code from a file: job.json is JSON; tensors go through `parallel.checkpoint`'s checked DCP reader.
- Finite: a checkpoint with a NaN or inf tensor is refused before anything is written (`check_finite` does the same
  for other writers, e.g. the HF export).
"""

from __future__ import annotations

import base64
import hashlib
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

from app.errors import CheckpointError, CheckpointWriteError, NonFiniteError
from app.folder_swap import fsync_dir, replace_folder, restore_aside
from parallel.checkpoint import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    TrainingState,
    UnsafeCheckpointError,
    read_metadata,
    save_tensors,
    saved_tensors,
)
from parallel.ranks import all_values, first_found, rank_and_size, share

__all__ = ["Checkpointer", "Restored", "check_finite", "first_non_finite", "failure_line", "rng_state", "set_rng_state",
           "FORMAT", "PREVIOUS_RUN"]

FORMAT = "arbor-checkpoint-1"
_STEP = re.compile(r"^step-(\d+)$")
_OWN_FOLDER = re.compile(r"^step-\d+(\.old)?(\.tmp)?$")
#: Files of this format and of the earlier ones (state.pt; DCP without job.json).
_OWN_FILE = re.compile(r"^(\.metadata(\.tmp)?|__\d+_\d+\.distcp|job\.json|state\.pt)$")
#: Where a fresh run keeps the checkpoints it found until it has written one of its own.
PREVIOUS_RUN = "previous-run"


def failure_line(e: BaseException) -> str:
    """One line saying what `e` is: its type and first sentence; for DCP's CheckpointException (which collects the
    ranks' exceptions), the first rank's exception."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = str(e).strip().splitlines()[0].split(". ")[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _checksummed(folder: Path) -> list[str]:
    """The files of a checkpoint folder that job.json records checksums of: all but job.json, sorted."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != "job.json")


def _my_part(names: list[str]) -> list[str]:
    """This rank's share of `names` (every rank hashes a part of a checkpoint's files)."""
    rank, size = rank_and_size()
    return names[rank::size]


def _mismatched(folder: Path, checksums: dict[str, str]) -> str | None:
    """(this rank's part of the files) The first file of `folder` that is missing or differs from its recorded
    SHA-256, as a line naming it; None when all match."""
    for name in _my_part(sorted(checksums)):
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        try:
            digest = _sha256(path)
        except OSError as e:
            return f"{path} is unreadable ({e})"
        if digest != checksums[name]:
            return f"{path} does not match its checksum in job.json (the file is corrupt)"
    return None


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
    """Checkpoints in folder `root`, keeping the newest `keep`. `save`, `restore` and `set_aside` are collectives
    under a process group (rank 0 handles the folders; every rank writes its shards and hashes a part of the
    files)."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep
        self.resumed_from: Path | None = None
        """The checkpoint `restore` loaded, until this run writes its first checkpoint."""

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
        existing one; prune to the newest `keep`.

        Raises:
            NonFiniteError: a tensor is not finite (nothing is written).
            CheckpointWriteError: writing failed on some rank (its `step-N.tmp` is removed, older checkpoints kept).
            CheckpointError: a foreign folder is in the way.
        """
        tensors = state.tensors()
        bad = first_found(first_non_finite(tensors))
        if bad is not None:
            raise NonFiniteError(f"checkpoint of step {step} refused: {bad} has non-finite values (NaN or inf); "
                                 f"{self.root} keeps the earlier checkpoints (resume from one with a smaller "
                                 f"`train.lr` / `train.sft_lr`){self._resumed_note()}")
        final = self.path(step)
        tmp = final.with_name(final.name + ".tmp")
        share(lambda: self._in_the_way(tmp, final, step))
        parts = all_values(self._write(tensors, tmp))
        failure = next((f for _, f in parts if f is not None), None)
        if failure is None:
            checksums = {name: digest for part, _ in parts for name, digest in part.items()}
            text = json.dumps({"format": FORMAT, "step": step, "job": job, "sha256": checksums})
            try:
                share(lambda: self._finish(tmp, final, text))
            except Exception as e:  # share raises rank 0's exception on every rank
                failure = failure_line(e)
        if failure is not None:
            share(lambda: shutil.rmtree(tmp, ignore_errors=True))
            kept = ", ".join(f"step-{s}" for s in share(self.steps)) or "no checkpoint"
            raise CheckpointWriteError(f"writing {tmp} failed ({failure}); removed it, {self.root} keeps {kept}")
        self.resumed_from = None
        share(self._prune)
        return final

    def _resumed_note(self) -> str:
        if self.resumed_from is None:
            return ""
        return (f"; this run resumed from {self.resumed_from} and has written no checkpoint since, so the values may "
                f"come from that checkpoint: move {self.resumed_from.name} out of {self.root} to resume from the one "
                "before it")

    def _in_the_way(self, tmp: Path, final: Path, step: int) -> None:
        for folder in (final, tmp):
            if folder.exists() and not _own(folder):
                raise CheckpointError(f"`checkpoint.dir`: {folder} is in the way of the checkpoint of step {step} and "
                                      "holds other files than a checkpoint's: move it out of the checkpoint folder")

    def _write(self, tensors: dict[str, torch.Tensor], tmp: Path) -> tuple[dict[str, str], str | None]:
        """(every rank) A fresh `tmp` (rank 0), the shards, then the SHA-256 of this rank's part of the files:
        (checksums, None), or ({}, what failed)."""
        try:
            share(lambda: self._fresh(tmp))
            save_tensors(tensors, tmp)
            return {name: _sha256(tmp / name) for name in _my_part(_checksummed(tmp))}, None
        except (Exception, CheckpointException) as e:  # any writer error (DCP's is a BaseException): the caller
            # removes tmp and keeps the older ones
            return {}, failure_line(e)

    def _fresh(self, tmp: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()

    def _finish(self, tmp: Path, final: Path, text: str) -> None:
        with open(tmp / "job.json", "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        replace_folder(tmp, final, final.with_name(final.name + ".old.tmp"))

    def _prune(self) -> None:
        """Keep the newest `keep` checkpoints; drop the earlier run's set aside (this run has one of its own now)."""
        for s in self.steps()[: -self.keep]:
            if _own(self.path(s)):
                shutil.rmtree(self.path(s))
        self._drop_previous_run()

    def _drop_previous_run(self) -> None:
        aside = self.root / PREVIOUS_RUN
        if aside.is_dir() and not aside.is_symlink():
            for p in aside.iterdir():
                if _own(p):
                    shutil.rmtree(p)
            if not any(aside.iterdir()):
                aside.rmdir()

    def set_aside(self) -> int:
        """A fresh run's start: remove unfinished writes and move the `step-N` checkpoints into `<root>/previous-run`
        (replacing the checkpoints kept there), where they stay until this run's first checkpoint is written;
        returns how many were moved (0: `previous-run` is left as it is)."""
        return share(self._set_aside)

    def _set_aside(self) -> int:
        self._remove_unfinished()
        found = [p for p in self._candidates() if _own(p)]
        if not found:
            return 0
        self._drop_previous_run()
        aside = self.root / PREVIOUS_RUN
        aside.mkdir(exist_ok=True)
        for p in found:
            os.replace(p, aside / p.name)
        fsync_dir(aside)
        fsync_dir(self.root)
        return len(found)

    def restore(self, state_for: Callable[[set[str]], TrainingState]) -> Restored:
        """Load the newest usable checkpoint into `state_for(groups)`, where `groups` are the saved ones ("model",
        "optimizer", "reference"); unfinished writes are removed first. Usable: its files are there, match their
        checksums (checkpoints written before checksums were recorded are loaded unverified, with a note) and hold
        finite values.

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
            job, checksums = checked
            groups = share(lambda: self._groups(path))
            if isinstance(groups, str):
                skipped.append(f"{path.name}: {groups}")
                continue
            corrupt = first_found(_mismatched(path, checksums)) if checksums is not None else None
            if corrupt is not None:
                skipped.append(f"{path.name}: {corrupt}")
                continue
            state = state_for(groups)
            try:
                state.load(path)
            except CorruptCheckpointError as e:
                skipped.append(f"{path.name}: {e}")
                continue
            except CheckpointException as e:
                skipped.append(f"{path.name}: reading it failed ({failure_line(e)})")
                continue
            except UnsafeCheckpointError as e:
                raise _refused(path, e) from None
            except CheckpointMismatchError as e:
                raise CheckpointError(f"`checkpoint.resume`: {e}: the checkpoint was written for another model; "
                                      "resume with the config that wrote it, or run without --resume to start fresh"
                                      ) from None
            bad = first_found(first_non_finite(state.tensors()))
            if bad is not None:
                skipped.append(f"{path.name}: {bad} has non-finite values (NaN or inf)")
                continue
            notes += [f"skipped the unusable checkpoint {s}" for s in skipped]
            if checksums is None:
                notes.append(f"{path} records no checksums (an earlier version wrote it): loaded unverified")
            self.resumed_from = path
            return Restored(job, path, notes)
        detail = f" is usable ({'; '.join(skipped)})" if skipped else ""
        aside = self.root / PREVIOUS_RUN
        earlier = (f"; the checkpoints of the run before the last fresh start are in {aside}: move its step-N "
                   f"folders back into {self.root} to resume that run") if share(aside.is_dir) else ""
        raise CheckpointError(f"`checkpoint.resume`: no checkpoint in {self.root}{detail}{earlier}; run without "
                              "--resume to start fresh")

    def _remove_unfinished(self) -> list[str]:
        """Remove unfinished writes (`step-N.tmp`); a replacement cut between its renames gets its complete
        earlier folder (`step-N.old.tmp`) back first."""
        notes = []
        if self.root.is_dir():
            for p in sorted(self.root.iterdir()):
                m = re.match(r"^(step-\d+)\.old\.tmp$", p.name)
                if m and _own(p) and restore_aside(self.root / m.group(1), p):
                    notes.append(f"restored {self.root / m.group(1)} from an interrupted replacement")
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

    def _check(self, path: Path) -> tuple[dict[str, Any], dict[str, str] | None] | str:
        """(job state, SHA-256 per file or None when not recorded) of a complete checkpoint, else what is wrong with
        it."""
        if (path / "state.pt").exists():
            raise CheckpointError(
                f"`checkpoint.resume`: {path} is a checkpoint of Arbor's earlier single-process format (state.pt, a "
                "pickle, which this version never loads): finish that run with the version that wrote it, or run "
                "without --resume to start fresh (which moves it to `previous-run`)")
        if not (path / "job.json").is_file():
            if (path / ".metadata").is_file():
                raise CheckpointError(
                    f"`checkpoint.resume`: {path} is a checkpoint of Arbor's earlier distributed format (DCP without "
                    "job.json; its job state is a pickle, which this version never loads): finish that run with the "
                    "version that wrote it, or run without --resume to start fresh (which moves it to `previous-run`)")
            return "no job.json"
        try:
            saved = json.loads((path / "job.json").read_text())
        except (OSError, ValueError) as e:
            return f"job.json is unreadable ({e})"
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            return f"job.json is not of format {FORMAT}"
        checksums = saved.get("sha256")
        if checksums is not None and not (isinstance(checksums, dict) and ".metadata" in checksums):
            return "job.json's checksums are unreadable"
        return saved["job"], checksums

    def _groups(self, path: Path) -> set[str] | str:
        """The saved groups ("model", "optimizer", "reference") of a checkpoint, else what is wrong with it."""
        try:
            metadata = read_metadata(path)
        except CorruptCheckpointError as e:
            return str(e)
        except UnsafeCheckpointError as e:
            raise _refused(path, e) from None
        return {key.split("/", 1)[0] for key in metadata.state_dict_metadata}

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
