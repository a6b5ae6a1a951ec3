"""The GPU check in one command: correctness on the device, throughput at a realistic size,
TRL side by side, and the NCCL and FSDP2 paths; results as JSON in ``--out``, a table at the end.

    python3 bench/gpu/run.py --out DIR                   # on a GPU machine (bench/gpu/README.md)
    python3 bench/gpu/run.py --out DIR --device cpu --tiny  # the same on the CPU, tiny sizes (the test run)
    python3 bench/gpu/run.py --dry-run                   # what a GPU run would send, and its command

Parts, in order (``--parts`` picks some): ``correctness``, ``nccl``, ``fsdp2``, ``sequence``,
``throughput``, ``onegpu``, ``routing``, ``checkpoint``, ``trl``; and ``overlap`` (synchronous
against asynchronous and partial rollouts on one GPU) only when named. This process imports only the
standard library: it makes the checkout importable
(``grpo_plugins`` is the ``plugins`` folder under another name), then runs the parts in a child
process that writes each part's record as it goes. A part that raises is recorded and the next
one runs; a part still running at its time limit, or one that kills its process (or the CUDA
context), is recorded as such and a fresh child runs the parts after it. Before each part the
child checks that its estimated time fits what is left of ``--budget-s``, else skips it, saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from report import print_dry_run, print_table, table_markdown  # noqa: E402  (after the path is set)

#: name -> (module, function, estimated seconds on a GPU, on the CPU with --tiny, hard limit).
PARTS: dict[str, tuple[str, str, float, float, float]] = {
    "correctness": ("correctness", "run", 45, 20, 180),
    "nccl": ("distributed", "run_channel", 15, 5, 90),
    "fsdp2": ("distributed", "run_fsdp2", 20, 10, 120),
    "sequence": ("sequence", "run", 60, 20, 240),
    "throughput": ("throughput", "run", 150, 20, 360),
    "onegpu": ("onegpu", "run", 30, 15, 180),
    "routing": ("routing", "run", 25, 10, 120),
    "checkpoint": ("checkpoint", "run", 40, 10, 180),
    "trl": ("trl_side", "run", 150, 40, 300),
    "overlap": ("overlap", "run", 240, 60, 420),
}
#: Parts that run only when --parts names them (not in the default list).
OPT_IN = ("overlap",)
#: What the GPU machine lacks; with --simulate-missing the engine's parts run with these
#: modules unimportable (the trl part needs datasets: they are importable again for it).
MISSING_ON_GPU = ("mlflow", "datasets", "math_verify", "vllm", "trl", "wandb", "tensorboard")
BLOCK_ENV = "GRPO_GPU_CHECK_BLOCK"
#: The options that size the throughput and TRL parts (passed on to the part process).
SIZE_FLAGS = ("prompts", "group_size", "new_tokens", "prompt_tokens", "micro_batch_tokens", "repeats", "peak_tflops",
              "overlap_steps")
#: Seconds kept back from --budget-s for writing the results.
RESERVE_S = 10.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, help="folder for results.json and table.md (made if missing)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--tiny", action="store_true", help="tiny sizes everywhere (the CPU mode of the test run)")
    p.add_argument("--parts", default=",".join(p for p in PARTS if p not in OPT_IN),
                   help=f"comma-separated, of: {', '.join(PARTS)} (default: all but {', '.join(OPT_IN)})")
    p.add_argument("--overlap-steps", type=int, help="overlap: steps per configuration (default 8; 3 with --tiny)")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip parts that would not fit in this many seconds")
    p.add_argument("--prompts", type=int, default=16, help="throughput and trl: prompts per step (P)")
    p.add_argument("--group-size", type=int, default=8, help="throughput and trl: completions per prompt (G)")
    p.add_argument("--new-tokens", type=int, default=512, help="throughput and trl: most new tokens per completion")
    p.add_argument("--prompt-tokens", type=int, default=128, help="throughput and trl: tokens per prompt")
    p.add_argument("--micro-batch-tokens", type=int, default=8192, help="throughput: train.micro_batch_tokens")
    p.add_argument("--repeats", type=int, default=2, help="throughput: timed updates per batch (after a warm-up)")
    p.add_argument("--peak-tflops", type=float, help="bf16 dense peak for MFU (default: by GPU name, H100 989)")
    p.add_argument("--work", type=Path, help="scratch folder (models, runs); default: a new temporary one")
    p.add_argument("--simulate-missing", action="store_true",
                   help=f"run the engine's parts with {', '.join(MISSING_ON_GPU)} unimportable, as on the GPU machine")
    p.add_argument("--dry-run", action="store_true", help="print what a GPU run would send and run; run nothing")
    p.add_argument("--quiet", action="store_true", help="--dry-run: totals only, not every file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--results", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    p.add_argument("--limit-s", default="", help="time limits instead of the parts' own (90 to 360 s): S for "
                   "every part, PART=S for one, comma-separated (e.g. throughput=500)")
    p.add_argument("--hang", help=argparse.SUPPRESS)  # the test run's fault: this part sleeps until killed
    args = p.parse_args(argv)
    args.part_list = [x.strip() for x in args.parts.split(",") if x.strip()]
    args.limits = _limits(p, args.limit_s)
    unknown = [x for x in args.part_list if x not in PARTS]
    if unknown:
        p.error(f"--parts: unknown {', '.join(unknown)}; valid: {', '.join(PARTS)}")
    if not args.dry_run and args.out is None:
        p.error("--out is required (a folder for results.json), or give --dry-run")
    return args


def _limits(parser: argparse.ArgumentParser, text: str) -> dict[str, float]:
    """Each part's time limit: its own, unless ``--limit-s`` gives one for every part or for it."""
    limits = {name: spec[4] for name, spec in PARTS.items()}
    for entry in filter(None, (x.strip() for x in text.split(","))):
        name, _, seconds = entry.rpartition("=")
        try:
            value = float(seconds)
        except ValueError:
            parser.error(f"--limit-s: {entry!r} is not S or PART=S (S in seconds)")
        if name and name not in PARTS:
            parser.error(f"--limit-s: unknown part {name!r}; valid: {', '.join(PARTS)}")
        limits.update({name: value} if name else dict.fromkeys(PARTS, value))
    return limits


# --------------------------------------------------------------------------- importable checkout
def child_env(work: Path, block: bool) -> dict[str, str]:
    """The environment of the part process: the checkout first on the path (``grpo_plugins``
    through a link to ``plugins/``), Hugging Face offline and quiet."""
    alias = work / "import-alias"
    alias.mkdir(parents=True, exist_ok=True)
    link = alias / "grpo_plugins"
    if not link.exists():
        link.symlink_to(ROOT / "plugins", target_is_directory=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(alias), str(ROOT), env.get("PYTHONPATH", "")) if x)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               GRPO_LOAD_PLUGINS="")
    if block:
        env[BLOCK_ENV] = ",".join(MISSING_ON_GPU)
    return env


# --------------------------------------------------------------------------- the orchestrator
def orchestrate(args: argparse.Namespace) -> int:
    started = time.time()
    deadline = started + args.budget_s - RESERVE_S
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="grpo-gpu-check-"))
    results = work / "results"
    results.mkdir(parents=True, exist_ok=True)
    env = child_env(work, args.simulate_missing)
    remaining, parts = list(args.part_list), {}
    while remaining:
        if time.time() >= deadline:
            parts.update({p: {"part": p, "status": "skipped", "reason": "the budget was spent"} for p in remaining})
        else:
            parts.update(run_child(args, work, results, env, remaining, deadline))
        remaining = [p for p in remaining if p not in parts]
        summary = write_summary(args, started, results, parts)  # after each child: a killed run leaves its JSON
    print_table(summary)
    print(f"[gpu-check] results: {args.out / 'results.json'} ({summary['status']}, {summary['seconds']} s)", flush=True)
    return 0 if summary["status"] in ("ok", "skipped") else 1


def write_summary(args: argparse.Namespace, started: float, results: Path, parts: dict[str, dict]) -> dict:
    """``results.json`` and ``table.md`` in ``--out``, of the parts recorded so far."""
    summary = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "seconds": round(time.time() - started, 1), "budget_s": args.budget_s,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": {k: v for k, v in vars(args).items() if k not in ("child", "results", "deadline", "out", "work")
                     and not k.startswith("part_list")},
        "environment": _read_json(results / "environment.json") or {"error": "no part process reported"},
        "parts": {name: parts[name] for name in args.part_list if name in parts},
    }
    summary["status"] = overall(summary["parts"])
    (args.out / "results.json").write_text(json.dumps(summary, indent=1, default=str), encoding="utf-8")
    (args.out / "table.md").write_text(table_markdown(summary), encoding="utf-8")
    return summary


def overall(parts: dict) -> str:
    states = {p.get("status") for p in parts.values()}
    for worst in ("error", "timeout", "crashed", "failed"):
        if worst in states:
            return worst
    return "ok" if "ok" in states else "skipped"


def run_child(args, work: Path, results: Path, env: dict, parts: list[str], deadline: float) -> dict[str, dict]:
    """Run ``parts`` in one child process; return the records of those it finished (or that
    ended it: a part over its limit is killed, one whose process died is recorded as crashed)."""
    progress = results / "progress.jsonl"
    progress.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--results", str(results),
               "--deadline", str(deadline), "--work", str(work), *_forwarded(args), "--parts", ",".join(parts)]
    child = subprocess.Popen(command, env=env, start_new_session=True)
    finished: dict[str, dict] = {}
    while True:
        events = _events(progress)
        for event in events:
            if event["event"] == "end":
                finished[event["part"]] = _read_json(results / f"{event['part']}.json") or {"status": "error"}
        running = [e for e in events if e["event"] == "start" and e["part"] not in finished]
        code = child.poll()
        if code is not None:
            if running:  # the process ended inside a part
                name = running[-1]["part"]
                finished[name] = _ended(results, name, "crashed", f"the part process exited with code {code}")
            elif not events and code != 0:  # it never got to a part: nothing later can run either
                finished.update({p: {"status": "error", "error": f"the part process exited with code {code} "
                                     "before its first part (see the log above)"} for p in parts})
            return finished
        if running:
            name, since = running[-1]["part"], running[-1]["time"]
            limit = min(args.limits[name], max(deadline + RESERVE_S / 2 - since, 5.0))
            if time.time() - since > limit:
                _kill(child)
                finished[name] = _ended(results, name, "timeout", f"killed after {limit:.0f} s (its time limit)")
                return finished
        elif time.time() > deadline + RESERVE_S / 2:  # stuck between parts (or before the first)
            _kill(child)
            return {**finished, **{p: {"part": p, "status": "timeout", "error": "the budget ran out before it started"}
                                   for p in parts if p not in finished}}
        time.sleep(0.5)


def _kill(child: subprocess.Popen) -> None:
    """Stop the part process and whatever it started (its own session)."""
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _events(progress: Path) -> list[dict]:
    """The part process's events so far (a line it is still writing is left for the next look)."""
    out = []
    for line in progress.read_text(encoding="utf-8").splitlines() if progress.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            break
    return out


def _forwarded(args) -> list[str]:
    out = ["--device", args.device, "--budget-s", str(args.budget_s)] + (["--hang", args.hang] if args.hang else [])
    for flag in SIZE_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    return out + (["--tiny"] if args.tiny else []) + ["--out", str(args.out or ".")]


def _ended(results: Path, name: str, status: str, why: str) -> dict:
    record = _read_json(results / f"{name}.json") or {"part": name, "checks": {}}
    record.pop("started", None)
    record.update(status=status, error=why)
    return record


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- the part process
def child_main(args: argparse.Namespace) -> int:
    blocked = [m for m in os.environ.get(BLOCK_ENV, "").split(",") if m]
    for module in blocked:
        sys.modules[module] = None  # an import of it raises ImportError, as where it is not installed
    import importlib

    import torch
    from common import Record, cuda_context_broken, free_memory, pick_device

    device = pick_device(args.device)
    _write_environment(args.results / "environment.json", device, torch, blocked)
    progress = args.results / "progress.jsonl"
    for name in args.part_list:
        module_name, function, gpu_s, cpu_s, _ = PARTS[name]
        estimate = cpu_s if args.tiny or device.type == "cpu" else gpu_s
        path = args.results / f"{name}.json"
        _event(progress, name, "start")
        if name == args.hang:
            time.sleep(3600)
        left = args.deadline - time.time()
        if estimate > left:
            reason = f"would not fit: {left:.0f} s of the budget left, the part takes about {estimate:.0f} s"
            path.write_text(json.dumps({"part": name, "status": "skipped", "reason": reason}), encoding="utf-8")
        else:
            if name == "trl":
                for module in blocked:
                    sys.modules.pop(module, None)
            record = Record(path, name)
            try:
                getattr(importlib.import_module(module_name), function)(record, device, args.work, args)
            except Exception as exc:  # a failure outside the part's checks
                record.fail("setup", exc)
            record.finish()
        _event(progress, name, "end")
        free_memory(device)
        if cuda_context_broken(device):
            print("[gpu-check] the CUDA context is broken; the next parts run in a fresh process", flush=True)
            return 3
    return 0


def _event(path: Path, part: str, event: str) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"part": part, "event": event, "time": time.time()}) + "\n")


def _write_environment(path: Path, device, torch, blocked: list[str]) -> None:
    import importlib.metadata as metadata
    import platform

    versions = {}
    for name in ("torch", "transformers", "accelerate", "peft", "pydantic", "pydantic-core", "tokenizers",
                 "safetensors", "pyarrow", "trl", "datasets", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    env = {"python": platform.python_version(), "platform": platform.platform(), "device": str(device),
           "versions": versions, "blocked_modules": blocked, "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=list(torch.cuda.get_device_capability(device)), cuda=torch.version.cuda,
                   bf16=torch.cuda.is_bf16_supported(), gpus=torch.cuda.device_count(),
                   tf32_matmul=bool(torch.backends.cuda.matmul.allow_tf32))
        try:
            version = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as exc:  # recorded, not fatal: the nccl part says more
            env["nccl"] = f"unknown ({type(exc).__name__}: {exc})"
    path.write_text(json.dumps(env, indent=1), encoding="utf-8")


def gpu_command(args: argparse.Namespace) -> tuple[str, int]:
    """The command a GPU machine runs for ``args`` (the wheels installed first, the output kept
    in ``$OUT/log.txt``), and the time limit to give it."""
    defaults = parse_args(["--dry-run"])
    flags = []
    for action in ("device", "tiny", "parts", "budget_s", "limit_s", *SIZE_FLAGS, "simulate_missing"):
        value = getattr(args, action)
        if value != getattr(defaults, action):
            flag = "--" + action.replace("_", "-")
            flags += [flag] if value is True else [flag, str(value)]
    install = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
               "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;")
    check = " ".join(["PYTHONUNBUFFERED=1 python3 bench/gpu/run.py --out $OUT", *flags])
    command = f"{install} set -o pipefail; {check} 2>&1 | tee $OUT/log.txt"
    return command, int(min(600, args.budget_s + 60))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return print_dry_run(args, ROOT, HERE, *gpu_command(args))
    if args.child:
        return child_main(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
