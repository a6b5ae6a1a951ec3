"""The component kinds: for each, the hook that registers it, the words messages use for it,
and its contract in :mod:`grpo_core.contracts`.

Its own module, below both the hook specifications (:mod:`grpo_core.hookspecs`) and the
registry (:mod:`grpo_core.registry`), which read it and not each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    """One component kind: its hook, the words messages use for it, and its contract.

    Attributes:
        hook: the ``register_<kind>s`` hook that registers components of this kind.
        label: the kind in words, as error messages and ``grpo-run plugins`` say it.
        contract: the name of its Protocol in :mod:`grpo_core.contracts`; every built
            component is checked against it (see :func:`grpo_core.registry.conform`).
    """

    hook: str
    label: str
    contract: str

    @property
    def protocol(self) -> type:
        """The contract's class (imported on first use: contracts import torch)."""
        from grpo_core import contracts

        return getattr(contracts, self.contract)


#: The component kinds, in the order the registry lists them.
KINDS: dict[str, Kind] = {
    "advantage_estimator": Kind("register_advantage_estimators", "advantage estimator", "AdvantageEstimator"),
    "kl_penalty": Kind("register_kl_penalties", "KL penalty", "KLPenalty"),
    "policy_loss": Kind("register_policy_losses", "policy loss", "PolicyLoss"),
    "loss_aggregator": Kind("register_loss_aggregators", "loss aggregator", "LossAggregator"),
    "rollout_backend": Kind("register_rollout_backends", "rollout backend", "RolloutBackend"),
    "reward_function": Kind("register_reward_functions", "reward function", "RewardFunction"),
    "dataset": Kind("register_datasets", "dataset", "Dataset"),
    "prompt_sampler": Kind("register_prompt_samplers", "prompt sampler", "PromptSampler"),
    "step_splitter": Kind("register_step_splitters", "step splitter", "StepSplitter"),
    "tracker": Kind("register_trackers", "tracker", "Tracker"),
    "environment": Kind("register_environments", "environment", "Environment"),
    "agent": Kind("register_agents", "agent", "Agent"),
    "launcher": Kind("register_launchers", "launcher", "Launcher"),
    "episode_driver": Kind("register_episode_drivers", "episode driver", "EpisodeDriver"),
}
