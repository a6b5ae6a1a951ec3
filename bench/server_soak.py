"""Does one long-lived ``grpo-run serve`` server slow down over many training runs? One server
(started once, never restarted), ``--runs`` asynchronous training runs in a row against it
(``rollout.max_staleness: 1`` with partial rollouts: generation aborted in flight at each push,
resumed on the new weights), ``--steps`` steps each. A probe thread reads, every ``--probe``
seconds, the server's processes from ``/proc`` (resident memory, threads, open files) and vLLM's
own ``/metrics`` (KV-cache use, requests running and waiting); each run's ``metrics.jsonl``
gives the step and generation times. Prints one row per run (first and last tenth of its steps
side by side) and writes every probe and step as JSON to ``--out``.

    python bench/server_soak.py specs/quickstart.yaml --model DIR \\
        --server-python .venv-vllm/bin/python --runs 3 --steps 100

A flat server has the same generation time, memory, thread and file counts in the last run as in
the first, and no request left running or waiting between runs.

``--load RUN:STEP:PROCS`` adds load on purpose: from step ``STEP`` of run ``RUN`` to that run's end,
``PROCS`` busy processes share the server's core (pinned beside it; unpinned with ``--no-pin``).
It tells a server that slows by itself from one that slows while its machine is busy: the loaded
run's generation time rises with the load, and the run after it shows whether it comes back down.
Each run's row counts the drift warnings its log holds (``rollout.drift_bound``: a server whose
generation slows past the bound within a run is named). Nothing here is part of the test
run but its ``--help`` and the load's parts (``tests/bench/test_scripts_run.py``): it needs vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overlap import SECRET, Server, _pinned, group_members  # noqa: E402

#: vLLM's Prometheus gauges read from ``/metrics`` (the KV-cache one was renamed in vLLM 0.10).
GAUGES = {
    "kv_cache": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
}


def server_processes(pgid: int) -> dict:
    """Resident memory (MiB), threads and open files of the server's live processes."""
    rss = threads = files = 0
    for entry, _ in group_members(pgid):
        try:
            status = (entry / "status").read_text()
            files += len(os.listdir(entry / "fd"))
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1])
            elif line.startswith("Threads:"):
                threads += int(line.split()[1])
    return {"rss_mib": rss / 1024, "threads": threads, "files": files}


def engine_gauges(url: str) -> dict:
    """The :data:`GAUGES` from the server's ``/metrics`` (summed over label sets); {} if unreadable."""
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {SECRET}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            text = answer.read().decode()
    except OSError:
        return {}
    found: dict = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for key, names in GAUGES.items():
            if name in names:
                found[key] = found.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


class Probe(threading.Thread):
    """Reads :func:`server_processes` and :func:`engine_gauges` every ``every`` seconds."""

    def __init__(self, server: Server, every: float):
        super().__init__(daemon=True)
        self.server, self.every, self.rows, self.current = server, every, [], -1
        self.started, self.done = time.monotonic(), threading.Event()

    def sample(self) -> dict:
        row = {"t": time.monotonic() - self.started, "run": self.current, **server_processes(self.server.proc.pid),
               **engine_gauges(self.server.url)}
        self.rows.append(row)
        return row

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.sample()


class Load:
    """``procs`` busy processes on ``core`` (None: unpinned), from :meth:`start` to :meth:`stop`."""

    def __init__(self, procs: int, core: int | None):
        self.procs, self.core, self.children, self.window = procs, core, [], [None, None]

    def start(self, t: float) -> None:
        command = _pinned(self.core, [sys.executable, "-c", "while True: pass"])
        self.children = [subprocess.Popen(command) for _ in range(self.procs)]
        self.window[0] = t

    def stop(self, t: float) -> None:
        for child in self.children:
            child.kill()
            child.wait()
        if self.children:
            self.window[1] = t
        self.children = []


def parse_load(text: str | None) -> tuple[int, int, int] | None:
    if text is None:
        return None
    try:
        run, step, procs = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"--load {text!r}: expected RUN:STEP:PROCS, three whole numbers (e.g. 1:10:2)") from None
    return run, step, procs


def _steps_done(metrics: Path) -> int:
    try:
        return sum(1 for line in metrics.read_text().splitlines() if '"loss"' in line)
    except OSError:
        return 0


def train(args, server: Server, index: int, out: Path, load: Load | None = None, load_from: int = 0,
          clock=None) -> list[dict]:
    """One training run against ``server``: its step rows. With ``load``, the load starts once
    the run has logged ``load_from`` steps and stops when the run ends."""
    folder = out / f"run{index}"
    sets = [f"train.output_dir={folder}", "tracking=[]", "train.progress=false", f"train.seed={index}",
            f"train.steps={args.steps}", "train.threads=1", f"model={{path: {args.model}}}",
            "rollout.name=vllm-server", f"rollout.urls=[{server.url}]", "rollout.max_staleness=1",
            "rollout.partial_rollouts=true", "checkpoint.every=0", *args.set]
    command = [sys.executable, "-m", "grpo_core.cli", "run", args.spec, "--overwrite",
               *[x for s in sets for x in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "GRPO_SERVE_SECRET": SECRET}
    with open(out / f"run{index}.log", "w") as log:
        proc = subprocess.Popen(_pinned(args.learner_core, command), env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                if load is not None and load.window[0] is None and _steps_done(folder / "metrics.jsonl") >= load_from:
                    load.start(clock())
                time.sleep(1.0)
        finally:
            if load is not None:
                load.stop(clock())
            if proc.poll() is None:
                proc.kill()
    if proc.returncode:
        raise SystemExit(f"run {index} failed ({proc.returncode}); see {out / f'run{index}.log'}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r]


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else float("nan")


def drift_warnings(log: Path) -> int:
    """The drift check's warnings in a run's log (``plugins/rollout/drift.py``)."""
    try:
        return log.read_text(errors="replace").count("slower than at the start of the run")
    except OSError:
        return 0


def summary(index: int, steps: list[dict], probes: list[dict]) -> dict:
    """A run's first and last tenth of steps side by side, and the server at its start and end."""
    tenth = max(len(steps) // 10, 1)
    head, tail = steps[1:1 + tenth] or steps, steps[-tenth:]
    mine = [p for p in probes if p["run"] == index]
    first, last = (mine[0], mine[-1]) if mine else ({}, {})
    return {
        "run": index, "steps": len(steps),
        "generate_s": (_median(head, "time/generate"), _median(tail, "time/generate")),
        "step_s": (_median(head, "time/step"), _median(tail, "time/step")),
        **{key: (first.get(key, float("nan")), last.get(key, float("nan")))
           for key in ("rss_mib", "threads", "files", "kv_cache", "running", "waiting")},
    }


def table(rows: list[dict]) -> str:
    keys = ("generate_s", "step_s", "rss_mib", "threads", "files", "kv_cache", "running", "waiting")
    head = "| run | steps | " + " | ".join(f"{k} first → last" for k in keys) + " | load | drift warnings |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        cells = " | ".join(f"{r[k][0]:.3g} → {r[k][1]:.3g}" for k in keys)
        loaded = f"{r['load']['procs']} procs from step {r['load']['from_step']}" if r.get("load") else "none"
        lines.append(f"| {r['run']} | {r['steps']} | {cells} | {loaded} | {r.get('drift_warnings', 0)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--model", required=True, help="a transformers folder, loaded by the learner and the server")
    parser.add_argument("--server-python", default=sys.executable, help="a Python with vLLM, for the server")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--probe", type=float, default=5.0, help="seconds between two probes of the server")
    parser.add_argument("--learner-core", type=int, default=0)
    parser.add_argument("--server-core", type=int, default=1)
    parser.add_argument("--no-pin", action="store_true", help="run both sides unpinned")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--out", default="bench/runs/server_soak")
    parser.add_argument("--set", action="append", default=[], help="extra key=value for every learner run")
    parser.add_argument("--load", metavar="RUN:STEP:PROCS", help="busy processes beside the server from step STEP "
                        "of run RUN to its end (e.g. 1:10:2)")
    args = parser.parse_args(argv)
    load_at = parse_load(args.load)
    if args.no_pin:
        args.learner_core = args.server_core = None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = Server(args.server_python, args.model, args.server_core, out / "server.log", args.max_model_len)
    results, steps_by_run = [], {}
    try:
        server.wait(600)
        probe = Probe(server, args.probe)
        probe.sample()
        probe.start()
        loads = {}
        for index in range(args.runs):
            probe.current = index
            probe.sample()
            load = Load(load_at[2], args.server_core) if load_at and load_at[0] == index else None
            steps_by_run[index] = train(args, server, index, out, load, load_at[1] if load else 0,
                                        lambda: time.monotonic() - probe.started)
            probe.sample()
            results.append(summary(index, steps_by_run[index], probe.rows))
            results[-1]["drift_warnings"] = drift_warnings(out / f"run{index}.log")
            if load is not None:
                loads[index] = {"procs": load.procs, "from_step": load_at[1], "window_t": load.window}
                results[-1]["load"] = loads[index]
            (out / "soak.json").write_text(json.dumps({"summary": results, "probes": probe.rows,
                                                       "steps": steps_by_run, "load": loads}, indent=1))
        probe.done.set()
    finally:
        server.stop()
    text = table(results) + "\n"
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
