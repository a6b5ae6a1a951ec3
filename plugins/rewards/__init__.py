"""Built-in reward functions, one module each (or a family): answer accuracy
(:mod:`~grpo_plugins.rewards.answers`), format (:mod:`~grpo_plugins.rewards.format`), DAPO's
overlong punishment (:mod:`~grpo_plugins.rewards.length`), a reward model
(:mod:`~grpo_plugins.rewards.model`), a remote scoring endpoint (:mod:`~grpo_plugins.rewards.remote`),
process (per-step) rewards (:mod:`~grpo_plugins.rewards.process`) and the reward model iterative
GRPO trains (:mod:`~grpo_plugins.rewards.trainable`), an LLM judge (:mod:`~grpo_plugins.rewards.judge`)
and code run against tests (:mod:`~grpo_plugins.rewards.code`: in the local sandbox,
:mod:`~grpo_plugins.rewards.sandbox` and :mod:`~grpo_plugins.rewards.sandbox_child`, with the
harness :mod:`~grpo_plugins.rewards.code_harness`, or on a Sandbox Fusion server,
:mod:`~grpo_plugins.rewards.fusion`); what they share is in :mod:`~grpo_plugins.rewards.common`.

Every component has TRL's signature ``reward(prompts, completions, **columns) ->
list[float | None]`` (see :data:`grpo_core.contracts.RewardFunction`): ``B`` prompts and
``B`` completions, each a string or, for conversational data, a list of chat messages
(a completion is then ``[{"role": "assistant", "content": text}]``); every other dataset
column arrives as a keyword list with one entry per completion, plus ``completion_ids``.
Unknown keyword arguments are accepted and ignored. ``None`` marks an unscorable
completion (the advantage estimator leaves it out of its group's statistics).
"""
