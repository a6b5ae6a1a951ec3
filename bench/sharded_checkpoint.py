"""Checkpoint memory and time under fsdp2: the gathered form against the sharded one.

A random Llama built from a config (no download; about 0.48B parameters by default: hidden 1024,
32 layers, MLP 2816, vocabulary 32000, untied) is sharded with the engine's FSDP2
(:func:`grpo_core.train.learner.sharding.shard`) on ``--nproc`` processes (gloo on CPU) and
given an AdamW state (one step on zero gradients). Each process builds only its own shards
(the model is allocated uninitialised, its pages untouched, and each process fills its
shards). Then, in the same processes:

- ``gathered``: what ``checkpoint.format: gathered`` does: the whole weights and optimizer
  state gathered on the main process's CPU (``full_state_dict``, ``optimizer_state``), written
  by it (``save_pretrained`` + ``state.pt``, manifest, rename: :func:`grpo_core.checkpoint.write_checkpoint`);
  loaded back as a resume does (every process reads the whole files and keeps its shard);
- ``sharded``: what ``checkpoint.format: sharded`` does: each process writes its own shards
  with ``torch.distributed.checkpoint`` into the main process's temporary folder and records
  them, the main one commits the folder (:func:`grpo_core.train.learner.sharding.save_shards`,
  :func:`grpo_core.checkpoint.commit_write`); loaded back with
  :func:`~grpo_core.train.learner.sharding.load_shards`.

Per process and operation: ``own_MB``, the bytes of its own shards (weights and AdamW
moments); ``peak_above_MB``, its peak resident memory during the operation above what it held
before (``VmHWM`` after resetting it through ``/proc/self/clear_refs``), the memory the
operation itself costs; and the operation's time. The table gives the largest figure over the
processes.

    python bench/sharded_checkpoint.py                 # ~0.48B parameters, 2 processes
    python bench/sharded_checkpoint.py --tiny          # a tiny model, seconds
    python bench/sharded_checkpoint.py --layers 8      # smaller, when memory is short
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="processes (gloo)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tiny", action="store_true", help="hidden 64, 2 layers, MLP 128, vocabulary 256")
    p.add_argument("--out", type=Path, default=None, help="folder for the checkpoints (default: a temporary one)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.hidden, args.layers, args.intermediate, args.vocab = 64, 2, 128, 256
    return args


# --------------------------------------------------------------------------- one process
def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class Measure:
    """Peak resident memory above the start, and the time, of the operations run under it."""

    def __init__(self, dist):
        self.dist, self.rows = dist, {}

    def __call__(self, name: str, fn) -> None:
        import gc

        gc.collect()
        self.dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before, start = _rss_mb("VmRSS"), time.perf_counter()
        fn()
        self.dist.barrier()
        self.rows[name] = {"seconds": time.perf_counter() - start, "peak_above_MB": _rss_mb("VmHWM") - before}


def _local_mb(tensors) -> float:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total / 2**20


def _build(args, dist):
    """The sharded random model and its AdamW state, each process making only its shards."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_core.spec.parallel import ParallelSection
    from grpo_core.train.learner import sharding

    config = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=args.intermediate,
                         vocab_size=args.vocab, num_attention_heads=max(1, args.hidden // 64),
                         num_key_value_heads=max(1, args.hidden // 64), tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")  # untouched pages: fully_shard copies out each process's chunk only
    sharding.shard(model, ParallelSection(strategy="fsdp2"), torch.device("cpu"))
    generator = torch.Generator().manual_seed(dist.rank)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()
            local.copy_(torch.randn(local.shape, generator=generator) * 0.02)
        for b in model.buffers():  # rotary frequencies: recomputed as the model's own init does
            b.zero_()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def operations(model, optimizer, dist, root: Path) -> dict:
    """The four operations, as the engine's checkpoints make them, on the FSDP2 ``model`` and
    its ``optimizer`` in ``dist``'s processes, writing under ``root``: name -> function."""
    from grpo_core import checkpoint as ckpt
    from grpo_core.train.learner import sharding
    from grpo_core.train.learner.parallel import FSDP2

    strategy = FSDP2(dist, None)

    def gathered_save():
        weights = strategy.model_state(model)
        optim, fmt = strategy.optimizer_state(model, optimizer)
        if dist.is_main:
            ckpt.write_checkpoint(root / "gathered", 1, model, {"optimizer": optim, "optimizer_format": fmt},
                                  keep=1, weights=weights)

    def gathered_load():
        folder = ckpt.step_folder(root / "gathered", 1)
        ckpt.load_model_weights(model, folder, strategy.load_model_state)
        state = ckpt.load_state(folder / ckpt.STATE)
        strategy.load_optimizer_state(model, optimizer, state["optimizer"], state["optimizer_format"])

    def sharded_save():
        tmp = ckpt.temp_folder(root / "sharded", 1, dist.gather(os.getpid())[0])
        if dist.is_main:
            ckpt.begin_write(root / "sharded", 1)
        dist.barrier()
        sharding.save_shards(model, optimizer, tmp / ckpt.SHARDS)
        own_files = sorted((tmp / ckpt.SHARDS).glob(f"__{dist.rank}_*"))
        records = dist.gather(ckpt.file_records(tmp, own_files) if not dist.is_main else {})
        if dist.is_main:
            ckpt.commit_write(root / "sharded", 1, tmp, 1, None, files={k: v for r in records for k, v in r.items()})

    def sharded_load():
        sharding.load_shards(model, optimizer, ckpt.step_folder(root / "sharded", 1) / ckpt.SHARDS)

    return {"gathered save": gathered_save, "gathered load": gathered_load, "sharded save": sharded_save,
            "sharded load": sharded_load}


def own_mb(model, optimizer) -> float:
    """MB of this process's own shards: weights and AdamW moments."""
    moments = [v for state in optimizer.state.values() for v in state.values() if v.dim()]
    return _local_mb(list(model.parameters()) + moments)


def worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    from grpo_core.train.distributed import Dist, close_process_group

    dist = Dist.from_env("cpu", timeout_s=3600)
    model, optimizer = _build(args, dist)
    own, params = own_mb(model, optimizer), sum(p.numel() for p in model.parameters())
    measure = Measure(dist)
    for name, fn in operations(model, optimizer, dist, args.out).items():
        measure(name, fn)
    rows = {name: {**row, "own_MB": own} for name, row in measure.rows.items()}
    (args.worker / f"rank{dist.rank}.json").write_text(json.dumps({"params": params, "rows": rows}))
    close_process_group()


# --------------------------------------------------------------------------- the launcher
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args) -> dict:
    """Run the workers; the largest figure over them per operation."""
    with tempfile.TemporaryDirectory(prefix="sharded-ckpt-") as scratch:
        scratch = Path(scratch)
        out = args.out or scratch / "checkpoints"
        port, procs = _free_port(), []
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(args.nproc),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        forwarded = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--intermediate",
                     str(args.intermediate), "--vocab", str(args.vocab), "--out", str(out), "--worker", str(scratch)]
        for rank in range(args.nproc):
            procs.append(subprocess.Popen([sys.executable, __file__, *forwarded],
                                          env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a worker failed: exit codes {codes}")
        results = [json.loads((scratch / f"rank{r}.json").read_text()) for r in range(args.nproc)]
    names = list(results[0]["rows"])
    worst = {name: {k: max(r["rows"][name][k] for r in results) for k in results[0]["rows"][name]} for name in names}
    return {"params": results[0]["params"], "nproc": args.nproc, "rows": worst}


def table(figures: dict) -> str:
    lines = [f"{figures['params'] / 1e6:,.1f}M parameters, {figures['nproc']} processes (largest figure over them)",
             "| operation | own shards (MB) | peak above own (MB) | time (s) |", "|---|---:|---:|---:|"]
    for name, row in figures["rows"].items():
        lines.append(f"| {name} | {row['own_MB']:.0f} | {row['peak_above_MB']:.0f} | {row['seconds']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return 0
    figures = launch(args)
    print(table(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
