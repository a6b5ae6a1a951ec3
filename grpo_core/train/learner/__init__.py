"""The learner: what turns experience into optimizer steps.

It never imports the actor (:mod:`grpo_core.train.actor`); it reads an
:class:`~grpo_core.train.experience.Experience` and hands back weights.

- ``learner``: the :class:`Learner`, an experience in, an optimizer step out.
- ``batch``: the training batch (:class:`TrainBatch`) and its log-probs under a model.
- ``samples``: split agent episodes as one row per training sample, advantages per episode.
- ``update``: the policy update, ``mu`` passes over a batch in mini- and micro-batches.
- ``sft``: the supervised update, cross-entropy on demonstrations' completion tokens.
- ``logprobs``: log-probs of sampled tokens under a causal LM (padded or packed).
- ``head_logprobs``: the output layer's chosen-token log-probs without full-vocabulary copies.
- ``packing``: the padding-free forward, a micro-batch's rows packed into one sequence.
- ``routing``: routing replay, the sampler's expert routes forced on a mixture-of-experts policy.
- ``kl``: the reference model and the KL penalty, in the loss or in the reward.
- ``correction``: importance weights for the sampler/trainer mismatch.
- ``teacher``: the teacher's log-probs for on-policy distillation.
- ``optim``: AdamW, the learning-rate schedule, and :func:`optimizer_step`, the one optimizer step
  of every objective (the policy loss of ``update``, the cross-entropy of ``sft``).
- ``lean_adamw``: AdamW with bfloat16 moments.
- ``parallel``: the parallel strategy, one object per run (one process, DDP, FSDP2).
- ``sharding``: FSDP2's ``fully_shard`` of the policy and the reference.
- ``sequence_parallel``: each sequence split over a group of processes (Ulysses attention).
"""
