"""The names of the metrics a spec's held-out evaluation logs, known when the spec is validated:
the reward functions' labels and the evaluation's settings decide them. ``checkpoint.best_metric``
is checked against them before any model loads.

One place for the naming, used by the engine too (:func:`reward_labels` labels the reward
functions); ``tests/core/test_best_metric_names.py`` checks that a real evaluation logs exactly
these names."""

from __future__ import annotations

from typing import Any

from grpo_core.errors import closest

__all__ = ["EPISODE_METRICS", "reward_labels", "eval_metric_names", "best_metric_problems"]

#: The per-episode metrics of multi-turn rollouts (an environment, an agent or routes),
#: logged under each held-out set's prefix; ``tool_success_rate`` only when some episode made a
#: tool call, ``failed_episodes`` when the episodes record failures, the last two for agent
#: episodes.
EPISODE_METRICS = ("env/turns_per_episode", "env/tool_calls", "env/tool_errors", "env/model_tokens",
                   "env/env_tokens", "env/samples_per_episode", "env/tool_call_rate", "env/tool_success_rate",
                   "env/failed_episodes", "env/queue_wait_seconds", "env/agent_seconds")


def reward_labels(names: list[str]) -> list[str]:
    """Each reward function's label in metrics (``rewards/<label>``): its name, or
    ``name#i`` (its index among the rewards) when the name is listed more than once."""
    return [name if names.count(name) == 1 else f"{name}#{i}" for i, name in enumerate(names)]


def eval_metric_names(spec: Any) -> list[str]:
    """Every metric the evaluation of ``spec`` (a validated :class:`~grpo_core.spec.Spec`) can
    log, sorted: for the default set (``eval/``) and each of ``eval.sets`` (``eval/<name>/``),
    the greedy ones (``reward``, ``rewards/<label>``, ``completions/mean_length``, ``prompts``,
    and with multi-turn rollouts :data:`EPISODE_METRICS`) unless ``eval.greedy`` is false, and
    with ``eval.n > 0`` the sampled ones (``mean@n``, ``rewards/<label>/mean@n``, ``pass@k``
    for each k, ``sampled/mean_length``, ``prompts``). A ``rewards/<label>`` name is missing
    from an evaluation in which that function scored no completion (all None)."""
    e = spec.eval
    labels = reward_labels([slot.name for slot in spec.rewards])
    rollout = spec.rollout
    episodes = any(getattr(rollout, key, None) is not None for key in ("environment", "agent", "routing"))
    out: set[str] = set()
    for prefix in ["eval/", *(f"eval/{name}/" for name in e.sets)]:
        if e.greedy:
            out.update(f"{prefix}{name}" for name in ("reward", "completions/mean_length", "prompts"))
            out.update(f"{prefix}rewards/{label}" for label in labels)
            if episodes:
                out.update(prefix + name for name in EPISODE_METRICS)
        if e.n:
            out.update(f"{prefix}{name}" for name in (f"mean@{e.n}", "sampled/mean_length", "prompts"))
            out.update(f"{prefix}rewards/{label}/mean@{e.n}" for label in labels)
            out.update(f"{prefix}pass@{k}" for k in e.ks())
    return sorted(out)


def best_metric_problems(spec: Any) -> list[tuple[tuple, str]]:
    """``checkpoint.best_metric`` when it names no metric the evaluation logs: the problem at
    its path, with the names that are valid."""
    metric = spec.checkpoint.best_metric
    if metric is None:
        return []
    known = eval_metric_names(spec)
    if metric in known:
        return []
    where = ("checkpoint", "best_metric")
    if not known:
        return [(where, f"{metric!r} is not logged: the evaluation logs nothing (eval.greedy is false and eval.n "
                        "is 0): set eval.greedy or eval.n, or drop best_metric")]
    match = closest(metric, known)
    hint = f" (did you mean '{match}'?)" if match else ""
    return [(where, f"{metric!r} is not a metric the evaluation logs{hint}; it logs: {', '.join(known)}")]
