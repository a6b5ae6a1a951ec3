"""The rollout family, engine-neutral. The ``hf`` backend (:mod:`~grpo_plugins.rollout.hf`:
transformers on the training model or a generation copy of it), its lean decode loop and
generation copy (:mod:`~grpo_plugins.rollout.decode`), its prompts with images
(:mod:`~grpo_plugins.rollout.images`) and its record of a mixture-of-experts model's routes
(:mod:`~grpo_plugins.rollout.routes`, routing replay); and what every backend with a copy of the weights of its
own shares, whatever its engine (:mod:`grpo_plugins.vllm`'s backends use them, and a second
server backend would too):

- the policy's weights as such a backend wants them (:mod:`~grpo_plugins.rollout.weights`, LoRA
  merged and named as the base model);
- the ``torch.distributed`` weight channel to a rollout server (:mod:`~grpo_plugins.rollout.channel`);
- delta pushes, only the elements that changed, checksummed (:mod:`~grpo_plugins.rollout.delta`,
  pure torch) and adapter-only LoRA pushes (:mod:`~grpo_plugins.rollout.adapter`);
- the weight pushes to rollout servers (:mod:`~grpo_plugins.rollout.pushes`: a server backend's
  base class, which reaches each server through a ``PushTarget`` client) and what else a backend
  of servers addressed by URL needs: URLs checked, prompts split, servers failed over
  (:mod:`~grpo_plugins.rollout.servers`), and each server's generation time followed, one that
  slows down named in the log (:mod:`~grpo_plugins.rollout.drift`);
- an engine's answers as plain records and a batch (:mod:`~grpo_plugins.rollout.outputs`) and
  partial rollouts' prefix continuation (:mod:`~grpo_plugins.rollout.partial`).

Imports go one way::

    hf -> decode, images, routes    pushes -> channel, delta, adapter, weights    partial -> outputs
    adapter -> weights    channel -> delta (which imports none)    servers, drift (which import none)

The plugin is ``hf``.
"""
