"""The learner: an :class:`~grpo_core.train.experience.Experience` in, an optimizer step out.

A :class:`Learner` holds what trains (the policy, optimizer and schedule, the objective,
the advantage estimator, the KL term with its reference, the fp16 scaler, the parallel
strategy). ``learn`` prepares the batch (old and reference log-probs where needed, the KL
in the reward, the advantages) and runs the update (:mod:`grpo_core.train.learner.update`); its
policy version then counts one more, and the new weights go back to the actor. It knows the
actor only by that value (:mod:`grpo_core.train.experience`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from grpo_core.contracts import AdvantageEstimator, AdvantageInputs, RolloutBatch, Teacher
from grpo_core.contracts.images import without_placeholders
from grpo_core.errors import RunError
from grpo_core.train.distributed import Dist, pad_cat
from grpo_core.train.experience import Experience, Scored, Timer
from grpo_core.train.learner.batch import TrainBatch, batch_logprobs, micro_batches
from grpo_core.train.learner.kl import KLTerm
from grpo_core.train.learner.optim import Optimization
from grpo_core.train.learner.packing import resolve_packing
from grpo_core.train.learner.parallel import OneProcess, Strategy, forward_of
from grpo_core.train.learner.routing import Replay
from grpo_core.train.learner.samples import sample_rows
from grpo_core.train.learner.teacher import check_vocabulary, teacher_logprobs
from grpo_core.train.learner.update import Objective, update
from grpo_core.train.reasoning_steps import step_tensors
from grpo_core.train.recompute import checkpointed_otherwise

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class UpdateSettings:
    """The spec values the update reads (``algorithm.mu``, ``train``, ``rollout.mask_truncated_completions``)."""

    mu: int = 1
    mini_batches: int = 1
    micro_batch_size: int | None = None
    micro_batch_tokens: int = 2048
    max_grad_norm: float | None = None
    mask_truncated: bool = False
    packing: bool | str = "auto"  # train.packing: True, False or "auto"
    routing_replay: bool = False  # algorithm.routing_replay: force the sampler's expert routes in every forward

    @classmethod
    def from_spec(cls, spec) -> UpdateSettings:
        t = spec.train
        return cls(mu=spec.algorithm.mu, mini_batches=t.mini_batches, micro_batch_size=t.micro_batch_size,
                   micro_batch_tokens=t.micro_batch_tokens, max_grad_norm=t.max_grad_norm,
                   mask_truncated=spec.rollout.mask_truncated_completions, packing=t.packing,
                   routing_replay=spec.algorithm.routing_replay)


@dataclass
class Learner:
    """Turns a scored batch into optimizer steps; see the module doc."""

    model: torch.nn.Module  # the policy (a transformers causal LM, a peft model under LoRA)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    objective: Objective
    settings: UpdateSettings = field(default_factory=UpdateSettings)
    estimator: AdvantageEstimator | None = None
    kl: KLTerm | None = None  # the KL term (reference model; in the loss or in the reward), or None
    tokenizer: PreTrainedTokenizerBase | None = None  # finds reasoning steps' token ends (process supervision)
    strategy: Strategy = field(default_factory=OneProcess)  # the parallel strategy
    autocast: Callable = nullcontext  # () -> the mixed-precision context of forward passes
    scaler: torch.amp.GradScaler | None = None  # under fp16 mixed precision
    version: int = 0  # training steps applied to the policy
    _packs: bool | None = field(default=None, init=False, repr=False)
    teacher_checked: bool = field(default=False, repr=False)  # the estimator's teacher reads our token ids

    @property
    def dist(self) -> Dist:
        return self.strategy.dist

    @property
    def optimization(self) -> Optimization:
        """The optimizer, its schedule and the fp16 scaler: what an optimizer step moves and a
        checkpoint saves besides the weights."""
        return Optimization(self.optimizer, self.scheduler, self.scaler)

    @property
    def packs(self) -> bool:
        """Whether the forwards run padding-free (``train.packing`` resolved for this model and
        device, :func:`grpo_core.train.learner.packing.resolve_packing`); decided once."""
        if self._packs is None:
            self._packs = resolve_packing(self.settings.packing, self.model, self.dist.device)
        return self._packs

    @property
    def trains_packed(self) -> bool:
        """Whether the training forward runs packed: :attr:`packs`, checkpointed layers included
        (``model.gradient_checkpointing`` recomputes them under the packed attention), except
        for layers checkpointed some other way, where it runs padded and only the no-grad
        forwards pack; its micro-batches are then counted in padded positions."""
        return self.packs and not checkpointed_otherwise(self.model)

    def micro_batches(self, batch: TrainBatch) -> list[torch.Tensor]:
        """The row indices of each no-grad forward over the whole ``batch``."""
        s = self.settings
        return micro_batches(batch, torch.arange(len(batch.mask)), s.micro_batch_size, s.micro_batch_tokens,
                             self.packs)

    def learn(self, experience: Experience) -> tuple[TrainBatch, dict[str, float], dict[str, float]]:
        """Prepare and update on ``experience``; ``(batch, metrics, phase seconds)``."""
        timer = Timer()
        batch, metrics = self.prepare(experience, timer)
        metrics.update(update(self, batch))
        if batch.routes is not None:
            metrics.update(batch.routes.tally.metrics(self.strategy.total))
        self.version += 1
        return batch, metrics, timer.phases

    def prepare(self, experience: Experience, timer: Timer) -> tuple[TrainBatch, dict[str, float]]:
        """The batch to update on: old and reference log-probs where needed, the KL penalty
        when it is in the reward, the policy's and the teacher's log-probs for an estimator
        with a teacher, and the advantages."""
        s, kl, scored, teacher = self.settings, self.kl, experience.scored, self.estimator.teacher
        batch = train_batch(scored.rollout, s.mask_truncated, experience.temperature,
                            getattr(getattr(self.model, "module", self.model), "config", None))
        batch.routes = replay_of(scored.rollout, s.routing_replay)
        micro = self.micro_batches(batch)
        temperature = batch.temperature
        rewards, penalty, metrics = scored.scores.total.to(batch.mask.device), None, {}
        mask = batch.per_episode(batch.mask, False)  # rewards and advantages are the episodes'
        with timer("logprobs"):
            # the sampling policy's log-probs: the current ones serve only while no optimizer step
            # has moved the policy since the rollout (one pass, one mini-batch) and no KL-in-reward needs them first
            if s.mu > 1 or s.mini_batches > 1 or (kl is not None and kl.in_reward):
                batch.old_logp = batch_logprobs(self.strategy.forward(self.model), batch, micro, temperature,
                                                self.autocast, packed=self.packs, strategy=self.strategy)
            if kl is not None:
                with kl.reference.active() as ref_model:
                    batch.ref_logp = batch_logprobs(self.strategy.forward(ref_model), batch, micro, temperature,
                                                    self.autocast, packed=self.packs, strategy=self.strategy)
        if kl is not None and kl.in_reward:
            rewards, penalty, metrics["kl"] = kl.penalize(rewards, batch.per_episode(batch.old_logp),
                                                          batch.per_episode(batch.ref_logp), mask)
        distilled = None
        if teacher is not None:
            with timer("teacher"):
                distilled = tuple(batch.per_episode(t) for t in self.distillation_logprobs(teacher, batch, micro))
            if mask.any():  # the sampled-token estimate of KL(policy || teacher), per token
                metrics["teacher/kl"] = float((distilled[0] - distilled[1])[mask].mean())
        with timer("advantage"):
            inputs = advantage_inputs(scored, rewards, penalty, mask,
                                      with_steps=self.estimator.needs_step_scores, tokenizer=self.tokenizer)
            if experience.baseline_scores is not None:
                inputs.baseline_scores = experience.baseline_scores.to(batch.mask.device)
            if distilled is not None:
                inputs.logp, inputs.teacher_logp = distilled
            batch.advantages = batch.per_sample(global_advantages(self.estimator, self.dist, inputs))
        return batch, metrics

    def check_teacher(self) -> None:
        """The estimator's teacher, if it has one, is a :class:`Teacher` whose vocabulary is the
        policy tokenizer's (a RunError naming it otherwise); checked once, when the learner is
        built, before any rollout or paid reward call."""
        teacher = self.estimator.teacher
        if teacher is None or self.teacher_checked:
            return
        if not isinstance(teacher, Teacher):
            raise RunError(f"the advantage estimator's teacher must be a grpo_core.contracts.Teacher (a causal "
                           f"LM with its name and vocabulary), got {type(teacher).__name__}")
        check_vocabulary(teacher, self.tokenizer)
        self.teacher_checked = True

    def distillation_logprobs(self, teacher: Teacher, batch: TrainBatch,
                              micro: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(policy, teacher)`` log-probs ``(B, T)`` of the batch's sampled tokens, 0 on padding:
        the policy's are the old ones when they were computed, else one forward of the policy
        (no gradient) before the update; the teacher's one forward of the teacher."""
        self.check_teacher()
        policy = batch.old_logp
        if policy is None:
            policy = batch_logprobs(self.strategy.forward(self.model), batch, micro, batch.temperature, self.autocast,
                                    packed=self.packs, strategy=self.strategy)
        # the teacher is any causal LM (packing is checked against the policy only): padded
        # forwards, its micro-batches counted in padded positions
        s = self.settings
        padded = micro_batches(batch, torch.arange(len(batch.mask)), s.micro_batch_size, s.micro_batch_tokens, False)
        return policy.masked_fill(~batch.mask, 0.0), teacher_logprobs(teacher, batch, padded)

    def sampler_logprobs(self, sampler: torch.nn.Module, experience: Experience) -> torch.Tensor:
        """``(B, T)``: the log-probs of ``experience``'s sampled tokens under ``sampler`` (a
        plain, unsharded copy of the policy that generated them: an asynchronous run's), computed
        as the learner computes its own (micro-batches, temperature, mixed precision), zero
        outside the completion masks: the behaviour policy of the rollout correction."""
        batch = train_batch(experience.scored.rollout, False, experience.temperature, getattr(sampler, "config", None))
        batch.routes = replay_of(experience.scored.rollout, self.settings.routing_replay)
        logp = batch_logprobs(forward_of(sampler), batch, self.micro_batches(batch), batch.temperature, self.autocast,
                              packed=self.packs)
        return batch.per_episode(logp.masked_fill(~batch.mask, 0.0))


def replay_of(rollout: RolloutBatch, routing_replay: bool) -> Replay | None:
    """The rollout's expert routes to force in the batch's forwards when ``routing_replay``
    (``algorithm.routing_replay``); a RunError when the rollout came without them."""
    if not routing_replay:
        return None
    if rollout.routes is None:
        raise RunError("algorithm.routing_replay: the rollout came without the experts each token was routed to "
                       "(RolloutBatch.routes); its backend must record them (RolloutCapabilities.records_routes)")
    return Replay(rollout.routes)


def train_batch(rollout: RolloutBatch, mask_truncated: bool, temperature: float = 1.0, config: Any = None
                ) -> TrainBatch:
    """The rollout (sampled at ``temperature``) as a :class:`TrainBatch`; the loss mask drops
    truncated completions when ``mask_truncated`` (``rollout.mask_truncated_completions``),
    and for prompts with images the completions that wrote one of the model's (``config``)
    image placeholder tokens (:func:`~grpo_core.contracts.images.without_placeholders`). With
    split agent episodes the rows are their training samples
    (:mod:`grpo_core.train.learner.samples`)."""
    mask = rollout.completion_mask.bool()
    if mask_truncated:
        mask = mask & ~rollout.truncated.bool()[:, None]
    completion_ids = rollout.completion_ids
    if rollout.prompt_images is not None and config is not None:
        completion_ids, mask = without_placeholders(completion_ids, mask, config)
    samples = sample_rows(rollout)
    if samples is not None:
        completion_ids, mask = samples.expand(completion_ids), samples.expand(mask, False)
    batch = TrainBatch(rollout.prompt_ids, rollout.prompt_mask.bool(), completion_ids, mask,
                       torch.zeros(mask.shape, device=mask.device), temperature=temperature, samples=samples)
    if rollout.sampling_logp is not None:
        batch.sampling_logp = batch.per_sample(rollout.sampling_logp.to(mask.device, torch.float32))
    batch.prompt_images = rollout.prompt_images
    return batch


def advantage_inputs(scored: Scored, rewards: torch.Tensor, penalty: torch.Tensor | None, mask: torch.Tensor,
                     *, with_steps: bool = False, tokenizer: Any = None) -> AdvantageInputs:
    """What the estimator sees: sequence rewards ``(B,)``, the table of each reward function's
    scores with their weights (plus a ``kl_penalty`` column of weight 1, ``-penalty``, when the
    KL is in the reward), and with ``with_steps`` per-step scores with the token index of each
    step's end (found with ``tokenizer``); a KL-in-reward ``penalty (B,)`` counts on the last step."""
    rollout = scored.rollout
    group_ids = torch.arange(rollout.prompt_ids.shape[0], device=mask.device).repeat_interleave(rollout.group_size)
    inputs = AdvantageInputs(rewards, group_ids, mask)
    inputs.reward_scores, inputs.reward_weights, inputs.reward_names = reward_table(scored, penalty, mask.device)
    if with_steps:
        ends, step_mask = step_tensors(scored.layout, tokenizer, rollout.completion_ids,
                                       rollout.completion_mask, rollout.completions)
        step_scores = scored.scores.step_scores.to(mask.device, copy=True)
        if penalty is not None:
            last = step_mask.sum(dim=1).clamp(min=1) - 1
            rows = torch.arange(step_scores.shape[0], device=mask.device)
            step_scores[rows, last] = step_scores[rows, last] - penalty
        inputs.step_scores, inputs.step_ends, inputs.step_mask = step_scores, ends, step_mask
    return inputs


def reward_table(scored: Scored, penalty: torch.Tensor | None, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple[str, ...]]:
    """``(scores (B, F), weights (F,), names)`` of the step's reward functions, with the column
    ``kl_penalty`` (``-penalty``, weight 1) appended when the KL is in the reward, so that the
    weighted sum of a row's non-NaN columns is the reward the estimator receives."""
    s = scored.scores
    table = s.per_function.to(device, torch.float32)
    weights = s.weights if s.weights is not None else torch.ones(table.shape[1])
    weights, names = weights.to(device, torch.float32), tuple(s.names)
    if penalty is not None:
        table = torch.cat([table, -penalty.to(device, torch.float32)[:, None]], dim=1)
        weights = torch.cat([weights, weights.new_ones(1)])
        names += ("kl_penalty",)
    return table, weights, names


#: Fields of :class:`AdvantageInputs` padded along ``T`` or ``K`` when several processes' rows are
#: gathered, with their padding value; the others are concatenated (row fields) or shared.
_PADDED = {"mask": False, "step_scores": 0.0, "step_ends": 0, "step_mask": False, "logp": 0.0, "teacher_logp": 0.0}
_SHARED = ("reward_weights", "reward_names")


def global_advantages(estimator: AdvantageEstimator, dist: Dist, inputs: AdvantageInputs) -> torch.Tensor:
    """The estimator's advantages ``(b, T)`` for this process's rows. With several
    processes, the inputs of all are gathered (groups renumbered, ``T`` and ``K`` padded)
    and the estimator runs on the global batch, so batch-scoped statistics match a
    single-process run; each process keeps its own rows and width."""
    if not dist.active:
        return estimator(inputs).float()
    names = [f.name for f in fields(AdvantageInputs)]
    values = {n: getattr(inputs, n) for n in names}
    parts = dist.gather({n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in values.items()})
    offsets = [0]
    for part in parts:
        ids = part["group_ids"]
        offsets.append(offsets[-1] + int(ids.max()) + 1 if ids.numel() else offsets[-1])
    merged: dict[str, Any] = {}
    for n in names:
        if parts[0][n] is None or n in _SHARED:
            merged[n] = parts[0][n]
        elif n == "group_ids":
            merged[n] = torch.cat([p[n] + off for p, off in zip(parts, offsets)])
        elif n in _PADDED:
            merged[n] = pad_cat([p[n] for p in parts], _PADDED[n])
        else:
            merged[n] = torch.cat([p[n] for p in parts])
    adv = estimator(AdvantageInputs(**merged)).float()
    start = sum(p["scores"].shape[0] for p in parts[: dist.rank])
    rows, width = inputs.mask.shape
    return adv[start: start + rows, :width].to(inputs.mask.device)
