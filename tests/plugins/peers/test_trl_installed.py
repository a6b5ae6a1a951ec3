"""Where TRL 1.16 is installed (the ``bench`` extra), the re-implementation the peer tests use is
checked against TRL's own functions: ``nanstd``, ``GRPOTrainer.get_off_policy_mask``,
``get_gamma_weights``, ``_compute_loss`` and ``SyncRefModelCallback._sync_target_model``. Elsewhere these tests are
skipped (and ``trl_1_16.py`` stands as read)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from . import trl_1_16 as mine
from .conftest import F64, FAST, assert_same, groups, peer

trl = pytest.importorskip("trl")
if not trl.__version__.startswith("1.16."):
    pytest.skip(f"trl {trl.__version__} installed, the re-implementation is of 1.16", allow_module_level=True)
from trl.trainer.callbacks import SyncRefModelCallback  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402


@FAST
@given(st.integers(1, 6).flatmap(lambda n: st.lists(st.one_of(st.floats(-5, 5), st.just(float("nan"))),
                                                   min_size=2 * n, max_size=2 * n)))
def test_nanstd_is_trl_s(values):
    x = torch.tensor(values, dtype=F64).view(-1, 2)
    torch.testing.assert_close(mine.nanstd(x, dim=1), nanstd(x, dim=1), equal_nan=True)


@FAST
@given(groups(spread=1.0), st.sampled_from([0.05, 0.5]))
def test_off_policy_mask_is_trl_s(batch, threshold):
    _, _, mask, logp, old, adv = batch
    got = mine.off_policy_mask(adv, logp, old, mask.to(F64), threshold)
    theirs = GRPOTrainer.get_off_policy_mask(adv, logp, old, mask.to(F64), threshold)
    torch.testing.assert_close(got, theirs)


@FAST
@given(groups(spread=1.0))
def test_gamma_weights_are_trl_s(batch):
    _, _, mask, logp, old, adv = batch
    got = mine.gamma_weights(adv[:, :1], logp - old, mask.to(F64))
    theirs = GRPOTrainer.get_gamma_weights(adv[:, :1], logp - old, mask.to(F64), None)
    torch.testing.assert_close(got, theirs)


@FAST
@given(st.sampled_from([0.6, 1.0]), st.integers(0, 2**31 - 1))
def test_sync_target_model_is_trl_s(alpha, seed):
    torch.manual_seed(seed)
    policy, a, b = (torch.nn.Linear(3, 2).double() for _ in range(3))
    b.load_state_dict(a.state_dict())
    mine.sync_target_model(policy, a, alpha)
    SyncRefModelCallback._sync_target_model(policy, b, alpha)
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x, y)


class _OneProcess:
    """What ``_compute_loss`` asks of TRL's accelerator, for one process."""

    num_processes, sync_gradients = 1, True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_own_loss(logp, old, adv, mask, *, loss_type, importance_sampling_level="token", epsilon_low=0.2,
                 epsilon_high=0.2, off_policy_mask_threshold=None, max_completion_length=None):
    """TRL's own ``GRPOTrainer._compute_loss`` on these log-probs (its model forward replaced by them),
    one process, one accumulation step, no KL, no entropy terms."""
    from collections import defaultdict
    from types import SimpleNamespace

    args = SimpleNamespace(delta=None, use_bias_correction_kl=True, sapo_temperature_pos=1.0,
                           sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                           vespo_lambda_neg=2.0, steps_per_generation=1)
    trainer = SimpleNamespace(
        args=args, loss_type=loss_type, importance_sampling_level=importance_sampling_level,
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=0.0,
        off_policy_mask_threshold=off_policy_mask_threshold,
        max_completion_length=max_completion_length, top_entropy_quantile=1.0, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, use_vllm=False, vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=1, accelerator=_OneProcess(), model=SimpleNamespace(training=True),
        _metrics=defaultdict(lambda: defaultdict(list)), get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None))
    rows, width = mask.shape
    inputs = {"prompt_ids": torch.zeros(rows, 1, dtype=torch.long), "prompt_mask": torch.ones(rows, 1),
              "completion_ids": torch.zeros(rows, width, dtype=torch.long), "completion_mask": mask.to(logp.dtype),
              "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": mask.sum().to(logp.dtype)}
    return GRPOTrainer._compute_loss(trainer, None, inputs)


LOSSES = [{"loss_type": "grpo", "epsilon_high": 0.28}, {"loss_type": "dapo"}, {"loss_type": "bnpo"},
          {"loss_type": "dr_grpo"}, {"loss_type": "luspo"},
          {"loss_type": "luspo", "importance_sampling_level": "sequence"},
          {"loss_type": "grpo", "importance_sampling_level": "sequence"}, {"loss_type": "cispo", "epsilon_high": 5.0},
          {"loss_type": "sapo"}, {"loss_type": "vespo"}, {"loss_type": "dapo", "off_policy_mask_threshold": 0.3}]


@FAST
@given(groups(spread=0.5), st.sampled_from(range(len(LOSSES))))
def test_compute_loss_is_trl_s(batch, case):
    """The re-implemented ``_compute_loss`` the peer tests compare grpo-core with (values and gradients)
    = TRL's own, for each ``loss_type``; ``luspo`` at TRL's default ``importance_sampling_level="token"``
    too, which TRL takes with a warning."""
    _, _, mask, logp, old, adv = batch
    kwargs = {**LOSSES[case], "max_completion_length": mask.shape[1] + 2}
    got = peer(lambda lp: mine.compute_loss(lp, old, adv, mask.to(F64), **kwargs), logp)
    theirs = peer(lambda lp: trl_own_loss(lp, old, adv, mask, **kwargs), logp)
    assert_same(got, theirs)
