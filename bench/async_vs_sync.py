"""The quickstart synchronous (``rollout.max_staleness: 0``) against asynchronous (``k``), side
by side: step time, where the time goes, and held-out accuracy, over several seeds.

    python bench/async_vs_sync.py specs/quickstart.yaml --seeds 0 1 2 --k 1 --out bench/runs/async

Each run is a ``grpo-run`` process of its own (``tracking=[]``). The synchronous runs use
``train.threads`` cores for every phase in turn; the asynchronous ones give the actor's
thread and the learner's one core each (``--async-threads``, default 1): on two cores, the
two sides each on a core of their own. Per run it reports the median step time (first step
excluded), the learner's busy and waiting time per step, the actor's generation time per
batch and its wait for weights, the wall time, and the last held-out accuracy. Prints a
markdown table and writes it, with every run's figures as JSON, to ``--out``.
Nothing here is part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
        flags = next((line for line in out.splitlines() if line.startswith("Flags")), "")
        extra = " avx512_bf16" if "avx512_bf16" in flags else (" avx2" if "avx2" in flags else "")
        return f"{name}, {os.cpu_count()} cores{extra}"
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else float("nan")


def run_one(spec: str, seed: int, k: int, threads: int, out: Path, extra: list[str]) -> dict:
    folder = out / f"k{k}-seed{seed}"
    command = [sys.executable, "-m", "grpo_core.cli", "run", spec, "--overwrite",
               "--set", f"train.output_dir={folder}", "--set", "tracking=[]", "--set", "train.progress=false",
               "--set", f"train.seed={seed}", "--set", f"rollout.max_staleness={k}",
               "--set", f"train.threads={threads}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"run k={k} seed={seed} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r][1:]  # the first step pays for warm-up
    evals = [r for r in rows if "eval/rewards/accuracy" in r]
    step = _median(steps, "time/step")
    wait = _median(steps, "time/learner_wait") if k else 0.0
    return {
        "k": k, "seed": seed, "threads": threads, "wall_s": wall, "step_s": step,
        "learner_busy_s": step - wait, "learner_wait_s": wait,
        "generate_s": _median(steps, "time/generate"), "score_s": _median(steps, "time/score"),
        "sampler_logprobs_s": _median(steps, "time/sampler_logprobs") if k else 0.0,
        "actor_wait_s": _median(steps, "time/actor_wait") if k else 0.0,
        "staleness_max": max((r.get("async/staleness", 0.0) for r in steps), default=0.0),
        "eval_accuracy": evals[-1]["eval/rewards/accuracy"] if evals else float("nan"),
        "eval_accuracy_start": evals[0]["eval/rewards/accuracy"] if evals else float("nan"),
    }


def separate_devices(results: list[dict]) -> str:
    """What the synchronous runs' phases would give with the actor and the learner on devices
    of their own and k = 1: a step of max(actor, learner) instead of their sum."""
    sync = [r for r in results if r["k"] == 0]
    if not sync:
        return ""
    actor = statistics.mean(r["generate_s"] + r["score_s"] for r in sync)
    step = statistics.mean(r["step_s"] for r in sync)
    learner = step - actor
    return (f"Synchronous step {step:.2f} s = actor (generate + score) {actor:.2f} s + learner {learner:.2f} s; "
            f"with the two on separate devices (k = 1) a step would take max = {max(actor, learner):.2f} s "
            f"({step / max(actor, learner, 1e-9):.2f}x).")


def table(results: list[dict]) -> str:
    head = ("| k | seed | step s (median) | learner busy s | learner wait s | generate s | actor wait s | "
            "max staleness | wall s | held-out accuracy (start -> end) |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in results:
        lines.append(
            f"| {r['k']} | {r['seed']} | {r['step_s']:.2f} | {r['learner_busy_s']:.2f} | {r['learner_wait_s']:.2f} | "
            f"{r['generate_s']:.2f} | {r['actor_wait_s']:.2f} | {r['staleness_max']:.0f} | {r['wall_s']:.0f} | "
            f"{r['eval_accuracy_start']:.2f} -> {r['eval_accuracy']:.2f} |"
        )
    for k in sorted({r["k"] for r in results}):
        mine = [r for r in results if r["k"] == k]
        lines.append(
            f"| {k} | mean | {statistics.mean(r['step_s'] for r in mine):.2f} | "
            f"{statistics.mean(r['learner_busy_s'] for r in mine):.2f} | "
            f"{statistics.mean(r['learner_wait_s'] for r in mine):.2f} | "
            f"{statistics.mean(r['generate_s'] for r in mine):.2f} | "
            f"{statistics.mean(r['actor_wait_s'] for r in mine):.2f} | | "
            f"{statistics.mean(r['wall_s'] for r in mine):.0f} | "
            f"{statistics.mean(r['eval_accuracy'] for r in mine):.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--k", type=int, default=1, help="the asynchronous runs' rollout.max_staleness")
    parser.add_argument("--sync-threads", type=int, default=2)
    parser.add_argument("--async-threads", type=int, default=1)
    parser.add_argument("--out", default="bench/runs/async")
    parser.add_argument("--set", action="append", default=[], help="extra --set key=value for every run")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = [x for item in args.set for x in ("--set", item)]
    results = []
    for seed in args.seeds:
        results.append(run_one(args.spec, seed, 0, args.sync_threads, out, extra))
        results.append(run_one(args.spec, seed, args.k, args.async_threads, out, extra))
        (out / "results.json").write_text(json.dumps({"cpu": _cpu(), "runs": results}, indent=2))
    text = f"CPU: {_cpu()}\n\n{table(results)}\n\n{separate_devices(results)}\n"
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
