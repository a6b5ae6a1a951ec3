"""Built-in advantage estimators, by family: GRPO's group-normalized outcome advantage and its
variants (``grpo``, ``dapo-token-scale``, ``gpg``, ``opo``: :mod:`~grpo_plugins.advantages.grpo`),
process supervision (``process``: :mod:`~grpo_plugins.advantages.process`), REINFORCE with other
baselines (``rloo``, ``reinforce++``, ``reinforce++-no-baseline``, ``remax``:
:mod:`~grpo_plugins.advantages.reinforce`), pass@k training (``passk``:
:mod:`~grpo_plugins.advantages.passk`), rewards normalized one by one (``gdpo``:
:mod:`~grpo_plugins.advantages.gdpo`) and on-policy distillation (``opd``:
:mod:`~grpo_plugins.advantages.distillation`); what they share is in :mod:`~grpo_plugins.advantages.common`.

Every estimator maps :class:`~grpo_core.contracts.AdvantageInputs` to advantages
``float (B, T)``, exactly zero where ``inputs.mask`` is False. Rows are grouped by
``inputs.group_ids`` (any ids, rows of one group need not be contiguous). A ``NaN`` score
marks an unscorable completion: it is left out of every statistic and gets advantage 0.
``process`` declares ``needs_step_scores`` (the engine fills the step tensors) and ``remax``
``needs_greedy_baseline`` (the engine fills ``inputs.baseline_scores`` with the score of one
greedy completion per prompt).

Shape vocabulary: ``P`` prompts, ``G`` group size, ``B = P*G`` rows, ``T`` completion
tokens, ``K`` steps per completion (process supervision). Each module is a plugin of its own,
listed in ``grpo_core.plugin_manager.DEFAULT_PLUGINS``.
"""
