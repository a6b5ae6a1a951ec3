"""The `iterative` section: iterative GRPO's reward-model stage (DeepSeekMath, Algorithm 1)."""

from __future__ import annotations

from pydantic import Field

from grpo_core.spec.slots import Section, Slot


class VerifierSlot(Slot):
    kind = "reward_function"
    name: str = Field("accuracy", description="Reward function whose scores label the reward model's data.")


class IterativeSection(Section):
    """Iterative RL with GRPO (DeepSeekMath, Algorithm 1): at the start of each iteration
    the reference model is reset to the current policy, and a trainable reward model (an
    entry of `rewards`) is trained on fresh samples of the latest policy labelled by a
    verifier, plus a replay of historical data; then the policy trains for
    steps_per_iteration steps against it."""

    iterations: int = Field(ge=1, description="Number of iterations I.")
    steps_per_iteration: int = Field(
        ge=1, description="Policy steps M per iteration; train.steps defaults to I * M (and must equal it)."
    )
    reward_model: str = Field(
        min_length=1,
        description="Name of the entry of `rewards` to train at each iteration start: a trainable "
        "reward function such as trainable_reward_model.",
    )
    verifier: VerifierSlot = Field(
        default_factory=VerifierSlot,
        description="Reward function that labels the fresh samples (the task's verifier, e.g. "
        "accuracy); it does not reward the policy unless also listed in `rewards`.",
    )
    prompts: int = Field(
        16, ge=1, description="Training prompts whose completions (group_size each) train the reward "
        "model at each iteration start; drawn from the training data."
    )
    heldout_prompts: int = Field(
        4, ge=1, description="Further fresh prompts whose completions are held out to measure the "
        "reward model's accuracy, before and after its update."
    )
    group_size: int | None = Field(
        None, ge=1, description="Completions per prompt for the reward model's data; default rollout.group_size."
    )
