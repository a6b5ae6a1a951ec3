"""``grpo-run SPEC --dry-run``: build everything a run needs, sample one rollout step and
score it, print the completions with their rewards, and train nothing: the first thing to
do with a new reward function or dataset."""

from __future__ import annotations

import math
import sys
from typing import Any, TextIO

import torch

from grpo_core.spec import LoadedSpec
from grpo_core.textout import print_table


def _short(text: Any, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _fmt(value: float) -> str:
    return "None" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3g}"


def dry_run(loaded: LoadedSpec, stream: TextIO | None = None, width: int = 70) -> int:
    """Build the run (model, tokenizer, data, rewards, backend), generate one step's
    completions (``train.prompts_per_step`` prompts x ``rollout.group_size``), score
    them and print a table per prompt plus a summary; no update, no checkpoint, no
    tracker run. Returns 0."""
    from grpo_core.train.actor.rollout import shown_completion
    from grpo_core.train.experience import Timer
    from grpo_core.train.loop.assemble import build_run

    stream = stream or sys.stdout
    run = build_run(loaded)
    group = run.spec.rollout.group_size
    with torch.inference_mode():  # the training step's own first stage: draw, generate, score
        scored = run.actor.rollout_round(run.step, Timer())
    prompts, rollout, scores = scored.prompts, scored.rollout, scored.scores
    names = scores.names
    for p, prompt in enumerate(prompts):
        rows = []
        for j in range(group):
            i = p * group + j
            per_fn = [_fmt(float(scores.per_function[i, k])) for k in range(len(names))]
            rows.append([j, _fmt(float(scores.total[i])), *per_fn, _short(shown_completion(rollout, i), width)])
        print_table(["#", "reward", *names, "completion"], rows, title=f"prompt {p}: {_short(prompt.text, width)}",
                    stream=stream)
        print(file=stream)
    total = scores.total.view(len(prompts), group)
    valid = ~torch.isnan(total)
    flat = [len(set(row[ok].tolist())) <= 1 for row, ok in zip(total, valid)]
    summary = [["reward (mean)", _fmt(float(total[valid].mean())) if valid.any() else "None"]]
    for k, name in enumerate(names):
        col = scores.per_function[:, k]
        ok = ~torch.isnan(col)
        summary.append([f"{name} (mean)", _fmt(float(col[ok].mean())) if ok.any() else "None"])
    summary.append(["groups with equal rewards (no learning signal)", f"{sum(flat)} of {len(flat)}"])
    summary.append(["reward function failures", str(scores.failed)])
    summary.append(["mean completion length (tokens)", _fmt(float(rollout.completion_mask.sum(dim=1).float().mean()))])
    print_table(["dry run", "value"], summary, title="summary (nothing was trained)", stream=stream)
    return 0
