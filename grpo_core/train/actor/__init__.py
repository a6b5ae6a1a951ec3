"""The actor: what turns prompts into scored experience.

It never imports the learner (:mod:`grpo_core.train.learner`); what it makes, an
:class:`~grpo_core.train.experience.Experience`, is defined beneath both sides.

- ``actor``: the :class:`Actor`, prompts in, a scored batch out, at a policy version.
- ``data``: the dataset's rows as prompts, in a seeded order with a checkpointable position.
- ``stream``: prompts from rows that stream, through a shuffle buffer, each process its share.
- ``images``: the images of a row, loaded, checked and rendered with the model's processor.
- ``rollout``: rollouts scored, one path for training and evaluation; rollouts cut and joined by group.
- ``scoring``: the spec's reward functions called on completions (TRL's convention).
- ``baseline``: the greedy-baseline rollout an estimator can ask for.
- ``drivers/``: the episode drivers, how a prompt's ``G`` episodes run (single turn, environment
  turns, agent programs over the endpoint, :mod:`grpo_core.endpoint`, per-row routes).
"""
