"""TensorBoard logging of the job: scalars per step and rollout-tree pictures.

Each fresh run writes `<log_dir>/<run name>` (a timestamp); a resumed run reopens its own folder and drops events
logged after the checkpoint it resumes from (`purge_step`), so curves continue without duplicates.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.tensorboard import SummaryWriter

__all__ = ["MetricsLog", "new_run_name"]


def new_run_name() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


class MetricsLog:
    def __init__(self, log_dir: str | Path, run_name: str, purge_step: int | None = None) -> None:
        self.path = Path(log_dir) / run_name
        self.writer = SummaryWriter(str(self.path), purge_step=purge_step)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def image(self, tag: str, step: int, image: Image.Image) -> None:
        self.writer.add_image(tag, np.asarray(image.convert("RGB")), step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
