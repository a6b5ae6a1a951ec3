"""The overlap of generation and training measured where it can pay: the learner in one process,
a ``grpo-run serve`` rollout server in another, each pinned to a core of its own (``taskset``),
synchronous (``rollout.max_staleness: 0``) against ``max_staleness: 1`` without and with partial
rollouts (``rollout.partial_rollouts``).

    python bench/overlap.py specs/quickstart.yaml --model DIR --seeds 0 1 2 --steps 40 \\
        --server-python .venv-vllm/bin/python --out bench/runs/overlap

``--model`` is a transformers folder both sides load (the server cannot read the quickstart's
GGUF file: export it once with ``save_pretrained``); ``--server-python`` a Python with vLLM (the
server's environment; the learner runs in this one). Each run gets a server of its own, started
fresh, so no run inherits the engine state of the one before. Per run: the median step time (first step excluded), the
learner's busy and idle time per step (CPU seconds of its process over the run, against wall
time), the server's (CPU seconds of its processes, read from ``/proc``, over the run), the learner's
wait for batches and the actor's wait for weights, the token staleness and the mid-batch weight
switches of the partial runs, and the last held-out accuracy. Prints a markdown table and
writes it, with every run's figures as JSON, to ``--out``. Nothing here is part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CONFIGS = {  # name -> (max_staleness, partial_rollouts)
    "sync": (0, False),
    "async": (1, False),
    "partial": (1, True),
}
SECRET = "grpo-bench-overlap"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pinned(core: int | None, command: list[str]) -> list[str]:
    if core is None:
        return command
    if shutil.which("taskset") is None:
        raise SystemExit("taskset is not installed (util-linux): pass --no-pin to run unpinned")
    return ["taskset", "-c", str(core), *command]


def group_members(pgid: int):
    """``(entry, stat fields after the name)`` of every live process of process group ``pgid``
    (``/proc``); the fields start with the state, the parent and the group."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            yield entry, fields


def _group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) of every live process of process group ``pgid``."""
    tick = os.sysconf("SC_CLK_TCK")
    return sum(int(fields[11]) + int(fields[12]) for _, fields in group_members(pgid)) / tick


class Server:
    """One ``grpo-run serve`` process group, pinned."""

    def __init__(self, python: str, model: str, core: int | None, log: Path, max_model_len: int):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPO_SERVE_SECRET": SECRET, "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"}
        command = [python, "-m", "grpo_core.cli", "serve", model, "--port", str(self.port), "--dtype", "float32",
                   "--max-model-len", str(max_model_len), "--enforce-eager"]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(_pinned(core, command), stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.log = log

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise SystemExit(f"the server was not up in {timeout_s:.0f} s:\n{self.log.read_text()[-3000:]}")

    def cpu_seconds(self) -> float:
        return _group_cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else float("nan")


def run_one(args, server: Server, config: str, seed: int, out: Path) -> dict:
    k, partial = CONFIGS[config]
    folder = out / f"{config}-seed{seed}"
    sets = [f"train.output_dir={folder}", "tracking=[]", "train.progress=false", f"train.seed={seed}",
            f"train.steps={args.steps}", "train.threads=1", f"model={{path: {args.model}}}",
            "rollout.name=vllm-server", f"rollout.urls=[{server.url}]", f"rollout.max_staleness={k}",
            f"rollout.partial_rollouts={'true' if partial else 'false'}", *args.set]
    command = [sys.executable, "-m", "grpo_core.cli", "run", args.spec, "--overwrite",
               *[x for s in sets for x in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "GRPO_SERVE_SECRET": SECRET}
    before_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_before = server.cpu_seconds()
    t0 = time.perf_counter()
    done = subprocess.run(_pinned(args.learner_core, command), env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    server_busy = server.cpu_seconds() - server_before
    after_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"run {config} seed={seed} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    learner_busy = (after_children.ru_utime + after_children.ru_stime
                    - before_children.ru_utime - before_children.ru_stime)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r]
    timed = steps[1:] or steps  # the first step pays for warm-up
    evals = [r for r in rows if "eval/rewards/accuracy" in r]
    n = max(len(steps), 1)
    return {
        "config": config, "k": k, "partial": partial, "seed": seed, "steps": len(steps), "wall_s": wall,
        "step_s": _median(timed, "time/step"),
        "learner_busy_s": learner_busy / n, "learner_idle_s": max(wall - learner_busy, 0.0) / n,
        "server_busy_s": server_busy / n, "server_idle_s": max(wall - server_busy, 0.0) / n,
        "learner_wait_s": _median(timed, "time/learner_wait") if k else 0.0,
        "actor_wait_s": _median(timed, "time/actor_wait") if k else 0.0,
        "generate_s": _median(timed, "time/generate"),
        "token_staleness": statistics.mean([r.get("async/token_staleness", r.get("async/staleness", 0.0))
                                            for r in steps]) if k else 0.0,
        "switches": sum(r.get("async/switches", 0.0) for r in steps),
        "eval_accuracy": evals[-1]["eval/rewards/accuracy"] if evals else float("nan"),
    }


def table(results: list[dict]) -> str:
    head = ("| config | seed | step s (median) | learner busy / idle s per step | server busy / idle s per step | "
            "learner wait s | actor wait s | token staleness | switches | held-out accuracy |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in results:
        lines.append(
            f"| {r['config']} | {r['seed']} | {r['step_s']:.2f} | "
            f"{r['learner_busy_s']:.2f} / {r['learner_idle_s']:.2f} | "
            f"{r['server_busy_s']:.2f} / {r['server_idle_s']:.2f} | {r['learner_wait_s']:.2f} | "
            f"{r['actor_wait_s']:.2f} | {r['token_staleness']:.2f} | {r['switches']:.0f} | {r['eval_accuracy']:.3f} |")
    for config in CONFIGS:
        mine = [r for r in results if r["config"] == config]
        if mine:
            lines.append(f"| {config} | mean | {statistics.mean(r['step_s'] for r in mine):.2f} | | | | | | | "
                         f"{statistics.mean(r['eval_accuracy'] for r in mine):.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--model", required=True, help="a transformers folder, loaded by the learner and the server")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    parser.add_argument("--server-python", default=sys.executable, help="a Python with vLLM, for the server")
    parser.add_argument("--learner-core", type=int, default=0)
    parser.add_argument("--server-core", type=int, default=1)
    parser.add_argument("--no-pin", action="store_true", help="run both sides unpinned")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--out", default="bench/runs/overlap")
    parser.add_argument("--set", action="append", default=[], help="extra key=value for every learner run")
    args = parser.parse_args(argv)
    if args.no_pin:
        args.learner_core = args.server_core = None
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)}; valid: {', '.join(CONFIGS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        for config in configs:
            # A fresh server per run: a run must not inherit the engine state (caches, aborted
            # requests, memory) of the runs before it, or the order of the runs shows in the figures.
            server = Server(args.server_python, args.model, args.server_core,
                            out / f"{config}-seed{seed}.server.log", args.max_model_len)
            try:
                server.wait(600)
                results.append(run_one(args, server, config, seed, out))
            finally:
                server.stop()
            (out / "results.json").write_text(json.dumps({"runs": results}, indent=2))
    text = table(results) + "\n"
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
