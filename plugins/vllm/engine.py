"""A vLLM engine inside this process, as the ``vllm`` backend (:mod:`grpo_plugins.vllm.colocated`)
builds and feeds it: the model files it is built from (:func:`write_model_files`, no weights),
the weights it computes in (:func:`engine_dtype`) and loads on each worker
(:func:`load_on_worker`), the torch threads it must not take over (:func:`keep_torch_threads`),
the shared memory it leaves behind (:func:`shared_memory_segments`), and this process's place
among the launcher's (:func:`process_layout`). vLLM is imported by the caller, never here.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import socket
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "engine_dtype", "keep_torch_threads", "load_on_worker", "process_layout", "shared_memory_segments",
    "unlink_shared_memory", "write_model_files",
]


# --------------------------------------------------------------------------- model and weights
def write_model_files(model: Any, tokenizer: Any, folder: str, processor: Any = None) -> None:
    """The policy's (base model's) config, with ``architectures``, and tokenizer (the
    processor, for prompts with images) in ``folder``: what vLLM reads to build the model;
    no weights."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")  # GGUF: the weights pushed are plain floats
    config.architectures = [type(base).__name__]
    config.save_pretrained(folder)
    (processor or tokenizer).save_pretrained(folder)


def engine_dtype(llm: Any) -> torch.dtype:
    """The dtype the engine computes in (what ``dtype: auto`` resolved to)."""
    return llm.llm_engine.model_config.dtype


def load_on_worker(worker: Any, weights: Iterable[tuple[str, Tensor]]) -> None:
    """Run by ``llm.collective_rpc`` on each vLLM worker: load ``weights`` (checkpoint
    names and layout; a list, or a generator the worker pulls from as it loads, which the
    engine in this process can take) into its model.

    vLLM post-processes some weights after loading (on CPU it repacks every linear weight
    for its kernels and leaves an empty parameter behind; quantized layers do the same on
    GPUs), so writing into the module's parameters again would not reach what it computes
    with. Its worker's ``reload_weights(weights_iterator=...)`` (vLLM 0.32 has it; older
    ones reload from disk only) restores the checkpoint layout, loads and re-runs that
    post-processing; a vLLM without it gets the plain ``load_weights``, right for
    unprocessed (float, unquantized) weights on a GPU.
    """
    runner = worker.model_runner
    reload = getattr(runner, "reload_weights", None)  # the worker's passes *args, **kwargs on to it
    if reload is not None and "weights_iterator" in inspect.signature(reload).parameters:
        worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        return
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    model.load_weights(weights)


# --------------------------------------------------------------------------- processes
@contextlib.contextmanager
def keep_torch_threads() -> Iterator[None]:
    """Leave ``torch``'s intra-op thread count, and ``torch.set_num_threads`` itself, as
    they were before building a vLLM engine inside the block.

    vLLM's CPU worker binds its OpenMP threads to cores (``VLLM_CPU_OMP_THREADS_BIND``,
    which sets the thread count to the cores bound) and replaces ``torch.set_num_threads``
    with a no-op for the whole process, so that ``train.threads`` and any later setting
    would silently stop applying. Engine and trainer share this process's thread pool: the
    user's count applies to both.
    """
    setter, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = setter
        torch.set_num_threads(threads)


_SHM = "/dev/shm"


def shared_memory_segments() -> set[str]:
    """The names of vLLM's CPU shared-memory segments (``...-cpushm_<rank>``) now present."""
    try:
        return {name for name in os.listdir(_SHM) if "-cpushm_" in name}
    except OSError:
        return set()


def unlink_shared_memory(names: set[str]) -> None:
    """Remove the shared-memory segments this process's engine made (tensor parallelism on
    the CPU). vLLM frees them in a C++ destructor at process exit, which a process of a
    multi-process run skips (:func:`grpo_core.cli.exit_process`); left behind, their fixed
    names make the next engine of the same layout fail with EEXIST."""
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(_SHM, name))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_layout() -> tuple[int, int]:
    """``(rank, world size)`` of this process; sets the launcher variables of a world of
    one when no launcher did (vLLM's external_launcher reads them)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    return 0, 1
