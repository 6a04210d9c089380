import os
import sys

# Tests import the packages from the repository root, whatever the working directory.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.models.hf_oracle import transformers_cpu  # noqa: E402

# The tests run many small ops; on a 2-core machine a second intra-op thread mostly adds contention
# (measured: the KDA reference step 10 ms with one thread, up to 175 ms with two under load).
torch.set_num_threads(1)

# On a GPU, fla's kernels run with the configs tuned for it (`models.ops.tuned_configs`), as in the benchmarks and the
# RL job, and before fla is imported (it reads the folder once): fla's stock recurrence kernels and the tree's chain
# variant of them (`models.ops.kda.chains`) then run the same tiles. fla's tensor cache is the size the job and the
# benchmarks give it (`models.ops.kernel_environment`); the kernel cache folder stays the user's.
if torch.cuda.is_available():
    from models.ops.kernel_environment import FLA_TENSOR_CACHE_ENV, FLA_TENSOR_CACHE_SIZE  # noqa: E402
    from models.ops.tuned_configs import use_tuned_configs  # noqa: E402

    os.environ.setdefault(FLA_TENSOR_CACHE_ENV, str(FLA_TENSOR_CACHE_SIZE))
    use_tuned_configs(torch.cuda.get_device_name(0))

# transformers binds fla's Triton kernels into its Qwen3-Next / Kimi-Linear modeling modules when they are first
# imported with fla importable, and those kernels fail on CPU ("0 active drivers"). Import the modules once, with fla
# hidden, before any test module can import them: every later import (test oracles, tests of the norm ops, vLLM)
# then gets the plain-torch fallbacks, whatever the test order.
transformers_cpu()


def pytest_collection_modifyitems(config, items):
    """Tests marked `pipeline` skip, with the reason, where the installed torch cannot run pipeline parallelism."""
    # Imported here, after transformers_cpu() ran: parallel.config imports the model packages.
    from parallel.config import pipeline_support

    if pipeline_support() is None:
        return
    skip = pytest.mark.skip(reason=f"torch {torch.__version__} runs no pipeline parallelism (needs >= 2.14); ./run.sh "
                                   "test runs these tests in .venv-pipeline (./run.sh test-pipeline)")
    for item in items:
        if item.get_closest_marker("pipeline") is not None:
            item.add_marker(skip)


@pytest.fixture(params=["flash", "fa4"])
def cuda_attention_pair(request):
    """Each CUDA attention kernel pair in turn, by name, for the test to pass to the ops or a model
    (`KernelSettings.attention`); fa4 skips, with the reason, where flash-attn-4 cannot run
    (`models.ops.varlen_attention.check_cuda_attention`)."""
    from models.ops.varlen_attention import check_cuda_attention

    try:
        check_cuda_attention(request.param)
    except RuntimeError as e:
        pytest.skip(str(e))
    return request.param


@pytest.fixture
def clean_kernel_env(monkeypatch):
    """None of the variables `models.ops.kernel_environment.use_kernel_environment` sets, nor their records
    (`models.ops.own_env`), during the test, and what the test writes to them undone after it."""
    from models.ops.kernel_cache import FA4_CACHE_ENV, FA4_CACHE_ON_ENV, TRITON_CACHE_ENV
    from models.ops.kernel_environment import FLA_TENSOR_CACHE_ENV
    from models.ops.own_env import own_name
    from models.ops.tuned_configs import CACHE_MODE_ENV, CONFIG_DIR_ENV

    for name in (TRITON_CACHE_ENV, FA4_CACHE_ENV, FA4_CACHE_ON_ENV, CONFIG_DIR_ENV, CACHE_MODE_ENV,
                 FLA_TENSOR_CACHE_ENV):
        for variable in (name, own_name(name)):
            monkeypatch.setenv(variable, "")  # so that monkeypatch restores what the code under test writes
            monkeypatch.delenv(variable)


@pytest.fixture
def no_fa4(monkeypatch):
    """flash-attn-4 not importable, whether or not it is installed here."""
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)


@pytest.fixture
def fake_fa4(monkeypatch):
    """fa4 selectable without flash-attn-4 (its kernels are never called: CPU tensors run the reference)."""
    from models.ops.varlen_attention import kernels

    monkeypatch.setattr(kernels, "require_fa4", lambda: None)
