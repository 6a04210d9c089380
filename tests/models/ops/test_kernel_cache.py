"""Which folder Triton's cache gets (models.ops.kernel_cache.use_kernel_cache): an explicit setting wins over the
user's TRITON_CACHE_DIR, which wins over the default; the folder is created, set for this process and named."""

import os

import pytest

from models.ops import kernel_cache
from models.ops.kernel_cache import (
    FA4_CACHE_ENV,
    FA4_CACHE_ON_ENV,
    FA4_SUBFOLDER,
    TRITON_CACHE_ENV,
    cache_entries,
    use_kernel_cache,
)
from models.ops.own_env import own_name


@pytest.fixture(autouse=True)
def clean_env(clean_kernel_env):
    """Every test here starts without the kernel libraries' variables (`clean_kernel_env`)."""


def test_an_explicit_folder_wins_over_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(TRITON_CACHE_ENV, str(tmp_path / "user"))
    cache = use_kernel_cache(tmp_path / "mine" / "kc", tmp_path / "default", "train.kernel_cache")
    assert cache.folder == tmp_path / "mine" / "kc" and cache.folder.is_dir()
    assert cache.source == "train.kernel_cache" and os.environ[TRITON_CACHE_ENV] == str(cache.folder)
    # On a GPU a second line names the fla configs chosen for it (`KernelCache.tuned`).
    assert cache.describe().splitlines()[0] == (f"kernel cache {cache.folder} (empty: kernels compile and autotune "
                                                "on first use, minutes; from train.kernel_cache)")


def test_the_environment_wins_over_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv(TRITON_CACHE_ENV, str(tmp_path / "user"))
    cache = use_kernel_cache(None, tmp_path / "default", "train.kernel_cache")
    assert cache.folder == tmp_path / "user" and cache.source == TRITON_CACHE_ENV and cache.folder.is_dir()
    assert not (tmp_path / "default").exists()


def test_the_default_and_a_warm_folder(tmp_path):
    for name in ("a1b2", "c3d4"):
        (tmp_path / "default" / name).mkdir(parents=True)
    cache = use_kernel_cache(None, tmp_path / "default", "--kernel-cache")
    assert cache.source == "default" and cache.entries == 2
    assert "(2 entries: kernels and shapes not among them compile on first use; from default)" in cache.describe()


def test_a_folder_set_by_an_earlier_job_is_not_the_users(tmp_path, monkeypatch):
    """Two jobs in one process: the second one's default is not overridden by the first one's folder, which the
    environment records as set here (`models.ops.own_env`); a folder the user sets afterwards is the user's."""
    use_kernel_cache(None, tmp_path / "first", "train.kernel_cache")
    assert os.environ[own_name(TRITON_CACHE_ENV)] == str(tmp_path / "first")
    cache = use_kernel_cache(None, tmp_path / "second", "train.kernel_cache")
    assert cache.folder == tmp_path / "second" and os.environ[TRITON_CACHE_ENV] == str(tmp_path / "second")
    monkeypatch.setenv(TRITON_CACHE_ENV, str(tmp_path / "user"))
    assert use_kernel_cache(None, tmp_path / "third", "train.kernel_cache").source == TRITON_CACHE_ENV


def test_nothing_set_means_tritons_own_default(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    cache = use_kernel_cache(None, None, "--kernel-cache")
    assert cache.folder == tmp_path / ".triton" / "cache" and cache.source == "Triton's default"


def test_a_folder_that_cannot_be_created_raises_oserror(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        use_kernel_cache(tmp_path / "file" / "kc", None, "--kernel-cache")


def test_flash_attn_4_keeps_its_kernels_in_the_folder_unless_the_user_chose_its_own(tmp_path, monkeypatch):
    """FlashAttention-4's disk cache goes on in the chosen folder's subfolder (not counted as a Triton entry), follows
    a second job's folder, and leaves a user's own folder and a user's "off" alone."""
    cache = use_kernel_cache(tmp_path / "kc", None, "train.kernel_cache")
    assert os.environ[FA4_CACHE_ENV] == str(tmp_path / "kc" / FA4_SUBFOLDER) and os.environ[FA4_CACHE_ON_ENV] == "1"
    (tmp_path / "kc" / FA4_SUBFOLDER).mkdir()
    assert cache.entries == 0 and cache_entries(tmp_path / "kc") == 0
    use_kernel_cache(tmp_path / "kc2", None, "train.kernel_cache")
    assert os.environ[FA4_CACHE_ENV] == str(tmp_path / "kc2" / FA4_SUBFOLDER)
    monkeypatch.setenv(FA4_CACHE_ENV, str(tmp_path / "users"))
    monkeypatch.setenv(FA4_CACHE_ON_ENV, "0")
    use_kernel_cache(tmp_path / "kc3", None, "train.kernel_cache")
    assert os.environ[FA4_CACHE_ENV] == str(tmp_path / "users") and os.environ[FA4_CACHE_ON_ENV] == "0"


@pytest.mark.parametrize("local_rank, named", [(None, 0), ("1", 1), ("4", None)])
def test_tuned_configs_of_the_gpu_this_rank_runs_on(local_rank, named, tmp_path, monkeypatch):
    """The tuned configs are those of torchrun's LOCAL_RANK device (every rank naming the current device 0 would
    open a context on GPU 0 from each), else the current device; none for a LOCAL_RANK beyond the visible GPUs."""
    import torch

    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: asked.append(index) or f"GPU {index}")
    monkeypatch.setattr(kernel_cache, "use_tuned_configs", lambda name, root: f"configs of {name} in {root.name}")
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    said = kernel_cache._tuned_configs(tmp_path / "tuned")
    assert said == ("" if named is None else f"configs of GPU {named} in tuned")
    assert asked == ([] if named is None else [named])
