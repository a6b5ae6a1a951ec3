"""Where TRL 1.16 is installed (the ``bench`` extra), the re-implementation the peer tests use is
checked against TRL's own functions: ``nanstd``, ``GRPOTrainer.get_off_policy_mask``,
``get_gamma_weights`` and ``SyncRefModelCallback._sync_target_model``. Elsewhere these tests are
skipped (and ``trl_1_16.py`` stands as read)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from . import trl_1_16 as mine
from .conftest import F64, FAST, groups

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
