"""The update stage: the fast paths give the same step as the plain one.

Tolerances: the model is float64, so differences come only from summation order
(micro-batches, skipped rows) and are far below 1e-9; the shared-prompt forward goes
through Llama's float32 RMSNorm upcast, hence 1e-6 there.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo_core.plugin_manager import load_plugins
from grpo_core.testing import build_model, build_tokenizer
from grpo_core.train.learner.batch import TrainBatch
from grpo_core.train.learner.kl import KLTerm
from grpo_core.train.learner.learner import Learner, UpdateSettings
from grpo_core.train.learner.parallel import forward_of
from grpo_core.train.learner.update import Objective, update

torch.set_num_threads(1)

P, G, T = 3, 4, 6


@pytest.fixture(scope="module")
def registry():
    return load_plugins(external=False).registry


@pytest.fixture(scope="module")
def base_model():
    torch.manual_seed(0)
    return build_model(build_tokenizer()).double()


def make_batch(zero_groups=(1,), seed=0) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(10, 300, (P, 5), generator=gen)
    prompt_mask = torch.ones(P, 5, dtype=torch.bool)
    prompt_mask[0, :2] = False  # left padding
    completion_ids = torch.randint(10, 300, (P * G, T), generator=gen)
    lengths = torch.randint(1, T + 1, (P * G,), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(P * G, 1, generator=gen, dtype=torch.float64).expand(-1, T).clone()
    for g in zero_groups:
        adv[g * G:(g + 1) * G] = 0.0
    adv = adv * mask
    return TrainBatch(prompt_ids, prompt_mask, completion_ids, mask, adv)


class NoSkip:
    """The same loss as the built-in, without declaring that zero advantages give zero loss."""

    zero_advantage_is_zero_loss = False

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, inputs):
        return self.inner(inputs)


def objective(registry, loss=None, aggregator="seq-mean-token-mean", **kw) -> Objective:
    loss = loss or registry.get("policy_loss", "clip").build()
    agg = registry.get("loss_aggregator", aggregator).build()
    defaults = dict(kl=None, entropy_coef=0.0, early_stop_imp_ratio=None, max_length=T)
    defaults.update(kw)
    return Objective(policy_loss=loss, aggregator=agg, **defaults)


def step(model, batch, obj, *, micro=None, mu=1, mini_batches=1):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    learner = Learner(model, opt, sched, obj, UpdateSettings(mu=mu, mini_batches=mini_batches, micro_batch_size=micro))
    metrics = update(learner, batch)
    return model, metrics


def max_diff(a, b) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def test_skipping_zero_advantage_rows_gives_the_same_step(registry, base_model):
    batch = make_batch(zero_groups=(1,))
    obj_fast = objective(registry)
    assert obj_fast.skips_zero_advantage_rows
    fast, m_fast = step(base_model, batch, obj_fast)
    slow, m_slow = step(base_model, batch, objective(registry, loss=NoSkip(obj_fast.policy_loss)))
    assert m_fast["perf/skipped_rows_frac"] == pytest.approx(1 / P)
    assert m_slow["perf/skipped_rows_frac"] == 0.0
    assert max_diff(fast, slow) < 1e-9
    assert max_diff(fast, base_model) > 1e-5  # the step did something
    assert m_fast["loss"] == pytest.approx(m_slow["loss"], abs=1e-12)


def test_a_mini_batch_of_only_zero_advantages_still_steps_the_optimizer(registry, base_model):
    """Adam's moments move even with a zero gradient; skipping every row must not change that."""
    batch = make_batch(zero_groups=range(P))
    obj = objective(registry)
    fast, m = step(base_model, batch, obj)
    slow, _ = step(base_model, batch, objective(registry, loss=NoSkip(obj.policy_loss)))
    assert m["perf/skipped_rows_frac"] == 1.0 and m["train/updates"] == 1.0
    assert max_diff(fast, slow) < 1e-12


@pytest.mark.parametrize("aggregator", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                        "seq-mean-token-sum-norm", "token-sum"])
def test_micro_batch_size_does_not_change_the_step(registry, base_model, aggregator):
    batch = make_batch(zero_groups=())
    obj = objective(registry, aggregator=aggregator)
    whole, _ = step(base_model, batch, obj)
    for micro in (1, 3, 5):
        split, _ = step(base_model, batch, obj, micro=micro)
        assert max_diff(whole, split) < 1e-6, micro


def test_micro_batches_by_token_budget_are_whole_groups_within_the_budget():
    """null micro_batch_size: whole groups of G rows, each row prompt (5) + completion (6) = 11
    positions, a group 44: a budget of 100 holds two groups; one below a group still takes one."""
    from grpo_core.train.learner.batch import micro_batch_rows

    batch = make_batch()
    assert micro_batch_rows(batch, None, 100) == 2 * G
    assert micro_batch_rows(batch, None, 44) == G and micro_batch_rows(batch, None, 43) == G
    assert micro_batch_rows(batch, None, 10**6) == 10**6 // 44 * G  # past the batch: one forward
    assert micro_batch_rows(batch, 5, 1) == 5  # an explicit size wins


@pytest.mark.parametrize("budget", [1, 44, 100, 4096])  # one group a forward, two, everything
def test_a_token_budget_does_not_change_the_step(registry, base_model, budget):
    batch = make_batch(zero_groups=())
    obj = objective(registry, aggregator="token-mean")
    whole, _ = step(base_model, batch, obj, micro=P * G)
    model = copy.deepcopy(base_model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    update(Learner(model, opt, sched, obj, UpdateSettings(micro_batch_tokens=budget)), batch)
    assert max_diff(whole, model) < 1e-6
    assert max_diff(whole, base_model) > 1e-5  # the step did something


def test_kl_in_the_loss_uses_every_row_and_reports_kl(registry, base_model):
    batch = make_batch(zero_groups=(0,))
    from grpo_core.train.learner.batch import batch_logprobs

    ref = copy.deepcopy(base_model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    batch.ref_logp = batch_logprobs(forward_of(ref), batch, 4, 1.0, nullcontext).double()
    obj = objective(registry, kl=KLTerm(registry.get("kl_penalty", "low_var_kl").build(), beta=0.1))
    assert not obj.skips_zero_advantage_rows
    _, m = step(base_model, batch, obj)
    assert m["perf/skipped_rows_frac"] == 0.0
    assert m["kl"] > 0


def test_mu_two_uses_old_logprobs_and_moves_the_ratio(registry, base_model):
    from grpo_core.train.learner.batch import batch_logprobs

    batch = make_batch(zero_groups=())
    batch.old_logp = batch_logprobs(forward_of(base_model), batch, 4, 1.0, nullcontext).double()
    _, m1 = step(base_model, batch, objective(registry), mu=1)
    _, m2 = step(base_model, batch, objective(registry), mu=2)
    assert m1["policy/ratio"] == pytest.approx(1.0, abs=1e-9)  # first pass: the policy is the old one
    assert m2["train/updates"] == 2.0
    assert abs(m2["policy/ratio"] - 1.0) > 1e-6  # the second pass sees the moved policy


def test_non_finite_loss_skips_the_update_and_counts_it(registry, base_model):
    class NaNLoss:
        zero_advantage_is_zero_loss = False  # the contract's flag (conform() fills it for built plugins)

        def __call__(self, inputs):
            out = registry.get("policy_loss", "clip").build()(inputs)
            out.loss = out.loss * float("nan")
            return out

    batch = make_batch(zero_groups=())
    model, m = step(base_model, batch, objective(registry, loss=NaNLoss()))
    assert m["train/nonfinite_updates"] == 1.0 and m["train/updates"] == 0.0
    assert max_diff(model, base_model) == 0.0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_early_stop_drops_a_mini_batch_whose_mean_ratio_is_too_high(registry, base_model):
    from grpo_core.train.learner.batch import batch_logprobs

    batch = make_batch(zero_groups=())
    batch.old_logp = batch_logprobs(forward_of(base_model), batch, 4, 1.0, nullcontext).double()
    batch.old_logp = batch.old_logp - 0.5 * batch.mask  # the sampler gave these tokens less mass
    model, m = step(base_model, batch, objective(registry, early_stop_imp_ratio=1.2))
    assert m["train/dropped_minibatches"] == 1.0 and m["train/updates"] == 0.0
    assert max_diff(model, base_model) == 0.0
    _, m = step(base_model, batch, objective(registry, early_stop_imp_ratio=2.0))
    assert m["train/dropped_minibatches"] == 0.0 and m["train/updates"] == 1.0


def test_entropy_is_computed_only_when_its_coefficient_is_set(registry, base_model):
    batch = make_batch(zero_groups=())
    _, without = step(base_model, batch, objective(registry))
    _, with_bonus = step(base_model, batch, objective(registry, entropy_coef=0.01))
    assert "entropy" not in without
    assert with_bonus["entropy"] > 0


# --------------------------------------------------------------------------- rollout correction
def test_rollout_correction_weights_by_hand():
    from grpo_core.train.learner.correction import rollout_correction

    ln = torch.log
    trainer = torch.tensor([[0.0, -1.0, -2.0, -5.0]], dtype=torch.float64)
    # d = trainer - sampler = [0, ln 3, -ln 4, (padding)]: token ratios 1, 3, 1/4
    sampler = trainer - torch.stack([torch.tensor(0.0), ln(torch.tensor(3.0)), -ln(torch.tensor(4.0)),
                                     torch.tensor(7.0)]).double()[None]
    mask = torch.tensor([[True, True, True, False]])
    w, m = rollout_correction(trainer, sampler, mask, level="token", mode="truncate", cap=2.0)
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, 0.25, 0.0])
    assert m["rollout_correction/capped"].tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert float(m["rollout_correction/logp_diff/max"][mask].max()) == pytest.approx(float(ln(torch.tensor(4.0))))
    w, _ = rollout_correction(trainer, sampler, mask, level="token", mode="mask", cap=2.0)
    assert w.tolist()[0] == pytest.approx([1.0, 0.0, 0.25, 0.0])
    # sequence level: r = exp(0 + ln 3 - ln 4) = 3/4 on every token of the row
    w, m = rollout_correction(trainer, sampler, mask, level="sequence", mode="truncate", cap=2.0)
    assert w.tolist()[0] == pytest.approx([0.75, 0.75, 0.75, 0.0])
    assert m["rollout_correction/k3"][0, 1].item() == pytest.approx(3.0 - float(ln(torch.tensor(3.0))) - 1.0)


@given(
    diffs=st.lists(st.floats(-30, 30, allow_nan=False), min_size=1, max_size=12),
    cap=st.floats(1.01, 10.0),
    level=st.sampled_from(["token", "sequence"]),
    mode=st.sampled_from(["truncate", "mask"]),
    data=st.data(),
)
def test_rollout_correction_weights_are_bounded_detached_and_zero_on_padding(diffs, cap, level, mode, data):
    from grpo_core.train.learner.correction import rollout_correction

    n = len(diffs)
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))[None]
    trainer = torch.randn(1, n, dtype=torch.float64, requires_grad=True)
    sampler = trainer.detach() - torch.tensor(diffs, dtype=torch.float64)[None]
    w, _ = rollout_correction(trainer, sampler, mask, level=level, mode=mode, cap=cap)
    assert not w.requires_grad
    assert bool((w[~mask] == 0).all())
    assert bool((w >= 0).all()) and bool((w <= cap * (1 + 1e-12)).all())
    same, _ = rollout_correction(trainer, trainer.detach(), mask, level=level, mode=mode, cap=cap)
    assert torch.equal(same, mask.double())  # no mismatch: every weight is exactly 1


def test_rollout_correction_scales_the_policy_gradient(registry, base_model):
    """With every sampler log-prob ln 2 below the trainer's and cap 3, each token's weight
    is 2: the gradient is twice the uncorrected one (mu = 1, so the clip is inactive)."""
    import math

    from grpo_core.spec.algorithm import RolloutCorrectionSection
    from grpo_core.train.learner.batch import batch_logprobs

    batch = make_batch(zero_groups=())
    trainer = batch_logprobs(forward_of(base_model), batch, 64, 1.0, nullcontext).double()

    def grads(correction, sampling):
        model = copy.deepcopy(base_model)
        b = copy.copy(batch)
        b.sampling_logp = sampling
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # a step that keeps the gradient readable
        opt.zero_grad = lambda set_to_none=False: None  # noqa: E731 - keep .grad after the step
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        m = update(Learner(model, opt, sched, objective(registry, correction=correction)), b)
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()]), m

    plain, m_plain = grads(None, None)
    doubled, m = grads(RolloutCorrectionSection(cap=3.0), trainer - math.log(2.0))
    assert torch.allclose(doubled, 2 * plain, rtol=1e-6, atol=1e-12)
    assert m["rollout_correction/weight"] == pytest.approx(2.0)
    assert m["rollout_correction/capped"] == 0.0
    assert "rollout_correction/weight" not in m_plain
    capped, m = grads(RolloutCorrectionSection(cap=1.5), trainer - math.log(2.0))
    # x1.5, unlike x2, is not exact in binary: the model's float32 RMSNorm rounds differently
    scale = float(plain.abs().max())
    assert torch.allclose(capped, 1.5 * plain, rtol=1e-5, atol=1e-6 * scale)
    assert m["rollout_correction/capped"] == 1.0
    off, m = grads(RolloutCorrectionSection(level="off"), trainer - math.log(2.0))
    assert torch.allclose(off, plain, rtol=0, atol=0)


def _kl_loss_and_grads(model, batch, obj):
    """The loss of every row (KL in the loss) and its gradient, one forward and backward."""
    from grpo_core.contracts import BatchStats
    from grpo_core.train.learner.update import micro_batch_loss

    model = copy.deepcopy(model)
    stats = BatchStats(int(batch.mask.sum()), P * G, T)
    loss, metrics, _, _ = micro_batch_loss(forward_of(model), batch, torch.arange(P * G), obj, stats)
    loss.backward()
    kl = float(metrics["kl"].detach()[batch.mask].mean())
    return float(loss.detach()), torch.cat([p.grad.flatten() for p in model.parameters()]), kl


def test_bf16_reference_gives_the_float32_loss_and_gradient_within_bf16_rounding(registry, base_model):
    """``algorithm.kl.reference_dtype: bfloat16``. Tolerances, from bf16's 8-bit mantissa:
    on the tiny model the reference log-probs move by at most 1.3e-3 nats (asserted < 1e-2);
    the k3 KL's gradient per token is ``beta * (1 - exp(ref - logp))``, so with beta 0.1 the
    loss moved by 2e-8 (asserted < 1e-5) and the gradient by 9e-5 of its norm (< 1e-3). The KL
    estimate gains a positive bias of the order of the squared rounding: 1.6e-7 per token
    here, where the float32 reference gives 0 (asserted < 1e-5)."""
    from grpo_core.train.learner.batch import batch_logprobs
    from grpo_core.train.learner.kl import Reference

    batch = make_batch(zero_groups=(0,))
    policy = copy.deepcopy(base_model).float()
    ref32, ref16 = Reference(policy), Reference(policy, "bfloat16")
    assert next(ref16.model.parameters()).dtype == torch.bfloat16
    assert next(ref32.model.parameters()).dtype == torch.float32
    logp32 = batch_logprobs(forward_of(ref32.model), batch, 4, 1.0, nullcontext).double()
    logp16 = batch_logprobs(forward_of(ref16.model), batch, 4, 1.0, nullcontext).double()
    diff = (logp32 - logp16)[batch.mask].abs()
    assert 0 < float(diff.max()) < 1e-2  # the bf16 path ran, and within rounding

    obj = objective(registry, kl=KLTerm(registry.get("kl_penalty", "low_var_kl").build(), beta=0.1))
    batch.ref_logp = logp32
    loss32, grad32, kl32 = _kl_loss_and_grads(base_model, batch, obj)
    batch.ref_logp = logp16
    loss16, grad16, kl16 = _kl_loss_and_grads(base_model, batch, obj)
    assert abs(loss32 - loss16) < 1e-5
    assert float((grad32 - grad16).norm()) < 1e-3 * float(grad32.norm())
    assert kl32 < 1e-9 and 0 < kl16 < 1e-5  # same weights: the float32 KL is rounding only


def test_reference_dtype_is_refused_under_lora():
    from grpo_core.train.learner.kl import Reference

    class Adapted(torch.nn.Linear):
        def disable_adapter(self):  # what peft models have: the reference is the policy itself
            raise AssertionError("not called")

    with pytest.raises(ValueError, match="reference_dtype needs a reference copy"):
        Reference(Adapted(2, 2), "bfloat16")


def test_no_gradient_is_held_after_an_update(registry, base_model):
    """The update frees the gradients once the optimizer has stepped (``set_to_none``): no
    gradient memory while the next rollout is generated and scored."""
    model = copy.deepcopy(base_model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    learner = Learner(model, opt, sched, objective(registry), UpdateSettings(max_grad_norm=1.0))
    update(learner, make_batch(zero_groups=()))
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # it did step
    assert all(p.grad is None for p in model.parameters())
