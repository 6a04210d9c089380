import pytest
import torch


@pytest.fixture(autouse=True)
def jobs_see_no_gpu(monkeypatch):
    """The app's tests are CPU runs (float64 equalities, gloo ranks): on a machine with a GPU, the jobs they start, in
    this process or through torchrun, see none (`train.device` "auto" resolves to the CPU, `parallel.launch` picks
    gloo). Tests of the job's CUDA choices fake the device themselves (`resolve_device`)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
