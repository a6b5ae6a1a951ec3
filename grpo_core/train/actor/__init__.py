"""The actor: what turns prompts into scored experience.

It never imports the learner (:mod:`grpo_core.train.learner`); what it makes, an
:class:`~grpo_core.train.experience.Experience`, is defined beneath both sides.

- ``actor``: the :class:`Actor`, prompts in, a scored batch out, at a policy version.
- ``data``: the dataset's rows as prompts, in a seeded order with a checkpointable position.
- ``stream``: prompts from rows that stream, through a shuffle buffer, each process its share.
- ``images``: the images of a row, loaded, checked and rendered with the model's processor.
- ``rollout``: generation then scoring, one path for training and evaluation.
- ``scoring``: the spec's reward functions called on completions (TRL's convention).
- ``baseline``: the greedy-baseline rollout an estimator can ask for.
- ``episodes``: multi-turn rollouts (model turns and environment observations).
- ``agents``: episodes driven by agent programs over the endpoint.
- ``histories``: agent histories that are not append-only, split into training samples.
- ``agent_tasks``: the agent programs run in an event loop of their own, each failure its episode's.
- ``endpoint``: the OpenAI-compatible HTTP endpoint those programs talk to.
- ``streaming``: the endpoint's answers as server-sent events (``stream: true``).
- ``toolcalls``: tool calls and reasoning in the policy's text, per model family.
- ``responses_api``: ``/v1/responses`` requests as chat requests, and their answers.
- ``routes``: per-row choice of how a row's episodes run (``rollout.routing``).
"""
