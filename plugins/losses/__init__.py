"""Built-in policy losses, by family: PPO's clip on the token and the sequence ratio (``clip``,
``gspo``: :mod:`~grpo_plugins.losses.clip`), other ways to bound the update (``cispo``, ``sapo``,
``gmpo``, ``dppo``: :mod:`~grpo_plugins.losses.trust_region`), the ratio-free policy gradient
(``gpg``, ``reinforce``: :mod:`~grpo_plugins.losses.policy_gradient`), the entropy-mechanism paper's
covariance losses (``clip-cov``, ``kl-cov``: :mod:`~grpo_plugins.losses.cov`) and the losses for
off-policy data (``opsm``, ``m2po``, ``topr``, ``vespo``: :mod:`~grpo_plugins.losses.off_policy`);
what they share is in :mod:`~grpo_plugins.losses.common`.

Each maps :class:`~grpo_core.contracts.PolicyLossInputs` (``logp``, ``old_logp``,
``advantages``, ``mask``, all ``(B, T)``) to a per-token loss to *minimise*, exactly zero on
padding, plus per-token metrics ``(B, T)``, detached and zero on padding (the engine averages
them over the mini-batch's tokens and max-reduces names ending in ``/max``):

- ``ratio``, ``ratio/max``: the importance ratio pi / pi_old the loss used;
- ``clip/low``: 1 where the lower clip is active (ratio below its range and A < 0);
- ``clip/high``: 1 where the upper clip is active (ratio above its range and A > 0);
- ``clip/region``: either of the two; plus each loss's own (``clip/dual``, ``gate``, ``cov``...).

Inputs on padding are replaced by 0 before any arithmetic, so inf/NaN there reach neither
the loss nor the gradient. Each module is a plugin of its own, listed in
``grpo_core.plugin_manager.DEFAULT_PLUGINS``.
"""
