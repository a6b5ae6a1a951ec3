"""What on-policy distillation (``opd``) costs: step time and peak memory against GRPO, on SmolLM2.

    python bench/distillation.py [--steps 5] [--prompts 2] [--group 8] [--tokens 64] [--device auto]
                                 [--tiny] [--results rows.jsonl]

Each configuration runs in a fresh process (so each peak is its own), ``--steps`` steps of the
arithmetic task through the real engine (``build_run`` + ``train_step``), and reports the median
step time (the first step excluded), the median time of the teacher's forward (``time/teacher``)
and of the no-grad log-prob forwards (``time/logprobs``: the old or reference policy's), the
peak resident memory and, on a GPU, the peak CUDA memory. The configurations:

- ``grpo``: GRPO with ``beta: 0`` (no reference model; its rows whose advantage is 0 get no
  forward or backward at all, ``rows skipped``, where every ``opd`` row has a dense advantage);
- ``grpo+kl``: GRPO with ``beta: 0.04`` (the reference model's forward: what a teacher's costs
  when it is the same size);
- ``opd-fp32`` / ``opd-bf16``: ``opd`` with a teacher of the policy's size in float32 / bfloat16
  (the policy's weights with seeded noise, so that the reverse KL, hence every row's advantage,
  is not 0: what is measured is the cost, not the learning), the policy's log-probs one more
  forward (``mu: 1``).

``--tiny`` runs grpo_core.testing's tiny model instead (a smoke run: seconds). Timings measured
on a shared machine are noise-prone: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = {
    "grpo": {"algorithm.kl.beta": 0.0},
    "grpo+kl": {"algorithm.kl.beta": 0.04},
    "opd-fp32": {"algorithm.kl.beta": 0.0, "teacher_dtype": "float32"},
    "opd-bf16": {"algorithm.kl.beta": 0.0, "teacher_dtype": "bfloat16"},
}


def noisy_teacher(model: Path, folder: Path, scale: float = 0.02) -> Path:
    """The policy's weights plus seeded Gaussian noise (``scale`` times each tensor's std), with its
    tokenizer, saved in ``folder``: a teacher of the policy's size that disagrees with it. A teacher
    equal to the policy gives a reverse KL of 0 on every token, so every row's advantage is 0 and
    the update skips them all: the forward and backward would go unmeasured."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in teacher.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.add_(noise * scale * parameter.float().std().nan_to_num())
    teacher.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model).save_pretrained(folder)
    return folder


def spec_text(model: Path, args: argparse.Namespace, config: dict) -> str:
    advantage = "{name: grpo}"
    if "teacher_dtype" in config:
        advantage = (f"{{name: opd, teacher: {{path: {args.teacher}, dtype: {config['teacher_dtype']}, "
                     f"device: {args.device}}}}}")
    return f"""
model: {{path: {model}}}
data: {{name: arithmetic, eval_size: 0}}
rollout: {{group_size: {args.group}, max_new_tokens: {args.tokens}}}
rewards: [{{name: accuracy}}]
algorithm:
  advantage: {advantage}
  kl: {{name: low_var_kl, beta: {config['algorithm.kl.beta']}}}
train: {{steps: {args.steps}, prompts_per_step: {args.prompts}, lr: 1.0e-6, threads: {args.threads},
         device: {args.device}, progress: false, seed: 0, output_dir: {args.out}}}
eval: {{at_start: false, at_end: false}}
tracking: []
"""


def run_one(name: str, args: argparse.Namespace) -> dict:
    """One configuration in this process: the medians and peaks as a dict."""
    import torch

    from grpo_core.spec import load_spec
    from grpo_core.train.loop.assemble import build_run
    from grpo_core.train.loop.step import train_step

    spec = Path(args.out) / f"{name}.yaml"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(spec_text(Path(args.model), args, CONFIGS[name]))
    run = build_run(load_spec(spec, []))
    rows = [train_step(run.feed, run.learner, step).metrics for step in range(args.steps)]
    body = rows[1:] or rows
    out = {"config": name, "steps": args.steps, "prompts": args.prompts, "group": args.group, "tokens": args.tokens}
    for key in ("step", "teacher", "logprobs", "forward_backward", "generate"):
        out[f"time/{key}"] = statistics.median(r.get(f"time/{key}", 0.0) for r in body)
    out["teacher/kl"] = statistics.median(r.get("teacher/kl", float("nan")) for r in body)
    out["skipped_rows_frac"] = statistics.median(r.get("perf/skipped_rows_frac", 0.0) for r in body)
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    if torch.cuda.is_available() and args.device != "cpu":
        out["peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 1024**3
        out["gpu"] = torch.cuda.get_device_name()
    return out


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["config"] == "grpo"), rows[0])
    lines = ["| config | step (s) | vs grpo | teacher (s) | logprobs (s) | forward+backward (s) | rows skipped | "
             "peak RSS (GB) | peak CUDA (GB) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cuda = f"{r['peak_cuda_gb']:.2f}" if "peak_cuda_gb" in r else "-"
        lines.append(f"| {r['config']} | {r['time/step']:.2f} | {r['time/step'] / base['time/step']:.2f}x | "
                     f"{r['time/teacher']:.2f} | {r['time/logprobs']:.2f} | {r['time/forward_backward']:.2f} | "
                     f"{r.get('skipped_rows_frac', float('nan')):.0%} | {r['peak_rss_gb']:.2f} | {cuda} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--tiny", action="store_true", help="grpo_core.testing's tiny model (a smoke run)")
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--teacher", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "grpo-bench-distillation"))
    parser.add_argument("--results", default=None, help="append one JSON line per configuration")
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return 0
    if args.model is None:
        if args.tiny:
            from grpo_core.testing import save_tiny_model

            folder = Path(args.out) / "tiny-model"
            args.model = str(folder if (folder / "config.json").exists() else save_tiny_model(folder))
        else:
            from vs_trl import prepare_model

            args.model = str(prepare_model(Path(tempfile.gettempdir()) / "grpo-bench-smollm2"))
    if args.teacher is None:
        args.teacher = str(noisy_teacher(Path(args.model), Path(args.out) / "teacher-model"))
    rows = []
    for name in args.configs:
        command = [sys.executable, __file__, "--one", name, "--model", args.model, "--teacher", args.teacher,
                   "--out", args.out,
                   "--steps", str(args.steps), "--prompts", str(args.prompts), "--group", str(args.group),
                   "--tokens", str(args.tokens), "--threads", str(args.threads), "--device", args.device]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        row = json.loads(lines[-1][len("RESULT "):])
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.results:
            with open(args.results, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
