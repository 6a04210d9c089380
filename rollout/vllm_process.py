"""The vLLM rollout engine in a child process of its own, for one rank of a torchrun job.

In the trainer's process vLLM joins the trainer's world: its `init_distributed_environment` builds groups over every
rank of the already-initialised default process group (and reads torchrun's RANK / WORLD_SIZE / MASTER_*), so an
engine on rank 0 alone waits for the other ranks forever. Here the engine runs in a "spawn" child whose environment
has the torchrun variables removed before vLLM is imported: a fresh interpreter with no process group, so vLLM's
"uni" executor forms its own world of size 1 on a free port.

The child serves `rollout.vllm_engine.VLLMEngine` over a pipe, one request at a time. Weights travel as a temporary
safetensors file (in /dev/shm when it exists) that the child streams tensor by tensor into `update_weights`; the
parent's tensors are copied once, there is no pickling of tensors through the pipe. Sleep levels 1 and 2 would keep
the child's GPU memory, not the trainer's, so only the interface's methods are forwarded (no sleep / wake).
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import weakref
from typing import Iterable, Sequence

import torch

from rollout.engine import Engine, EngineError, GenerationRequest, GenerationResult
from rollout.vllm_engine import VLLMEngineConfig

__all__ = ["VLLMProcessEngine", "TORCHRUN_VARIABLES"]

#: Environment variables of torchrun / torchelastic that must not reach vLLM (besides every TORCHELASTIC_*).
TORCHRUN_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
)
_SHUTDOWN_SECONDS = 30.0


def _single_process_environment() -> None:
    for name in list(os.environ):
        if name in TORCHRUN_VARIABLES or name.startswith("TORCHELASTIC_"):
            del os.environ[name]


def _streamed(path: str) -> Iterable[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def _serve(config: VLLMEngineConfig, conn) -> None:
    """Child process: start the engine, then answer (method, args) messages until "close" or a closed pipe."""
    _single_process_environment()
    from rollout.vllm_engine import VLLMEngine

    try:
        engine = VLLMEngine(config)
    except BaseException as exc:  # noqa: BLE001 - every startup failure is reported to the parent
        conn.send(("error", _portable(exc)))
        return
    conn.send(("ok", (engine.vocab_size, engine.max_model_len, engine.startup_seconds)))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        if method == "close":
            conn.send(("ok", None))
            return
        try:
            if method == "generate":
                result = engine.generate(*args)
            elif method == "update_weights":
                engine.update_weights(_streamed(*args))
                result = engine.weight_version
            else:
                raise NotImplementedError(f"the vLLM engine process has no method {method!r}")
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
            conn.send(("error", _portable(exc)))
        else:
            conn.send(("ok", result))


def _portable(exc: BaseException) -> Exception:
    """The exception as the parent should raise it: the same class when it pickles, else EngineError."""
    import pickle

    message = f"{type(exc).__name__}: {exc}"
    if exc.__cause__ is not None:
        message += f" (caused by {type(exc.__cause__).__name__}: {exc.__cause__})"
    if isinstance(exc, (ValueError, TypeError, NotImplementedError, EngineError)):
        try:
            pickle.dumps(exc)
            return exc
        except Exception:  # noqa: BLE001 - fall back to the message
            pass
    return EngineError(f"vLLM engine process: {message}")


def _stop(process, conn) -> None:
    if process.is_alive():
        try:
            conn.send(("close", ()))
            if conn.poll(_SHUTDOWN_SECONDS):
                conn.recv()
        except (OSError, EOFError):
            pass
        process.join(_SHUTDOWN_SECONDS)
        if process.is_alive():
            process.terminate()
            process.join(_SHUTDOWN_SECONDS)
    conn.close()


class VLLMProcessEngine(Engine):
    """`VLLMEngine` in a spawned child process with a single-process world; same settings, same results.

    Attributes:
        startup_seconds: wall time of the child's `LLM(...)` construction (the child's interpreter start and
            `import vllm` come on top).
        weight_version: number of completed update_weights calls.
        pid: the child's process id.
    """

    def __init__(self, config: VLLMEngineConfig) -> None:
        if config.distributed_executor_backend != "uni":
            raise ValueError(
                "VLLMProcessEngine runs one single-process vLLM world; `distributed_executor_backend` must be 'uni', "
                f"got {config.distributed_executor_backend!r}"
            )
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_serve, args=(config, child_conn), name="vllm-engine")
        self._process.start()
        child_conn.close()
        self._stop = weakref.finalize(self, _stop, self._process, self._conn)
        self.pid = self._process.pid
        self._vocab_size, self._max_model_len, self.startup_seconds = self._receive("startup")
        self.weight_version = 0
        self._folder = tempfile.mkdtemp(prefix="arbor-weights-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        weakref.finalize(self, _remove_folder, self._folder)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        return self._call("generate", (list(requests),))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write the tensors to one safetensors file, let the child stream it into vLLM, then delete it."""
        from safetensors.torch import save_file

        path = os.path.join(self._folder, f"update-{self.weight_version + 1}.safetensors")
        try:
            # A copy per tensor: safetensors refuses shared or non-contiguous storage, DTensors are not accepted.
            save_file({name: t.detach().to("cpu", copy=True).contiguous() for name, t in named_tensors}, path)
            self.weight_version = self._call("update_weights", (path,))
        finally:
            if os.path.exists(path):
                os.remove(path)

    def close(self) -> None:
        """Stop the child process (also done when this object is collected or the interpreter exits)."""
        self._stop()

    def _call(self, method: str, args: tuple):
        if not self._process.is_alive():
            raise EngineError(f"the vLLM engine process {self.pid} is not running (exit code {self._process.exitcode})")
        self._conn.send((method, args))
        return self._receive(method)

    def _receive(self, what: str):
        try:
            status, value = self._conn.recv()
        except EOFError:
            self._process.join(_SHUTDOWN_SECONDS)
            raise EngineError(
                f"the vLLM engine process {self.pid} died during {what} (exit code {self._process.exitcode}); "
                "its output above says why"
            ) from None
        if status == "error":
            raise value
        return value


def _remove_folder(folder: str) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
