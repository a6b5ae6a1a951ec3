"""Built-in plugins of grpo-core, installed as the ``grpo_plugins`` package, grouped by family:

- ``advantages/``: advantage estimators (``grpo.py``, ``process.py``, ``reinforce.py``, ``passk.py``,
  ``gdpo.py``, ``distillation.py``; shared: ``common.py``);
- ``losses/``: policy losses (``clip.py``, ``trust_region.py``, ``policy_gradient.py``, ``cov.py``,
  ``off_policy.py``; shared: ``common.py``);
- ``kl.py``: KL penalties; ``aggregators.py``: loss aggregators; ``binding.py``: components that
  are a pure function with its options bound (advantages and losses share it);
- ``rewards/``: reward functions (``answers.py``, ``format.py``, ``length.py``, ``model.py``,
  ``remote.py``, ``process.py``, ``trainable.py``, ``judge.py``, and ``code.py``, which runs code in
  ``sandbox.py`` / ``sandbox_child.py`` with ``code_harness.py``, or on a server through
  ``fusion.py``; shared: ``common.py``);
- ``step_splitters.py``: step splitters for process supervision;
- ``rollout/``: the rollout family, engine-neutral: the ``hf`` rollout backend (``hf.py``,
  ``decode.py``, ``images.py``, and ``routes.py``, its record of expert routes) and what every
  backend with its own copy of the weights shares: the policy's weights (``weights.py``), the
  weight channel (``channel.py``), delta and adapter-only pushes (``delta.py``, ``adapter.py``),
  the pushes to servers (``pushes.py``), their split and failover (``servers.py``) and each
  server's generation time against its start (``drift.py``), an engine's
  answers (``outputs.py``) and partial rollouts' prefix continuation (``partial.py``);
- ``vllm/``: what only vLLM needs: the ``vllm`` backend (``colocated.py``, ``engine.py``), the
  ``vllm-server`` backend (``server.py``, ``client.py``), the ``grpo-run serve`` command
  (``serve.py``, ``worker.py``, ``guard.py``) and what both send vLLM (``io.py``);
- ``datasets.py``: datasets; ``shapes.py``: a visual counting dataset that draws its images;
  ``samplers.py``: prompt samplers;
- ``trackers/``: trackers (``mlflow.py``, ``console.py``, ``wandb.py``, ``tensorboard.py``; shared:
  ``common.py``);
- ``environments/``: the ``tools`` environment (``tools.py``) and its ``calculator.py``;
- ``agents/``: agents that run other libraries' environments through the endpoint (``openenv.py``;
  ``verifiers.py``, also registered as the ``verifiers`` agent and dataset);
- ``launchers/``: the launchers, side by side: ``local.py`` (``grpo-run run --nproc``), ``ray.py``
  and ``slurm.py``, which read one placement plan, ``placement.py``.
- ``drivers.py``: the episode drivers ``single-turn``, ``environment``, ``agent`` and ``routing``
  (the engine's, :mod:`grpo_core.train.actor.drivers`).
- ``tinker/``: ``grpo-run tinker-serve``, the Tinker API on a local base model: the routes and
  futures (``server.py``), the SDK's protobuf (``wire.py``), the training clients' adapters and
  optimizers (``state.py``), Tinker's losses (``objectives.py``), sampling (``sampling.py``), the
  vLLM engines it can sample with (``engines.py``) and each client's MLflow run (``tracking.py``).

Each module that registers something is one plugin, registered on the same plugin manager as
third-party ones (``grpo_core.plugin_manager.DEFAULT_PLUGINS`` lists them); what the modules of
a family share is public in its ``common.py``.
"""
