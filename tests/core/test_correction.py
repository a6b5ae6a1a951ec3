"""Rollout correction (grpo_core.train.learner.correction): IcePop's two-sided mask, rejection of whole
rows by the sequence ratio and batch-normalised weights, against a plain loop, by hand, as
invariants, through the spec section, and in the engine's loss."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_core.contracts import BatchStats
from grpo_core.plugin_manager import load_plugins
from grpo_core.spec.algorithm import RolloutCorrectionSection
from grpo_core.testing import build_model, build_tokenizer
from grpo_core.train.learner.batch import TrainBatch
from grpo_core.train.learner.correction import rollout_correction
from grpo_core.train.learner.parallel import forward_of
from grpo_core.train.learner.update import Objective, micro_batch_loss

F64 = torch.float64
FAST = settings(max_examples=60, deadline=None)


def loop_weights(diff, mask, *, level, mode, cap, lower, reject, normalize):
    """The options as written in the module doc, token by token."""
    rows, length = mask.shape
    w, kept = [[0.0] * length for _ in range(rows)], [[False] * length for _ in range(rows)]
    for i in range(rows):
        tokens = [t for t in range(length) if mask[i, t]]
        seq = sum(float(diff[i, t]) for t in tokens)
        accepted = True
        if reject is not None:
            statistic, low, high = reject
            ratio = math.exp(seq / max(len(tokens), 1) if statistic == "geometric" else seq)
            accepted = low <= ratio <= high
        for t in tokens:
            r = 1.0 if level == "off" else math.exp(float(diff[i, t]) if level == "token" else seq)
            over = level != "off" and r > cap
            weight = min(r, cap) if mode == "truncate" else (0.0 if over else r)
            keep = accepted and not (mode == "mask" and over) and not (lower and level != "off" and r < lower)
            w[i][t], kept[i][t] = (weight if keep else 0.0), keep
    if normalize:
        if level == "sequence":
            values = [next(w[i][t] for t in range(length) if kept[i][t]) for i in range(rows) if any(kept[i])]
        else:
            values = [w[i][t] for i in range(rows) for t in range(length) if kept[i][t]]
        if values and sum(values) > 0:
            mean = sum(values) / len(values)
            w = [[x / mean for x in row] for row in w]
    return torch.tensor(w, dtype=F64)


@st.composite
def cases(draw):
    rows, length = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(0, length), min_size=rows, max_size=rows))
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    diffs = draw(st.lists(st.floats(-1.5, 1.5), min_size=rows * length, max_size=rows * length))
    diff = torch.tensor(diffs, dtype=F64).reshape(rows, length) * mask
    options = dict(
        level=draw(st.sampled_from(["off", "token", "sequence"])),
        mode=draw(st.sampled_from(["truncate", "mask"])),
        cap=draw(st.sampled_from([1.5, 2.0, 5.0])),
        lower=draw(st.sampled_from([None, 0.5, 0.8])),
        reject=draw(st.sampled_from([None, ("geometric", 0.7, 1.3), ("product", 0.5, 2.0)])),
        normalize=draw(st.booleans()),
    )
    return diff, mask, options


@FAST
@given(cases())
def test_weights_against_the_plain_loop(case):
    diff, mask, options = case
    trainer = torch.randn(mask.shape, dtype=F64, requires_grad=True)
    sampler = trainer.detach() - diff
    w, metrics = rollout_correction(trainer, sampler, mask, **options)
    torch.testing.assert_close(w, loop_weights(diff, mask, **options), rtol=1e-12, atol=1e-12)
    assert not w.requires_grad and bool((w[~mask] == 0).all())
    for name, value in metrics.items():
        assert value.shape == mask.shape and bool((value[~mask] == 0).all()), name


@FAST
@given(cases())
def test_normalised_weights_average_one_over_what_is_kept(case):
    diff, mask, options = case
    options["normalize"] = True
    trainer = torch.zeros(mask.shape, dtype=F64)
    w, metrics = rollout_correction(trainer, trainer - diff, mask, **options)
    kept = w > 0
    if not bool(kept.any()):
        return
    if options["level"] == "sequence":
        per_row = w.amax(dim=1)[kept.any(dim=1)]
        assert float(per_row.mean()) == pytest.approx(1.0, rel=1e-12)
    else:
        assert float(w[kept].mean()) == pytest.approx(1.0, rel=1e-12)


def test_icepop_two_sided_mask_by_hand():
    """Ratios 0.3, 0.6, 1, 3, 6 with lower 0.5, cap 5: mask mode keeps r on [0.5, 5] (IcePop's M(r));
    truncate mode with lower zeroes 0.3 and caps 6 at 5."""
    ratios = torch.tensor([[0.3, 0.6, 1.0, 3.0, 6.0]], dtype=F64)
    mask = torch.ones_like(ratios, dtype=torch.bool)
    trainer = torch.zeros_like(ratios)
    w, m = rollout_correction(trainer, -ratios.log(), mask, level="token", mode="mask", cap=5.0, lower=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.6, 1.0, 3.0, 0.0]], dtype=F64))
    assert m["rollout_correction/below"].tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    assert m["rollout_correction/capped"].tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0]]
    w, _ = rollout_correction(trainer, -ratios.log(), mask, level="token", mode="truncate", cap=5.0, lower=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.6, 1.0, 3.0, 5.0]], dtype=F64))


def test_rejection_by_hand_geometric_is_length_invariant_product_is_not():
    """Row 0: one token, d = 0.1; row 1: four tokens, d = 0.1 each. Geometric ratio e^0.1 for both
    (accepted by [0.9, 1.2]); product e^0.1 and e^0.4 = 1.49 (row 1 rejected by [0.5, 1.2])."""
    mask = torch.tensor([[True, False, False, False], [True, True, True, True]])
    diff = 0.1 * mask.to(F64)
    trainer = torch.zeros(2, 4, dtype=F64)
    w, m = rollout_correction(trainer, trainer - diff, mask, level="off", mode="truncate", cap=2.0,
                              reject=("geometric", 0.9, 1.2))
    assert torch.equal(w, mask.to(F64)) and float(m["rollout_correction/rejected"].sum()) == 0
    w, m = rollout_correction(trainer, trainer - diff, mask, level="off", mode="truncate", cap=2.0,
                              reject=("product", 0.5, 1.2))
    assert w.tolist() == [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert m["rollout_correction/rejected"].tolist() == [[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]


# --------------------------------------------------------------------------- spec section
def test_section_options_and_their_errors():
    section = RolloutCorrectionSection(level="off", reject={"low": 0.999, "high": 1.001})
    assert section.active and section.rejection == ("geometric", 0.999, 1.001)
    assert not RolloutCorrectionSection(level="off").active
    assert RolloutCorrectionSection().rejection is None and RolloutCorrectionSection().normalize is False
    with pytest.raises(ValidationError, match="low must be below high"):
        RolloutCorrectionSection(reject={"low": 1.1, "high": 0.9})
    with pytest.raises(ValidationError, match="lower"):
        RolloutCorrectionSection(lower=1.5)
    with pytest.raises(ValidationError, match="statistic"):
        RolloutCorrectionSection(reject={"statistic": "mean", "low": 0.5, "high": 2.0})
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        RolloutCorrectionSection(lower_bound=0.5)


# --------------------------------------------------------------------------- in the engine's loss
P, G, T = 2, 2, 5


def _batch() -> TrainBatch:
    gen = torch.Generator().manual_seed(3)
    mask = torch.arange(T)[None, :] < torch.tensor([5, 3, 4, 2])[:, None]
    adv = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]], dtype=F64).expand(-1, T) * mask
    return TrainBatch(torch.randint(10, 300, (P, 4), generator=gen), torch.ones(P, 4, dtype=torch.bool),
                      torch.randint(10, 300, (P * G, T), generator=gen), mask, adv.clone())


def test_a_rejected_row_adds_nothing_to_the_loss_or_gradient():
    """The sampler's log-probs are those of the trainer except on row 0, 0.5 nats lower per token:
    rejecting rows with geometric ratio above 1.1 removes row 0 exactly, as zeroing its advantage does."""
    torch.manual_seed(0)
    model = build_model(build_tokenizer()).double()
    registry = load_plugins(external=False).registry
    batch = _batch()
    stats = BatchStats(int(batch.mask.sum()), P * G, T)

    def run(b, correction):
        m = copy.deepcopy(model)
        obj = Objective(policy_loss=registry.get("policy_loss", "clip").build(),
                        aggregator=registry.get("loss_aggregator", "seq-mean-token-mean").build(), kl=None,
                        entropy_coef=0.0, early_stop_imp_ratio=None, max_length=T,
                        correction=correction)
        loss, metrics, logp, _ = micro_batch_loss(forward_of(m), b, torch.arange(P * G), obj, stats)
        loss.backward()
        return float(loss.detach()), torch.cat([p.grad.flatten() for p in m.parameters()]), metrics, logp.detach()

    _, _, _, logp = run(batch, None)
    shifted = copy.copy(batch)
    shifted.sampling_logp = (logp - 0.5 * torch.tensor([1.0, 0, 0, 0], dtype=F64)[:, None]) * batch.mask
    reject = RolloutCorrectionSection(level="off", reject={"low": 0.9, "high": 1.1})
    loss, grad, metrics, _ = run(shifted, reject)
    zeroed = copy.copy(batch)
    zeroed.advantages = batch.advantages.clone()
    zeroed.advantages[0] = 0.0
    expected_loss, expected_grad, _, _ = run(zeroed, None)
    assert loss == pytest.approx(expected_loss, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-14)
    rejected = metrics["rollout_correction/rejected"]
    assert rejected[0].sum() == 5 and rejected[1:].sum() == 0
    # level off and nothing rejected: exactly the uncorrected loss
    same, same_grad, _, _ = run(shifted, RolloutCorrectionSection(level="off", reject={"low": 0.1, "high": 10.0}))
    plain, plain_grad, _, _ = run(batch, None)
    assert same == plain and torch.equal(same_grad, plain_grad)


def test_mask_mode_is_areals_decoupled_ppo_objective_by_hand():
    """Asynchronous rollouts (rollout.max_staleness): a behaviour policy pi_behav that lags the
    proximal policy pi_prox (the learner's before the update). AReaL's decoupled PPO loss, per
    token: w = pi_prox / pi_behav, tokens with w > C left out, times the clipped surrogate on
    r = pi_theta / pi_prox; token-mean over the completion tokens. ``level: token, mode: mask,
    cap: C`` gives exactly that loss and its gradient."""
    torch.manual_seed(0)
    model = build_model(build_tokenizer()).double()
    registry = load_plugins(external=False).registry
    batch = _batch()
    stats = BatchStats(int(batch.mask.sum()), P * G, T)
    eps, cap = 0.2, 1.5

    def objective(correction):
        return Objective(policy_loss=registry.get("policy_loss", "clip").build(),
                         aggregator=registry.get("loss_aggregator", "token-mean").build(), kl=None,
                         entropy_coef=0.0, early_stop_imp_ratio=None, max_length=T,
                         correction=correction)

    _, _, logp, _ = micro_batch_loss(forward_of(copy.deepcopy(model)), batch, torch.arange(P * G),
                                     objective(None), stats)
    gen = torch.Generator().manual_seed(1)
    prox = (logp.detach() + 0.3 * torch.randn(logp.shape, generator=gen, dtype=F64)) * batch.mask
    behav = (prox - 0.6 * torch.rand(logp.shape, generator=gen, dtype=F64)) * batch.mask  # w in [1, e^0.6]
    lagged = copy.copy(batch)
    lagged.old_logp, lagged.sampling_logp = prox, behav

    engine_model = copy.deepcopy(model)
    section = RolloutCorrectionSection(level="token", mode="mask", cap=cap)
    loss, _, _, _ = micro_batch_loss(forward_of(engine_model), lagged, torch.arange(P * G), objective(section), stats)
    loss.backward()

    hand_model = copy.deepcopy(model)
    _, _, theta, _ = micro_batch_loss(forward_of(hand_model), batch, torch.arange(P * G), objective(None), stats)
    hand_model.zero_grad()
    w = torch.exp(prox - behav)
    keep = batch.mask & (w <= cap)
    assert keep.sum() < batch.mask.sum()  # some tokens above the cap: the mask is exercised
    ratio = torch.exp(theta - prox)
    adv = batch.advantages
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
    expected = (surrogate * w * keep).sum() / batch.mask.sum()
    expected.backward()
    assert float(loss) == pytest.approx(float(expected), rel=1e-12, abs=1e-15)
    for mine, theirs in zip(engine_model.parameters(), hand_model.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-10, atol=1e-14)
