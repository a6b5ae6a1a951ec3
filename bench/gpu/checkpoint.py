"""Part 7, checkpoints of a sharded policy (``checkpoint.format``): on one GPU, in a process
group of one (NCCL), a random Qwen2.5-0.5B (the tiny Qwen2 on the CPU) sharded by the engine's
FSDP2 strategy with an AdamW state is checkpointed in both forms and loaded back, with the
operations ``bench/sharded_checkpoint.py`` measures on the CPU
(:func:`sharded_checkpoint.operations`): ``gathered`` (the whole weights and optimizer state
gathered to the CPU, ``save_pretrained`` + ``state.pt``) and ``sharded`` (each process's shards
written by ``torch.distributed.checkpoint`` straight from the GPU). Per operation: seconds, the
GPU allocator's peak above what it held before (GiB) and the host's resident peak above it
(MiB); then whether the sharded load restored the weights and the AdamW moments bit for bit.
With one process the shards are the whole tensors: what the GPU answers is the time, the device
and host memory each form costs, and that NCCL, CUDA tensors and DCP work together.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import torch
from common import QWEN25_05B, TINY_QWEN

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the CPU benchmark's operations
import sharded_checkpoint  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(record: Any, device: torch.device, work: Path, args: Any) -> None:
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, **kwargs)
    shape = TINY_QWEN if args.tiny or device.type == "cpu" else QWEN25_05B
    record.note(backend=dist.get_backend(), shape=shape)
    try:
        record.check("sharded_vs_gathered", lambda: _compare(device, work / "checkpoints", shape))
    finally:
        dist.destroy_process_group()


def _policy(device: torch.device, shape: dict[str, Any]):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_core.spec.parallel import ParallelSection
    from grpo_core.train.distributed import Dist
    from grpo_core.train.learner.parallel import FSDP2

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    engine = Dist(0, 1, device)
    FSDP2(engine, ParallelSection(strategy="fsdp2")).setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, engine


def _compare(device: torch.device, root: Path, shape: dict[str, Any]) -> dict[str, Any]:
    from common import reset_peak, sync

    model, optimizer, engine = _policy(device, shape)
    out: dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters()),
                           "own_mib": sharded_checkpoint.own_mb(model, optimizer)}
    ops = sharded_checkpoint.operations(model, optimizer, engine, root)
    saved = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    moments = [s["exp_avg_sq"].full_tensor().clone() for s in optimizer.state.values()]
    for name, fn in ops.items():
        if name == "sharded load":  # what it must restore, overwritten first
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
                for s in optimizer.state.values():
                    s["exp_avg_sq"].zero_()
        reset_peak(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        Path("/proc/self/clear_refs").write_text("5")
        rss = sharded_checkpoint._rss_mb("VmRSS")
        clock = sharded_checkpoint.time.perf_counter()
        fn()
        sync(device)
        key = name.replace(" ", "_")
        out[f"{key}_seconds"] = sharded_checkpoint.time.perf_counter() - clock
        out[f"{key}_host_peak_above_mib"] = sharded_checkpoint._rss_mb("VmHWM") - rss
        if device.type == "cuda":
            out[f"{key}_gpu_peak_above_gib"] = (torch.cuda.max_memory_allocated(device) - before) / 2**30
    out["sharded_load_bit_exact"] = all(
        torch.equal(p.detach().full_tensor(), saved[n]) for n, p in model.named_parameters()) and all(
        torch.equal(s["exp_avg_sq"].full_tensor(), m) for s, m in zip(optimizer.state.values(), moments))
    out["ok"] = out["sharded_load_bit_exact"]
    return out
