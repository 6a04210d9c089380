"""Atomic, engine-independent checkpoints of the trainer: one folder per step, `<dir>/step-00000012/state.pt`.

A checkpoint holds what the next step depends on: model and optimizer state, RNG states, the step counters, the
reference policy (when a KL term uses one) and the TensorBoard run name. The rollout engine holds no state of its own:
a resumed run starts a fresh engine from the checkpointed weights.

Atomicity: a checkpoint is written into `step-N.tmp`, flushed to disk, and renamed to `step-N`; a folder named
`step-N` is therefore always complete, and a run killed while writing leaves only a `.tmp` folder, which the next
run removes.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["Checkpointer", "rng_state", "set_rng_state"]

_NAME = re.compile(r"^step-(\d{8})$")


def rng_state() -> dict[str, Any]:
    """States of Python's, numpy's and torch's global generators (and CUDA's when present)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    """Checkpoints in folder `root`, keeping the newest `keep`."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""
        if not self.root.is_dir():
            return []
        found = (_NAME.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def remove_all(self) -> int:
        """Delete every checkpoint and unfinished write in `root`; returns how many checkpoints were removed."""
        steps = self.steps()
        if self.root.is_dir():
            for p in self.root.iterdir():
                if p.is_dir() and (_NAME.match(p.name) or p.name.endswith(".tmp")):
                    shutil.rmtree(p)
        return len(steps)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write `state` as the checkpoint of `step` (replacing an existing one) and prune old ones."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        tmp = final.with_name(final.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        with open(tmp / "state.pt", "wb") as f:
            torch.save(state, f)
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
            shutil.rmtree(self.path(s))
        return final

    def load(self, path: Path | None = None) -> dict[str, Any]:
        """The newest checkpoint (or `path`) on CPU."""
        path = path or self.latest()
        if path is None:
            raise FileNotFoundError(f"no checkpoint in {self.root}")
        # Our own files: they hold RNG states and optimizer state, not just tensors.
        return torch.load(path / "state.pt", map_location="cpu", weights_only=False)
