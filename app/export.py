"""The policy's Hugging Face export (`checkpoint.export_dir`), written whole or not at all.

    <parent>/.<name>.tmp   the new export: config.json, safetensors, tokenizer files, each flushed to disk
    <parent>/<name>        swapped in by renames (app.folder_swap); the previous export is removed after

A failed export (a full disk, any error of the writers) removes `.<name>.tmp` and leaves the previous export whole;
a killed one leaves `.<name>.tmp` (or, between the two renames, the previous export at `.<name>.old`), which the
next export removes (or moves back). Files are readable as the process's umask allows, like config.json. Entries of
the previous folder that the new export does not write move into the new one (the run's lock file, a user's notes),
except safetensors files and their index: a smaller model has fewer shards.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from app.checkpoint import failure_line
from app.errors import ExportError
from app.folder_swap import fsync_tree, replace_folder, restore_aside
from models.decoder import HybridForCausalLM
from models.hf_io import save_hf

__all__ = ["export_policy"]


def _stale(name: str) -> bool:
    """An entry of a previous export that a new export replaces even when it does not write it."""
    return name.endswith(".safetensors") or name.endswith(".safetensors.index.json")


def _write(policy: HybridForCausalLM, tokenizer, folder: Path) -> None:
    """The export's files into the new folder `folder`, with config.json's permissions, flushed to disk."""
    folder.mkdir()
    save_hf(policy, folder)
    tokenizer.save_pretrained(folder)
    mode = (folder / "config.json").stat().st_mode & 0o777  # created by open(): 0o666 less the umask
    for path in folder.iterdir():
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)
    fsync_tree(folder)


def export_policy(policy: HybridForCausalLM, tokenizer, folder: str | Path) -> None:
    """Write `policy` and `tokenizer` in Hugging Face layout to `folder`, replacing the previous export whole.

    Raises:
        ExportError: the export could not be written; the previous export is kept as it was.
    """
    final = Path(folder)
    tmp = final.with_name(f".{final.name}.tmp")
    old = final.with_name(f".{final.name}.old")
    restore_aside(final, old)
    for leftover in (tmp, old):
        if leftover.exists():
            shutil.rmtree(leftover)
    carried: list[str] = []
    try:
        _write(policy, tokenizer, tmp)
        if final.is_dir():
            written = {p.name for p in tmp.iterdir()}
            for entry in final.iterdir():
                if entry.name not in written and not _stale(entry.name):
                    os.replace(entry, tmp / entry.name)
                    carried.append(entry.name)
        replace_folder(tmp, final, old)
    except Exception as e:  # any writer error: the previous export stays whole
        restore_aside(final, old)
        if final.is_dir():
            for name in carried:
                os.replace(tmp / name, final / name)
        shutil.rmtree(tmp, ignore_errors=True)
        kept = f"{final} keeps the previous export" if final.is_dir() else "no export was written"
        raise ExportError(f"writing {tmp} failed ({failure_line(e)}); removed it, {kept}") from None
