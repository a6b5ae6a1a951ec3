"""Built-in plugins of grpo-core, installed as the ``grpo_plugins`` package, grouped by family:

- ``advantages/``: advantage estimators (``grpo.py``, ``process.py``, ``reinforce.py``, ``passk.py``);
- ``losses/``: policy losses (``clip.py``, ``trust_region.py``, ``policy_gradient.py``, ``cov.py``);
- ``kl.py``: KL penalties; ``aggregators.py``: loss aggregators;
- ``rewards/``: reward functions (``answers.py``, ``format.py``, ``length.py``, ``model.py``,
  ``remote.py``, ``process.py``, ``trainable.py``);
- ``step_splitters.py``: step splitters for process supervision;
- ``rollout/``: the ``hf`` rollout backend (``hf.py``, ``decode.py``) and the policy's weights for
  backends with their own copy (``weights.py``);
- ``vllm/``: the ``vllm`` and ``vllm-server`` rollout backends, the ``grpo-run serve`` command and
  what they share (its ``__init__`` draws their imports);
- ``datasets.py``: datasets; ``shapes.py``: a visual counting dataset that draws its images;
  ``trackers/``: trackers; ``environments/``: the tools environment.

Each module that registers something is one plugin, registered on the same plugin manager as
third-party ones (``grpo_core.plugin_manager.DEFAULT_PLUGINS`` lists them); what the modules of
a family share is public in its ``common.py`` (``binding.py`` for the components that are a pure
function with its options bound, which advantages and losses share).
"""
