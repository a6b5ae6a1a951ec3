"""Iterative RL with GRPO (DeepSeekMath, https://arxiv.org/abs/2402.03300, Algorithm 1).

For iteration ``1..I``: the reference model becomes the current policy; the reward model
is trained continually on fresh samples of the latest policy, labelled by the task's
verifier, with a replay of historical data (kept by the reward model itself); then the
policy trains for ``M`` steps against the updated reward model.

:class:`IterativeRefresh`, a hook of the GRPO stage (:mod:`grpo_core.train.loop.grpo`), runs
the iteration start before the first step of each iteration. It samples
``iterative.prompts + iterative.heldout_prompts`` training prompts with ``group_size``
completions each from the policy, labels them with the verifier, measures the reward model's
accuracy on the held-out prompts' completions before (staleness) and after its update, and
returns the metrics, which the loop logs with that first step. Its state (iterations begun,
resets, and the reference weights when the reference is a copy) is checkpointed with the GRPO
stage's, so a resumed run continues mid-iteration exactly.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

from grpo_core.contracts import RewardExample, TrainableReward
from grpo_core.errors import RunError
from grpo_core.spec.iterative import IterativeSection
from grpo_core.train import seeds
from grpo_core.train.actor.actor import Actor
from grpo_core.train.actor.rollout import Scorer, as_completions
from grpo_core.train.actor.scoring import RewardFn


class IterativeRefresh:
    """The iteration start of iterative GRPO (reference reset, reward-model refresh); see the
    module doc."""

    def __init__(self, section: IterativeSection, reward: RewardFn, verifier: RewardFn, reference: Any):
        self.section = section
        self.reward = reward
        self.verifier = verifier
        self.reference = reference
        self.iteration = 0  # iterations begun
        self.resets = 0

    def due(self, step: int) -> bool:
        """Whether an iteration starts before training step ``step + 1``."""
        s = self.section
        return step % s.steps_per_iteration == 0 and step // s.steps_per_iteration == self.iteration < s.iterations

    def begin(self, actor: Actor, policy: Any) -> dict[str, float]:
        """Start the next iteration: reset the reference to the ``policy`` model, update the
        reward model on fresh samples of prompts drawn from the ``actor``'s source."""
        t0 = time.perf_counter()
        if self.reference is not None:
            self.reference.reset_to(policy)
            self.resets += 1
        train, heldout = self._collect(actor)
        rm: TrainableReward = self.reward.fn
        metrics = {f"rm/heldout_{k}_before": v for k, v in rm.evaluate(heldout).items()}
        metrics.update({f"rm/{k}": v for k, v in rm.fit(train).items()})
        metrics.update({f"rm/heldout_{k}": v for k, v in rm.evaluate(heldout).items()})
        self.iteration += 1
        metrics.update({
            "iterative/iteration": float(self.iteration),
            "iterative/reference_resets": float(self.resets),
            "rm/label_mean": sum(e.label for e in train) / len(train) if train else math.nan,
            "rm/heldout_size": float(len(heldout)),
            "time/iteration": time.perf_counter() - t0,
        })
        return metrics

    def _collect(self, actor: Actor) -> tuple[list[RewardExample], list[RewardExample]]:
        """Fresh completions of the latest policy on training prompts, labelled by the
        verifier (unscorable ones dropped): the training part and the held-out part."""
        s, settings = self.section, actor.settings
        g = s.group_size or settings.group_size
        prompts = actor.source.next(s.prompts + s.heldout_prompts)
        sampling = replace(settings.sampling, seed=seeds.iteration(settings.seed, self.iteration))
        verifier = Scorer([self.verifier], actor.scorer.prompt_column, actor.scorer.on_error)
        scored = actor.sample(prompts, g, sampling, scorer=verifier)
        row_prompts, completions = as_completions(prompts, scored.rollout)
        labels = scored.scores.total.tolist()
        examples = [RewardExample(p, c, float(y)) for p, c, y in zip(row_prompts, completions, labels)]
        cut = s.prompts * g
        keep = [not math.isnan(e.label) for e in examples]
        train = [e for e, k in zip(examples[:cut], keep[:cut]) if k]
        heldout = [e for e, k in zip(examples[cut:], keep[cut:]) if k]
        return train, heldout

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"iteration": self.iteration, "resets": self.resets}
        model = getattr(self.reference, "model", None)
        if model is not None and self.iteration > 0:  # the policy at the iteration start
            state["reference"] = model.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.resets = int(state.get("resets", 0))
        model = getattr(self.reference, "model", None)
        if model is not None and "reference" in state:
            model.load_state_dict(state["reference"])


def build_iterative(spec, rewards: list[RewardFn], reference: Any) -> IterativeRefresh | None:
    """The refresh of ``spec.iterative``, or None; a RunError when the named reward
    function cannot be trained."""
    section = spec.iterative
    if section is None:
        return None
    reward = next(fn for fn in rewards if fn.name == section.reward_model)
    if not isinstance(reward.fn, TrainableReward):
        raise RunError(
            f"iterative.reward_model: reward function '{reward.name}' cannot be trained (it has "
            "no fit/evaluate/state_dict/load_state_dict); use a trainable one such as "
            "trainable_reward_model"
        )
    verifier = RewardFn.of(f"verifier:{section.verifier.name}", 1.0, section.verifier.build())
    return IterativeRefresh(section, reward, verifier, reference)
