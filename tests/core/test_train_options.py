"""Training options on a tiny real model: LoRA (reference = adapter off), gradient
checkpointing, bf16 autocast, a bf16 generation copy, KL placements, schedules."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from grpo_core.spec import load_spec
from grpo_core.testing import save_tiny_model
from grpo_core.train.learner.optim import lr_factor
from grpo_core.train.loop.assemble import build_run
from grpo_core.train.loop.step import train_step

torch.set_num_threads(1)
SPECS = Path(__file__).resolve().parents[2] / "specs"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def make_run(tiny_model, tmp_path, *overrides):
    base = [f"model.path={tiny_model}", "tracking=[]", f"train.output_dir={tmp_path}",
            "train.progress=false", "train.threads=1"]
    return build_run(load_spec(SPECS / "tiny.yaml", [*base, *overrides]))


def run_step(run, step):
    result = train_step(run.feed, run.learner, step)
    return result.metrics, result.samples


def reference(run):
    return run.learner.kl.reference if run.learner.kl is not None else None


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


def test_lora_reference_is_the_base_with_the_adapter_disabled(tiny_model, tmp_path):
    run = make_run(tiny_model, tmp_path, "model.lora={r: 4, alpha: 8}", "algorithm.kl.beta=0.1")
    assert reference(run).uses_adapter and reference(run).model is None  # no second copy
    trainable = [n for n, p in run.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    base = [p.detach().clone() for n, p in run.model.named_parameters() if not p.requires_grad]
    metrics = {}
    for step in range(2):
        metrics, _ = run_step(run, step)
    assert math.isfinite(metrics["loss"]) and metrics["kl"] > 0  # the adapter moved away from the base
    frozen = [p for n, p in run.model.named_parameters() if not p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(base, frozen))


def test_reference_copy_stays_frozen_without_lora(tiny_model, tmp_path):
    run = make_run(tiny_model, tmp_path, "algorithm.kl.beta=0.1", "train.lr=1.0e-2")
    ref_before = [p.detach().clone() for p in reference(run).model.parameters()]
    policy_before = weights(run.model)
    metrics, _ = run_step(run, 0)
    metrics, _ = run_step(run, 1)
    assert all(torch.equal(a, b) for a, b in zip(ref_before, reference(run).model.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(policy_before, weights(run.model)))
    assert metrics["kl"] > 0


def test_no_reference_model_when_beta_is_zero(tiny_model, tmp_path):
    run = make_run(tiny_model, tmp_path, "algorithm.kl.beta=0")
    assert reference(run) is None and run.learner.objective.kl is None


def test_kl_in_the_reward_lowers_the_rewards_fed_to_advantages(tiny_model, tmp_path):
    run = make_run(tiny_model, tmp_path, "algorithm.kl={name: k1, beta: 0.5, placement: reward}", "train.lr=1.0e-2")
    run_step(run, 0)
    metrics, _ = run_step(run, 1)
    assert run.learner.objective.kl is None  # not in the loss
    assert "kl" in metrics and math.isfinite(metrics["kl"])


@pytest.mark.parametrize("overrides", [
    ["model.gradient_checkpointing=true"],
    ["train.mixed_precision=bf16"],
    ["rollout.dtype=bfloat16"],
    ["train.schedule=cosine", "train.warmup_steps=2", "train.mini_batches=2", "algorithm.mu=2"],
])
def test_options_train_with_finite_loss(tiny_model, tmp_path, overrides):
    run = make_run(tiny_model, tmp_path, "train.lr=1.0e-2", *overrides)
    before = weights(run.model)
    for step in range(2):
        metrics, _ = run_step(run, step)
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics.get("grad_norm", 0.0))
    assert any(not torch.equal(a, b) for a, b in zip(before, weights(run.model)))
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


def test_schedules():
    assert [lr_factor(s, warmup=2, total=10, schedule="constant") for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    cos = [lr_factor(s, warmup=0, total=4, schedule="cosine") for s in range(5)]
    assert cos[0] == 1.0 and cos[2] == pytest.approx(0.5) and cos[4] == pytest.approx(0.0, abs=1e-12)
    lin = [lr_factor(s, warmup=1, total=5, schedule="linear") for s in range(5)]
    assert lin == pytest.approx([1.0, 1.0, 0.75, 0.5, 0.25])


def test_bf16_reference_copy_trains_and_is_refused_where_it_cannot_work(tiny_model, tmp_path):
    run = make_run(tiny_model, tmp_path, "algorithm.kl.beta=0.1", "algorithm.kl.reference_dtype=bfloat16",
                   "train.lr=1.0e-2")
    assert {p.dtype for p in reference(run).model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in run.model.parameters()} == {torch.float32}
    for step in range(2):
        metrics, _ = run_step(run, step)
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["kl"])
    assert metrics["kl"] > 0
    from grpo_core.errors import SpecError

    for extra, message in [("model.lora={r: 4}", "under model.lora the reference is the base model"),
                           ("algorithm.kl.ref_sync={every: 2}", "bfloat16 cannot follow algorithm.kl.ref_sync")]:
        with pytest.raises(SpecError, match=message):
            make_run(tiny_model, tmp_path, "algorithm.kl.beta=0.1", "algorithm.kl.reference_dtype=bfloat16", extra)


@pytest.mark.parametrize(("overrides", "needs_old"), [
    ([], False),  # one pass, one mini-batch: the current log-probs are the sampler's
    (["train.mini_batches=2"], True),  # the second mini-batch runs after an optimizer step
    # the engine's forwards then split the 16 rows otherwise than the check's one forward: the
    # two differ in the last bits (4.8e-7 here), as the case above does on other CPUs (issue 47)
    (["train.mini_batches=2", "rollout.group_size=8", "train.prompts_per_step=4", "train.micro_batch_size=null"],
     True),
])
def test_old_logprobs_are_computed_exactly_when_the_policy_moves_before_use(tiny_model, tmp_path, overrides, needs_old):
    from grpo_core.train.experience import Timer
    from grpo_core.train.learner.batch import batch_logprobs
    from grpo_core.train.learner.parallel import forward_of

    run = make_run(tiny_model, tmp_path, *overrides)
    experience = run.actor.collect(0)
    batch, _ = run.learner.prepare(experience, Timer())
    assert (batch.old_logp is not None) == needs_old
    if needs_old:
        expected = batch_logprobs(forward_of(run.model), batch, batch.mask.shape[0], 1.0, run.learner.autocast)
        # Another path (one forward over every row, no packing) than the engine's micro-batches:
        # equal within float32 rounding (1e-5 is ~20 ulp at |logp| ~ 6), not bit for bit, since
        # matrix products of other shapes or other CPU kernels round differently. A policy one
        # optimizer step away differs by orders of magnitude more.
        torch.testing.assert_close(batch.old_logp, expected, rtol=0, atol=1e-5)


def test_the_learner_scores_a_batch_at_the_temperature_it_was_sampled_at(tiny_model, tmp_path):
    """The actor owns the sampling temperature and the experience carries it: the learner's
    log-probs divide the logits by it, so with a bfloat16 generation copy the sampler's
    log-probs and the trainer's differ by rounding only, and by far more at temperature 1."""
    from grpo_core.train.experience import Timer
    from grpo_core.train.learner.batch import batch_logprobs
    from grpo_core.train.learner.parallel import forward_of

    run = make_run(tiny_model, tmp_path, "rollout.temperature=0.5", "rollout.dtype=bfloat16",
                   "algorithm.mu=2")
    experience = run.actor.collect(0)
    assert experience.temperature == 0.5
    sampled = experience.scored.rollout.sampling_logp
    assert sampled is not None  # the bf16 copy's own log-probs
    batch, _ = run.learner.prepare(experience, Timer())
    assert batch.temperature == 0.5
    mask = batch.mask
    at_one = batch_logprobs(forward_of(run.model), batch, batch.mask.shape[0], 1.0, run.learner.autocast)
    gap = (batch.old_logp - sampled)[mask].abs().mean()
    assert gap < 0.1 * (at_one - sampled)[mask].abs().mean()


@pytest.mark.parametrize("mask_truncated", [True, False])
def test_truncated_completions_leave_the_loss_only_when_asked(mask_truncated):
    """``rollout.mask_truncated_completions`` (DAPO's overlong filtering, off by default):
    a completion cut off at max_new_tokens has no token in the loss; the others keep their
    own mask, holes included."""
    from grpo_core.contracts import RolloutBatch
    from grpo_core.train.learner.learner import train_batch

    completion_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 0, 1]], dtype=torch.bool)
    rollout = RolloutBatch(
        prompt_ids=torch.ones(2, 2, dtype=torch.long), prompt_mask=torch.ones(2, 2, dtype=torch.bool),
        completion_ids=torch.arange(12).view(4, 3), completion_mask=completion_mask,
        truncated=torch.tensor([True, False, True, False]), completions=["a", "b", "c", "d"],
    )
    mask = train_batch(rollout, mask_truncated).mask
    expected = completion_mask.clone()
    if mask_truncated:
        expected[[0, 2]] = False
    assert torch.equal(mask, expected)
