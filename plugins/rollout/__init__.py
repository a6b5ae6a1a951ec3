"""The ``hf`` rollout backend (:mod:`~grpo_plugins.rollout.hf`: transformers on the training model
or a generation copy of it), its lean decode loop and generation copy
(:mod:`~grpo_plugins.rollout.decode`), its prompts with images
(:mod:`~grpo_plugins.rollout.images`), and the policy's weights as a backend with its own copy
wants them (:mod:`~grpo_plugins.rollout.weights`, used by :mod:`grpo_plugins.vllm` too). The vLLM
backends are the package :mod:`grpo_plugins.vllm`.
"""
