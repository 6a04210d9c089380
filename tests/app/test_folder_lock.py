"""One run per output folder: a second lock is refused naming the owner, a killed owner's lock is taken over, a
released lock leaves no file, folders that cannot be created are named by their config key; the job stops a second
run with one error line."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import app.folder_lock
from app.__main__ import main
from app.errors import ConfigError
from app.folder_lock import LOCK_FILE, FolderLock
from tests.app.jobs import write_job

ROOT = Path(__file__).resolve().parents[2]
HOST = socket.gethostname()


def dead_pid() -> int:
    """The pid of a process that has ended."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_second_lock_is_refused_naming_the_owner_and_release_removes_the_file(tmp_path):
    folder = tmp_path / "a" / "ck"
    lock = FolderLock(folder, "checkpoint.dir")
    assert lock.took_over is None
    owner = json.loads((folder / LOCK_FILE).read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == HOST
    with pytest.raises(ConfigError, match=rf"`checkpoint.dir` = {folder} is in use by another run \(pid {os.getpid()} "
                                          f"on host {HOST}, started .*\\): wait for it to end or choose another "
                                          "folder"):
        FolderLock(folder, "checkpoint.dir")
    lock.release()
    lock.release()
    assert list(folder.iterdir()) == []
    FolderLock(folder, "checkpoint.dir").release()


def test_lock_of_a_killed_run_is_taken_over(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from app.folder_lock import FolderLock; "
         f"lock = FolderLock({str(tmp_path)!r}, 'checkpoint.dir'); print('locked', flush=True); time.sleep(60)"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(ConfigError, match=f"in use by another run \\(pid {holder.pid} on host {HOST}"):
            FolderLock(tmp_path, "checkpoint.dir")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = FolderLock(tmp_path, "checkpoint.dir")
    assert lock.took_over.startswith(f"pid {holder.pid} on host {HOST}, started ")
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_without_flock_the_pid_decides(tmp_path, monkeypatch):
    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(app.folder_lock.fcntl, "flock", no_flock)
    pid = dead_pid()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": HOST, "started": "then"}))
    lock = FolderLock(tmp_path, "metrics.log_dir")
    assert lock.took_over == f"pid {pid} on host {HOST}, started then"
    with pytest.raises(ConfigError, match=f"`metrics.log_dir` = {tmp_path} is in use by another run \\(pid "
                                          f"{os.getpid()} on host {HOST}"):
        FolderLock(tmp_path, "metrics.log_dir")
    lock.release()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": "elsewhere", "started": "then"}))
    with pytest.raises(ConfigError, match=f"\\(pid {pid} on host elsewhere, started then\\): .*\\(if that run is gone, "
                                          f"delete {tmp_path / LOCK_FILE}"):
        FolderLock(tmp_path, "metrics.log_dir")


def test_folder_that_cannot_be_created_names_its_key(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=f"`checkpoint.export_dir` = {tmp_path / 'afile' / 'hf'}: cannot create or "
                                          "write the folder"):
        FolderLock(tmp_path / "afile" / "hf", "checkpoint.export_dir")


def test_second_run_on_a_checkpoint_folder_stops_with_one_error_line(tmp_path, capsys):
    lock = FolderLock(tmp_path / "ck", "checkpoint.dir")
    (tmp_path / "ck" / "step-3").mkdir()
    assert main([str(write_job(tmp_path))]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"error: `checkpoint.dir` = {tmp_path / 'ck'} is in use by another run (pid {os.getpid()} on host {HOST}, "
        f"started {json.loads((tmp_path / 'ck' / LOCK_FILE).read_text())['started']}): wait for it to end or choose "
        f"another folder (if that run is gone, delete {tmp_path / 'ck' / LOCK_FILE})"]
    assert "Traceback" not in captured.out and (tmp_path / "ck" / "step-3").is_dir()
    lock.release()
