"""Folders written whole or not at all: write a new folder beside the current one, flush it, then swap it in.

    fsync_dir(folder)                 flush a folder's entries (new, renamed or removed files) to disk
    fsync_tree(folder)                flush every file of a folder, then the folder
    replace_folder(new, final, old)   put the complete folder `new` in place of `final`
    restore_aside(final, old)         undo a swap that a crash cut between its two renames

Checkpoints (app.checkpoint) and the Hugging Face export (app.export) are written this way, so a reader never sees
a half-written one under the final name.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["fsync_dir", "fsync_tree", "replace_folder", "restore_aside"]


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Flush every regular file directly in `folder`, then `folder` itself."""
    for path in folder.iterdir():
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(folder)


def replace_folder(new: Path, final: Path, old: Path) -> None:
    """Put the complete, flushed folder `new` in place of `final`: an existing `final` is renamed to `old`, `new` to
    `final`, then `old` is removed. A crash between the two renames leaves the previous folder whole at `old` (and
    the new one at `new`); whoever writes `final` next calls `restore_aside` first."""
    if final.exists():
        os.replace(final, old)
        os.replace(new, final)
        shutil.rmtree(old)
    else:
        os.replace(new, final)
    fsync_dir(final.parent)


def restore_aside(final: Path, old: Path) -> bool:
    """After a crash between `replace_folder`'s renames: move the previous folder back from `old` to `final` (when
    `final` is missing); returns whether it did."""
    if old.is_dir() and not final.exists():
        os.replace(old, final)
        return True
    return False
