"""The ``algorithm`` section of a spec: the objective's plugin slots (advantage estimator,
KL penalty, policy loss, aggregator, step splitter) and the engine's own algorithm options."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from grpo_core.spec.slots import Section, Slot


class AdvantageSlot(Slot):
    kind = "advantage_estimator"
    name: str = Field("grpo", description="Advantage estimator: grpo, process, dapo-token-scale, rloo, reinforce++, "
                      "gdpo (per-reward normalization), opd (on-policy distillation from a teacher), ... "
                      "(grpo-run plugins lists them).")


class RefSyncSection(Section):
    """Every ``every`` steps, ``ref <- alpha * policy + (1 - alpha) * ref`` (TR-DPO,
    https://arxiv.org/abs/2404.09656; TRL's ``ref_model_sync_steps`` / ``ref_model_mixup_alpha``)."""

    every: int = Field(ge=1, description="Steps between two syncs.")
    alpha: float = Field(0.6, gt=0, le=1, description="Weight of the policy in the mix; 1 copies it.")


class AdaptiveKLSection(Section):
    """After each step, ``beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * min(1, B / horizon)``,
    with ``kl`` the step's mean KL per token (over all its completion tokens) and ``B`` its rows
    (completions, all processes): Ziegler et al. 2019, https://arxiv.org/abs/1909.08593, with
    ``B / horizon`` capped at 1 so that beta stays positive (one step moves it 20% at most)."""

    target: float = Field(gt=0, description="The KL (per token) to steer toward.")
    horizon: int = Field(
        10_000, ge=1, description="Completions (rows: prompts_per_step x group_size per step) over which beta "
        "moves by at most 20%; a step moves it by at most 20% x min(1, rows / horizon)."
    )


class DynamicSamplingSection(Section):
    """DAPO's dynamic sampling (https://arxiv.org/abs/2503.14476): groups whose ``metric`` is
    the same for all ``G`` completions carry no gradient; they are dropped and more prompts
    are sampled until ``train.prompts_per_step`` groups with a spread are collected."""

    metric: str = Field(
        "reward", description="reward (the weighted total) or the name of one reward function."
    )
    max_rounds: int = Field(
        4, ge=1, description="Rollout rounds per step at most; when they run out the batch is "
        "filled with the first zero-spread groups (logged as dynamic_sampling/groups_filled).",
    )


class KLSlot(Slot):
    kind = "kl_penalty"
    name: str = Field("low_var_kl", description="KL estimator: low_var_kl (k3), kl (k1), abs, mse (k2), "
                      "k1+ and k3+ (value of k1 / k3, gradient of k2).")
    beta: float = Field(
        0.0, ge=0, description="KL coefficient. 0 loads no reference model and computes no KL."
    )
    placement: Literal["loss", "reward"] = Field(
        "loss",
        description="loss: add beta*KL_t to the per-token loss (GRPO). reward: subtract "
        "beta*sum_t KL_t from each completion's reward before advantages (PPO).",
    )
    reference_dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="dtype of the reference copy; null keeps the policy's. bfloat16 halves its "
        "memory and, on CPUs with native bf16 (avx512_bf16 / amx) and on GPUs, its forward time; its "
        "log-probs differ from float32 ones by bf16 rounding, which biases the KL estimate upward (1.5e-3 "
        "per token on SmolLM2-135M, the size of the KL early in a run; README.md). Not with model.lora "
        "(the reference is then the policy with its adapter disabled) nor ref_sync (small moves vanish "
        "in bf16 rounding).",
    )
    ref_sync: RefSyncSection | None = Field(
        None, description="Move the reference toward the policy every few steps (TR-DPO, TRL's sync_ref_model); "
        "unset: the reference stays the initial policy.",
    )
    adaptive: AdaptiveKLSection | None = Field(
        None, description="Adapt beta toward a target KL (Ziegler et al. 2019; verl's kl_ctrl: adaptive has the "
        "same update where rows per step <= horizon, from the mean of each completion's mean KL); "
        "unset: beta is fixed.",
    )


class PolicyLossSlot(Slot):
    kind = "policy_loss"
    name: str = Field(
        "clip", description="Policy loss: clip (PPO clipped surrogate), gspo, cispo, sapo, gmpo, dppo, gpg, reinforce, "
        "clip-cov, kl-cov, opsm, m2po, topr, vespo.",
    )


class AggregationSlot(Slot):
    kind = "loss_aggregator"
    name: str = Field(
        "seq-mean-token-mean",
        description="How per-token losses become one scalar: seq-mean-token-mean (the GRPO "
        "objective's 1/G sum_i 1/|o_i| sum_t), token-mean (DAPO), seq-mean-token-sum, "
        "seq-mean-token-sum-norm (Dr. GRPO), token-sum.",
    )


class StepSplitterSlot(Slot):
    kind = "step_splitter"
    name: str = Field(
        "newline",
        description="How completions are cut into steps for process supervision (rewards that "
        "take `steps`, the process estimator): newline, blank-line, regex.",
    )


class RejectionSection(Section):
    """Rejection sampling of whole completions by their sequence-level sampler-to-trainer ratio
    (verl's ``rollout_rs`` ``seq_mean_k1`` / ``seq_sum_k1``, whose statistic is ``-log r``: its threshold
    string for ``[low, high]`` here is ``"{1/high}_{1/low}"``): a completion whose ratio lies outside
    ``[low, high]`` gets weight 0 on every token."""

    statistic: Literal["geometric", "product"] = Field(
        "geometric", description="geometric: exp(mean_t d_t), length-invariant (verl's seq_mean_k1, with the "
        "bounds inverted); product: exp(sum_t d_t), the sequence's importance ratio (seq_sum_k1); d_t = "
        "logp_train_old - logp_sampler.",
    )
    low: float = Field(gt=0, description="Lower bound of the accepted ratio, e.g. 0.999 for geometric.")
    high: float = Field(gt=0, description="Upper bound of the accepted ratio, e.g. 1.001 for geometric.")

    @model_validator(mode="after")
    def _check_bounds(self):
        if not self.low < self.high:
            raise ValueError(f"low must be below high (the accepted ratios are [low, high]); got {self.low!r} and "
                             f"{self.high!r}")
        return self


class RolloutCorrectionSection(Section):
    """Importance weights for the gap between the sampler's and the trainer's log-probs (a vLLM
    backend samples with other kernels, and often another precision): pure functions in
    :mod:`grpo_core.train.learner.correction`.

    With ``r = exp(logp_train_old - logp_sampler)`` per token (``level: token``) or per
    completion (``level: sequence``, the product over its tokens), each completion token's
    policy loss is multiplied by ``w = min(r, cap)`` (``mode: truncate``, TIS) or by
    ``w = r`` where ``r <= cap`` and 0 elsewhere (``mode: mask``); ``lower`` also zeroes
    ``r < lower`` (with ``mask``, IcePop's two-sided mask); ``reject`` zeroes whole completions
    by their sequence ratio; ``normalize`` divides the weights by their mean. ``w`` carries no
    gradient. The KL term is not weighted. Applies only when the backend returns ``sampling_logp``
    (``vllm`` does, ``hf`` samples from the trained weights and does not).
    """

    level: Literal["off", "token", "sequence"] = Field(
        "token", description="off (weight 1; reject still applies), token (one ratio per token) or sequence "
        "(one per completion).",
    )
    mode: Literal["truncate", "mask"] = Field(
        "truncate", description="truncate: w = min(r, cap); mask: w = r where r <= cap, else 0."
    )
    cap: float = Field(2.0, gt=1, description="The cap C on the sampler-to-trainer ratio.")
    lower: float | None = Field(
        None, gt=0, lt=1, description="Lower bound in (0, 1), or null (default): w = 0 where r < lower. With mode "
        "mask this is IcePop's two-sided mask, w = r on [lower, cap] and 0 outside (Ring-1T, "
        "https://arxiv.org/abs/2510.18855).",
    )
    reject: RejectionSection | None = Field(
        None, description="Reject whole completions whose sequence ratio is outside [low, high]; null (default): none.",
    )
    normalize: bool = Field(
        False, description="Divide the weights by their mean over the kept tokens (level token) or kept completions "
        "(level sequence) of each forward (one micro-batch: train.micro_batch_size rows, or the whole groups "
        "within train.micro_batch_tokens), so that they average 1 (verl's rollout_is_batch_normalize, which "
        "averages over the batch and counts the tokens its mask zeroed: the same with mode truncate when a "
        "forward is the batch).",
    )

    @property
    def active(self) -> bool:
        """Whether any weight can differ from 1."""
        return self.level != "off" or self.reject is not None

    @property
    def rejection(self) -> tuple[str, float, float] | None:
        """``(statistic, low, high)`` for :func:`grpo_core.train.learner.correction.rollout_correction`, or None."""
        return None if self.reject is None else (self.reject.statistic, self.reject.low, self.reject.high)


class AlgorithmSection(Section):
    """The objective: every choice is a plugin picked by name."""

    advantage: AdvantageSlot = Field(default_factory=AdvantageSlot, description="Advantage estimator.")
    kl: KLSlot = Field(default_factory=KLSlot, description="KL penalty to the reference model.")
    policy_loss: PolicyLossSlot = Field(default_factory=PolicyLossSlot, description="Policy loss.")
    aggregation: AggregationSlot = Field(default_factory=AggregationSlot, description="Loss aggregator.")
    step_splitter: StepSplitterSlot = Field(
        default_factory=StepSplitterSlot,
        description="Step splitter, used only when a reward function takes `steps` or the "
        "advantage estimator needs step scores.",
    )
    mu: int = Field(1, ge=1, description="Policy updates per rollout batch (GRPO's mu). 1, with train.mini_batches 1, "
                    "needs no old-policy forward.")
    entropy_coef: float = Field(
        0.0, ge=0, description="Entropy bonus coefficient; entropy is computed only when it is > 0."
    )
    early_stop_imp_ratio: float | None = Field(
        None, gt=1, description="Drop (skip the update of) a mini-batch whose mean importance ratio "
        "exceeds this; dropped mini-batches are counted and logged."
    )
    dynamic_sampling: DynamicSamplingSection | None = Field(
        None, description="Drop zero-spread groups and sample more prompts (DAPO); unset: off."
    )
    routing_replay: bool = Field(
        False, description="Routing replay (R3, arXiv:2510.11370) for a mixture-of-experts policy (transformers' "
        "Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, gpt-oss): the rollout backend records the experts each token was "
        "routed to where it was sampled, and every learner forward (old and reference log-probs, the update) "
        "forces them, the gate weights recomputed from the live router's logits so that the router still learns. "
        "Logged: routing/replay_mismatch_tokens, the share of tokens whose live routing differs. Needs a backend "
        "that records routes (hf; vllm and vllm-server refuse it, saying why); refused for a dense model.",
    )
    rollout_correction: RolloutCorrectionSection = Field(
        default_factory=RolloutCorrectionSection,
        description="Truncated importance sampling against sampler/trainer log-prob mismatch "
        "(backends that return sampling log-probs, e.g. vllm).",
    )
