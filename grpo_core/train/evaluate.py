"""Held-out evaluation: greedy completions, and ``n`` sampled completions per prompt
(mean@n, pass@k), scored by the spec's reward functions, on the default held-out set
(the held-out split of ``data``, metrics ``eval/...``) and on each named set of
``eval.sets`` (metrics ``eval/<name>/...``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpo_core.errors import RunError
from grpo_core.train.data import Prompt, PromptSource, check_columns
from grpo_core.train.passk import mean_at_n, mean_pass_at_k
from grpo_core.train.step import as_completions, columns_of
from grpo_core.train.scoring import score


@dataclass
class EvalSet:
    """One held-out set: its rendered prompts, their prompt column, its metrics' prefix."""

    prefix: str  # "eval/" for the default set, "eval/<name>/" for a named one
    prompts: list[Prompt]
    prompt_column: str


def evaluate(run) -> dict[str, float]:
    """Every eval set's metrics: greedy ones (:func:`_greedy`) unless ``eval.greedy`` is
    off, sampled ones (:func:`_sampled`) when ``eval.n > 0``."""
    sets = [EvalSet("eval/", run.eval_prompts, run.spec.data.prompt_column), *run.eval_sets.values()]
    out: dict[str, float] = {}
    for eval_set in sets:
        if not eval_set.prompts:
            continue
        if run.spec.eval.greedy:
            out.update(_greedy(run, eval_set.prompts, eval_set.prefix, eval_set.prompt_column))
        if run.spec.eval.n:
            out.update(_sampled(run, eval_set))
        out[f"{eval_set.prefix}prompts"] = float(len(eval_set.prompts))
    return out


def _greedy(run, everything: list[Prompt], prefix: str = "eval/", prompt_column: str | None = None) -> dict[str, float]:
    """``eval/reward`` and ``eval/rewards/<name>`` (mean over held-out prompts; for an
    accuracy reward that is the greedy accuracy), plus mean completion length.

    With several processes each evaluates every N-th prompt and the scores are gathered,
    so the figures are those of all held-out prompts."""
    spec = run.spec
    dist = run.dist
    prompts = everything[dist.rank::dist.world]
    sampling = run.sampling(greedy=True, max_new_tokens=spec.eval.max_new_tokens or spec.rollout.max_new_tokens)
    totals, per_fn, lengths = [], [], []
    names: list[str] = [fn.name for fn in run.rewards]
    for start in range(0, len(prompts), spec.eval.batch_size):
        chunk = prompts[start:start + spec.eval.batch_size]
        with run.autocast():
            rollout = run.backend.generate([p.ids for p in chunk], 1, sampling)
        row_prompts, completions = as_completions(chunk, rollout)
        columns = columns_of(chunk, 1, prompt_column or spec.data.prompt_column)
        ids = [r[m].tolist() for r, m in zip(rollout.completion_ids, rollout.completion_mask)]
        scores = score(run.rewards, row_prompts, completions, columns, ids, spec.train.reward_errors)
        totals.append(scores.total)
        per_fn.append(scores.per_function)
        names = scores.names
        lengths.append(rollout.completion_mask.sum(dim=1).float().cpu())
    local = (totals, per_fn, lengths)
    parts = dist.gather(local) if dist.active else [local]
    total = torch.cat([t for part in parts for t in part[0]])
    table = torch.cat([t for part in parts for t in part[1]])
    out = {f"{prefix}completions/mean_length": float(torch.cat([t for part in parts for t in part[2]]).mean())}
    valid = ~torch.isnan(total)
    out[f"{prefix}reward"] = float(total[valid].mean()) if valid.any() else math.nan
    for j, name in enumerate(names):
        col = table[:, j]
        ok = ~torch.isnan(col)
        if ok.any():
            out[f"{prefix}rewards/{name}"] = float(col[ok].mean())
    return out


def correct_column(run) -> int:
    """Index, among ``run.rewards``, of the function whose score decides correctness:
    ``eval.correct.reward`` (a reward listed twice: its first entry), else ``accuracy``
    when listed, else the first one."""
    wanted = run.spec.eval.correct.reward
    names = [fn.name.split("#")[0] for fn in run.rewards]
    for candidate in ([wanted] if wanted else ["accuracy"]):
        if candidate in names:
            return names.index(candidate)
    if wanted:
        raise RunError(f"eval.correct.reward '{wanted}' is not a reward function of this run ({', '.join(names)})")
    return 0


def _sampled(run, eval_set: EvalSet) -> dict[str, float]:
    """``n`` sampled completions per prompt of ``eval_set``: ``<prefix>mean@n`` (mean total
    reward over every sample), ``<prefix>rewards/<name>/mean@n`` per function,
    ``<prefix>pass@k`` for each k (Chen et al.'s unbiased estimator, "correct" as
    ``eval.correct`` says) and ``<prefix>sampled/mean_length``.

    Samples are seeded from ``train.seed`` and the prompt's position, the same at every
    evaluation, so two evaluations of a run differ by the weights, not by the draw."""
    e, dist = run.spec.eval, run.dist
    prompts = eval_set.prompts[dist.rank::dist.world]
    j_correct, threshold = correct_column(run), e.correct.threshold
    totals, tables, correct, lengths = [], [], [], []
    for start in range(0, len(prompts), e.batch_size):
        chunk = prompts[start:start + e.batch_size]
        sampling = run.sampling(
            temperature=e.temperature, top_p=e.top_p,
            max_new_tokens=e.max_new_tokens or run.spec.rollout.max_new_tokens,
            seed=run.spec.train.seed * 1_000_003 + 7_919 + dist.rank * 65_537 + start,
        )
        with run.autocast():
            rollout = run.backend.generate([p.ids for p in chunk], e.n, sampling)
        row_prompts, completions = as_completions(chunk, rollout)
        columns = columns_of(chunk, e.n, eval_set.prompt_column)
        ids = [r[m].tolist() for r, m in zip(rollout.completion_ids, rollout.completion_mask)]
        scores = score(run.rewards, row_prompts, completions, columns, ids, run.spec.train.reward_errors)
        totals.append(scores.total)
        tables.append(scores.per_function)
        hit = scores.per_function[:, j_correct] >= threshold  # NaN (unscorable) compares False
        correct.append(hit.view(len(chunk), e.n).sum(dim=1))
        lengths.append(rollout.completion_mask.sum(dim=1).float().cpu())
    local = (totals, tables, correct, lengths)
    parts = dist.gather(local) if dist.active else [local]
    cat = [torch.cat([t for part in parts for t in part[i]]) for i in range(4)]
    return sampled_metrics(eval_set.prefix, e.n, e.ks(), [fn.name for fn in run.rewards], *cat)


def sampled_metrics(prefix: str, n: int, ks: list[int], names: list[str], total: torch.Tensor,
                    table: torch.Tensor, correct: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
    """The sampled metrics from ``total (R,)``, ``table (R, F)`` and ``lengths (R,)`` of
    ``R = prompts * n`` samples and ``correct (prompts,)`` counts of correct samples."""
    out = {f"{prefix}mean@{n}": mean_at_n(total.tolist())}
    for j, name in enumerate(names):
        value = mean_at_n(table[:, j].tolist())
        if not math.isnan(value):
            out[f"{prefix}rewards/{name}/mean@{n}"] = value
    counts = [int(c) for c in correct.tolist()]
    for k in ks:
        out[f"{prefix}pass@{k}"] = mean_pass_at_k(n, counts, k)
    out[f"{prefix}sampled/mean_length"] = float(lengths.mean()) if lengths.numel() else math.nan
    return out


def load_eval_sets(spec, tokenizer, max_tokens: int, required: dict[str, str]) -> dict[str, EvalSet]:
    """The named sets of ``eval.sets``, loaded and rendered; ``required`` maps each column
    the reward functions need to who needs it."""
    out: dict[str, EvalSet] = {}
    for name, section in spec.eval.sets.items():
        dataset = section.data.build()
        try:
            rows = dataset.load(section.split)
        except RunError:
            raise
        except Exception as exc:
            raise RunError(
                f"eval.sets.{name}.data: dataset '{section.data.name}' failed to load: {type(exc).__name__}: {exc}"
            ) from exc
        if not rows:
            raise RunError(f"eval.sets.{name}: dataset '{section.data.name}' has no rows in its {section.split} split")
        needed = {section.data.prompt_column: f"eval.sets.{name}.data.prompt_column", **required}
        check_columns(rows, needed, f"eval set '{name}'")
        source = PromptSource(rows, tokenizer, section.data, seed=0, max_tokens=max_tokens, shuffle=False)
        prompts = [p for p in map(source.render, rows) if p is not None][: section.max_prompts]
        out[name] = EvalSet(f"eval/{name}/", prompts, section.data.prompt_column)
    return out
