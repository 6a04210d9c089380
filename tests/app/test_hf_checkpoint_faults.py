"""A bad `model.hf_path` checkpoint stops the job before any work with one `error:` line naming the file (and the
tensor) and the fix, and exit code 2: a tensor of another shape than config.json implies, a missing tensor, no
safetensors file, a truncated one, an index naming a missing shard, no config.json, one that does not parse or one
that names an architecture that cannot be loaded.

The cases call `main` in this process (an escaping exception would fail the test, so returning 2 with one stderr
line shows there is no traceback); one runs `python -m app` in a subprocess to show the same for the real command.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from app.__main__ import main
from app.config import ModelSection
from app.policy import architecture
from models.decoder import HybridForCausalLM
from models.hf_io import save_hf
from models.presets import preset
from rollout.tokenizer import build_char_tokenizer
from tests.app.jobs import write_job

ROOT = Path(__file__).resolve().parents[2]
CONFIG_ERROR = 2
#: The tensor the broken checkpoints change or lack.
TENSOR = "model.layers.3.self_attn.o_proj.weight"
#: The width and vocabulary of the job in tests/app/jobs.py.
WIDTH, VOCAB = 64, 128
#: Shard size of the sharded checkpoints: 3 shards of the narrow model's 4.2 MB.
SHARD_BYTES = 2 << 20


@pytest.fixture(scope="module")
def policy() -> HybridForCausalLM:
    """A narrow tiny-qwen3-next of the job's width and vocabulary."""
    return HybridForCausalLM(dataclasses.replace(preset("tiny-qwen3-next"), vocab_size=VOCAB, hidden_size=WIDTH))


def save_checkpoint(model: HybridForCausalLM, folder: Path, **save) -> Path:
    """save_hf (with `save`'s options) and the character tokenizer in `folder`; returns it."""
    save_hf(model, folder, **save)
    build_char_tokenizer(VOCAB).save_pretrained(folder)
    return folder


def edit_tensors(folder: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite `folder`'s model.safetensors with `edit` applied to its tensors."""
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def wrong_shape(folder: Path) -> str:
    edit_tensors(folder, lambda t: t.__setitem__(TENSOR, t[TENSOR][:, :-1].contiguous()))
    return (rf"{re.escape(str(folder / 'model.safetensors'))}: tensor '{re.escape(TENSOR)}' has shape \({WIDTH}, "
            rf"\d+\), but config\.json implies \({WIDTH}, \d+\); the weights do not match config\.json")


def missing_tensor(folder: Path) -> str:
    edit_tensors(folder, lambda t: t.pop(TENSOR))
    return rf"{re.escape(str(folder / 'model.safetensors'))} lacks tensor '{re.escape(TENSOR)}'"


def no_safetensors(folder: Path) -> str:
    (folder / "model.safetensors").unlink()
    return (rf"{re.escape(str(folder))} has neither model\.safetensors nor model\.safetensors\.index\.json: put the "
            "checkpoint's safetensors weights beside its config.json")


def truncated(folder: Path) -> str:
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-1000])
    return (rf"{re.escape(str(file))} is truncated: it has {len(data) - 1000} bytes, its header names tensor data up "
            rf"to byte {len(data)}; copy it again")


def missing_shard(folder: Path) -> str:
    shard = sorted(folder.glob("model-*.safetensors"))[1].name
    (folder / shard).unlink()
    return (rf"{re.escape(str(folder / 'model.safetensors.index.json'))} names shard {re.escape(shard)} \(for "
            rf"'.+' and \d+ more\), but {re.escape(str(folder / shard))} does not exist")


def no_config_json(folder: Path) -> str:
    (folder / "config.json").unlink()
    return rf"{re.escape(str(folder))} is not a Hugging Face checkpoint \(no config\.json\)"


def config_not_json(folder: Path) -> str:
    (folder / "config.json").write_text('{"architectures": ["Qwen3NextForCausalLM"],')
    return rf"{re.escape(str(folder / 'config.json'))} is not readable JSON \(.+\); fix it or re-export"


def other_architecture(folder: Path) -> str:
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(raw, architectures=["LlamaForCausalLM"])))
    return (rf"{re.escape(str(folder / 'config.json'))}: config\.json `architectures` = \['LlamaForCausalLM'\]: only "
            r"\['KimiLinearForCausalLM', 'Qwen3NextForCausalLM'\] can be loaded")


#: case -> (save_hf options, how the case breaks a checkpoint folder and the error line it expects).
CASES = {
    "wrong-shape": ({}, wrong_shape),
    "missing-tensor": ({}, missing_tensor),
    "no-safetensors": ({}, no_safetensors),
    "truncated": ({}, truncated),
    "missing-shard": ({"max_shard_bytes": SHARD_BYTES}, missing_shard),
    "no-config-json": ({}, no_config_json),
    "config-not-json": ({}, config_not_json),
    "other-architecture": ({}, other_architecture),
}


def broken_checkpoint(policy: HybridForCausalLM, tmp_path: Path, case: str) -> tuple[Path, str]:
    """(checkpoint folder broken as `case` says, the regex its error line must match after `model.hf_path`)."""
    save, breaks = CASES[case]
    folder = save_checkpoint(policy, tmp_path / "policy", **save)
    return folder, breaks(folder)


def job_argv(tmp_path: Path, folder: Path) -> list[str]:
    """`python -m app`'s arguments: the small torch-engine job on checkpoint `folder`."""
    return [str(write_job(tmp_path)), f"--model.hf_path={folder}", "--model.vocab_size=none",
            "--model.hidden_size=none"]


def assert_nothing_written(tmp_path: Path) -> None:
    assert not any((tmp_path / name).exists() for name in ("ck", "hf", "tb"))


def test_a_sound_checkpoint_passes(policy, tmp_path):
    folder = save_checkpoint(policy, tmp_path / "policy", max_shard_bytes=SHARD_BYTES)
    assert len(list(folder.glob("model-*-of-00003.safetensors"))) == 3
    assert architecture(ModelSection(hf_path=str(folder))) == policy.config


@pytest.mark.parametrize("case", CASES)
def test_bad_checkpoint_stops_the_job_before_any_work(policy, tmp_path, capsys, case):
    folder, message = broken_checkpoint(policy, tmp_path, case)
    assert main(job_argv(tmp_path, folder)) == CONFIG_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.fullmatch(r"error: `model\.hf_path`: " + message + ".*", err[0]), err[0]
    assert_nothing_written(tmp_path)


def test_truncated_checkpoint_stops_the_command(policy, tmp_path):
    folder, message = broken_checkpoint(policy, tmp_path, "truncated")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "app", *job_argv(tmp_path, folder)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == CONFIG_ERROR and "Traceback" not in done.stderr + done.stdout, done.stderr
    (line,) = [s for s in done.stderr.splitlines() if s.strip()]
    assert re.fullmatch(r"error: `model\.hf_path`: " + message + ".*", line), line
    assert_nothing_written(tmp_path)
