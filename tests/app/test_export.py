"""The HF export is written whole or not at all: a new folder swapped in, files as readable as config.json, a
failing write leaving the previous export byte for byte, stale shards dropped, other entries carried over, and an
export cut between its two renames moved back by the next one."""

from __future__ import annotations

import dataclasses
import os
import stat

import pytest
import torch

import models.hf_io
from app.errors import ExportError
from app.export import export_policy
from models.decoder import HybridForCausalLM
from models.hf_io import load_hf
from models.presets import tiny_qwen3_next
from rollout import build_char_tokenizer


def policy(hidden_size: int = 32) -> HybridForCausalLM:
    torch.manual_seed(hidden_size)
    return HybridForCausalLM(dataclasses.replace(tiny_qwen3_next(), vocab_size=128, hidden_size=hidden_size))


def contents(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_export_files_are_readable_as_config_json_and_load(tmp_path):
    old = os.umask(0o022)
    try:
        export_policy(policy(), build_char_tokenizer(), tmp_path / "hf")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644, modes
    assert set(modes.values()) == {0o644}
    assert load_hf(tmp_path / "hf").config.hidden_size == 32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_failing_export_keeps_the_previous_one_byte_for_byte(tmp_path, monkeypatch):
    folder = tmp_path / "hf"
    export_policy(policy(64), build_char_tokenizer(), folder)
    before = contents(folder)
    written = []
    save_file = models.hf_io.save_file

    def full_disk(tensors, path, metadata=None):
        save_file(tensors, path, metadata=metadata)
        written.append(path)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(models.hf_io, "save_file", full_disk)
    with pytest.raises(ExportError, match=rf"writing {tmp_path}/.hf.tmp failed \(OSError: \[Errno 28\] No space left "
                                          rf"on device\); removed it, {folder} keeps the previous export$"):
        export_policy(policy(128), build_char_tokenizer(), folder)
    assert written, "the failure came from the writer"
    assert contents(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    with pytest.raises(ExportError, match=r"failed \(.*\); removed it, no export was written$"):
        export_policy(policy(128), build_char_tokenizer(), tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_stale_shards_go_and_other_entries_stay(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"stale shard")
    (folder / "model.safetensors.index.json").write_text("{}")
    (folder / "NOTES.md").write_text("the user's")
    (folder / ".arbor.lock").write_text("{}")
    export_policy(policy(), build_char_tokenizer(), folder)
    names = {p.name for p in folder.iterdir()}
    assert {"NOTES.md", ".arbor.lock", "config.json", "model.safetensors"} <= names
    assert not names & {"model-00002-of-00002.safetensors", "model.safetensors.index.json"}
    assert (folder / "NOTES.md").read_text() == "the user's"


def test_an_export_cut_between_its_renames_is_moved_back_first(tmp_path):
    folder = tmp_path / "hf"
    export_policy(policy(), build_char_tokenizer(), folder)
    before = contents(folder)
    # Killed after the previous export was renamed aside, before the new one was renamed in.
    os.replace(folder, tmp_path / ".hf.old")
    (tmp_path / ".hf.tmp").mkdir()
    (tmp_path / ".hf.tmp" / "config.json").write_text("{")
    export_policy(policy(), build_char_tokenizer(), folder)
    assert contents(folder) == before  # the same policy again: the same bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
