"""One run per output folder: `FolderLock(folder, key)` creates `folder` and holds `folder/.arbor.lock` for the run.

The lock is an flock(2) on that file, held until `release()` (or until the process ends, however it ends: the
kernel drops the flock of a killed process). The file holds the owner's pid, host and start time: a second run
stops at once with a `ConfigError` naming that owner, and a run that finds the file of a run that ended without
releasing it (kill -9) takes the lock over and says so (`took_over`). Where the file system has no flock, the pid
decides instead: the lock of a pid that no longer runs on this host is stale; one of another host is not.

The checkpoint folder, the HF export folder and the TensorBoard folder each get one (app.trainer `own`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import weakref
from pathlib import Path

from app.errors import ConfigError

__all__ = ["FolderLock", "LOCK_FILE"]

LOCK_FILE = ".arbor.lock"
#: flock(2) errors meaning "this file system does not lock".
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


def _owner(fd: int) -> dict | None:
    """The lock file's content (None when empty or unreadable: a run killed while writing it)."""
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        owner = json.loads(os.read(fd, 4096) or b"null")
    except ValueError:
        return None
    return owner if isinstance(owner, dict) else None


def _describe(owner: dict | None) -> str:
    if owner is None:
        return "owner unknown"
    return f"pid {owner.get('pid')} on host {owner.get('host')}, started {owner.get('started')}"


def _running_here(owner: dict) -> bool:
    """The owner's pid runs on this host."""
    if owner.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    there = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _release(fd: int, path: Path) -> None:
    if _same_file(fd, path):
        os.unlink(path)
    os.close(fd)


class FolderLock:
    """Create `folder` (parents too) and take its lock; `key` (e.g. "checkpoint.dir") names it in errors.

    Raises:
        ConfigError: the folder cannot be created or written, or another run holds it.
    """

    def __init__(self, folder: str | Path, key: str) -> None:
        self.folder = Path(folder)
        self.key = key
        self.path = self.folder / LOCK_FILE
        self.took_over: str | None = None
        """The owner of a stale lock taken over ("pid 12 on host h, started ..."), else None."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = self._acquire()
        except OSError as e:
            raise ConfigError(f"`{key}` = {self.folder}: cannot create or write the folder ({e.strerror or e}); "
                              "choose a folder this user can write") from None
        self._finalizer = weakref.finalize(self, _release, fd, self.path)

    def _acquire(self) -> int:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                stale = self._lock(fd)
            except BaseException:
                os.close(fd)
                raise
            if not _same_file(fd, self.path):
                # The owner released (removed) the file between our open and our flock: lock the new file.
                os.close(fd)
                continue
            if stale is not None:
                self.took_over = _describe(stale)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                      "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
            os.fsync(fd)
            return fd

    def _lock(self, fd: int) -> dict | None:
        """Lock the open file `fd`; returns the stale owner found in it (None if the file was empty)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._busy(_owner(fd)) from None
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise
            owner = _owner(fd)
            if owner is not None and (owner.get("host") != socket.gethostname() or _running_here(owner)):
                raise self._busy(owner) from None
            return owner
        return _owner(fd)

    def _busy(self, owner: dict | None) -> ConfigError:
        return ConfigError(f"`{self.key}` = {self.folder} is in use by another run ({_describe(owner)}): wait for it "
                           f"to end or choose another folder (if that run is gone, delete {self.path})")

    def release(self) -> None:
        """Remove the lock file and drop the lock (again: nothing)."""
        self._finalizer()
