"""The loop: a run built from a validated spec, its steps, evaluations and checkpoints.

It imports both sides (:mod:`grpo_core.train.actor`, :mod:`grpo_core.train.learner`) and
nothing below it imports it.

- ``assemble``: building a run from a spec (the model, the learner, the actor, the feed).
- ``run``: the training loop, its stops and its final save.
- ``step``: one GRPO step, from the feed's batch to the learner's update.
- ``state``: the run's record, saved in and restored from checkpoints.
- ``evaluate``: held-out evaluation, greedy and sampled.
- ``passk``: pass@k and mean@n, pure functions.
- ``iterative``: iterative GRPO's stages (reference reset, reward-model retraining).
- ``best``: the best checkpoints by an evaluation metric.
- ``sft``: the SFT stage before the GRPO steps (its steps, checkpoints and hand-over).
- ``demonstrations``: the SFT stage's rows as prompt and completion tokens with a loss mask.
"""
