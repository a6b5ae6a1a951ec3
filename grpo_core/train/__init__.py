"""The training engine, by role.

- ``actor/``: prompts in, scored experience out (rollout, scoring, data, episodes, agents).
- ``learner/``: experience in, optimizer steps out (update, log-probs, KL, parallel strategy).
- ``loop/``: the run built from a spec, its steps, evaluations and checkpoints.

At this level only what crosses the seam or underlies both sides, importing neither:

- ``experience``: the value the actor makes and the learner consumes.
- ``reasoning_steps``: the reasoning steps of completions, part of that value.
- ``model``: loading the policy, its tokenizer or processor, and the reference model.
- ``recompute``: what a checkpointed layer's recomputation in the backward runs under (the
  learner's packed attention, its replayed routes), set up when ``model`` enables checkpointing.
- ``feed``: how experience reaches the loop, synchronously.
- ``pipeline``: the asynchronous feed, an actor thread ahead of the learner.
- ``distributed``: the process group and its collectives.
- ``seeds``: seeded random streams.
- ``signals``: the stop signals a run honours.
"""
