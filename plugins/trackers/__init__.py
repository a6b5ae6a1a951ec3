"""Built-in trackers: ``mlflow`` (the default, :mod:`~grpo_plugins.trackers.mlflow`), ``console``
(:mod:`~grpo_plugins.trackers.console`), and the optional ``wandb`` and ``tensorboard``
(:mod:`~grpo_plugins.trackers.wandb`, :mod:`~grpo_plugins.trackers.tensorboard`), whose packages
are extras imported only when a run starts such a tracker; what the last two share is in
:mod:`~grpo_plugins.trackers.common`.

Trackers never raise for a failure of their own backend: the engine also writes every
metric to ``metrics.jsonl`` in the run folder, so nothing is lost when a server is down.
"""
