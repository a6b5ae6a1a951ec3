"""The loop: a run built from a validated spec, its stages (SFT, GRPO, or one's own) driven by
one loop, their evaluations and checkpoints.

It imports both sides (:mod:`grpo_core.train.actor`, :mod:`grpo_core.train.learner`) and
nothing below it imports it.

- ``assemble``: building a run from a spec (the model, the learner, the actor, the feed, the stages).
- ``run``: the one loop over a run's stages, their stops and the run's final save.
- ``checkpoints``: any stage's checkpoints written, its best steps ranked, a run resumed.
- ``grpo``: the GRPO stage (its steps, evaluation and state).
- ``step``: one GRPO step, from the feed's batch to the learner's update.
- ``state``: the run's record (its components, stages and what the loop keeps of each) and the
  :class:`Stage` protocol (a stage's steps, evaluation, state, hand-over) with its cadence.
- ``evaluate``: held-out evaluation, greedy and sampled.
- ``passk``: pass@k and mean@n, pure functions.
- ``iterative``: iterative GRPO's iteration start (reference reset, reward-model refresh), a hook of the GRPO stage.
- ``best``: the best checkpoints by an evaluation metric.
- ``sft``: the SFT stage before the GRPO steps (its steps, evaluation and hand-over).
- ``demonstrations``: the SFT stage's rows as prompt and completion tokens with a loss mask.
"""
