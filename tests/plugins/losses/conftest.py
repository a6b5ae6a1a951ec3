"""What the policy-loss tests share: hypothesis strategies of ragged batches, the loss and
gradient of a component, and a per-token loop reference (imported as ``from .conftest import ...``)."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st

from grpo_core.contracts import PolicyLossInputs

F64 = torch.float64
NAN = float("nan")
FAST = settings(max_examples=40, deadline=None)


@st.composite
def batches(draw):
    """(logp leaf (B, T), advantages (B, T), mask (B, T)) with ragged rows, some empty."""
    rows = draw(st.integers(1, 5))
    length = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(0, length), min_size=rows, max_size=rows))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    logp = -torch.rand(rows, length, generator=gen, dtype=F64) * 3
    per_row = draw(st.booleans())
    adv = torch.randn(rows, 1 if per_row else length, generator=gen, dtype=F64).expand(rows, length)
    adv = torch.where(mask, adv, 0.0)
    return logp, adv, mask


@st.composite
def off_policy(draw, per_row: bool | None = None):
    """(logp (B, T), old_logp (B, T), advantages (B, T), mask (B, T)): ragged rows (some empty),
    log-ratios up to +-1.5, so that every clip and gate is exercised."""
    rows, length = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, length), min_size=rows, max_size=rows))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    logp = -torch.rand(rows, length, generator=gen, dtype=F64) * 3
    old = logp + (torch.rand(rows, length, generator=gen, dtype=F64) * 3 - 1.5)
    row_adv = draw(st.booleans()) if per_row is None else per_row
    adv = torch.randn(rows, 1 if row_adv else length, generator=gen, dtype=F64).expand(rows, length)
    return logp, old, torch.where(mask, adv, 0.0), mask


def grad_of(loss_fn, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logp.detach().clone().requires_grad_(True)
    loss = loss_fn(leaf)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def loss_and_grad(loss, logp, old, adv, mask):
    leaf = logp.clone().requires_grad_(True)
    out = loss(PolicyLossInputs(leaf, old, adv, mask))
    (grad,) = torch.autograd.grad(out.loss.sum(), leaf)
    return out, grad


def per_token_grad(loss, log_ratio, adv):
    """Gradient of each token's loss w.r.t. its logp, for ``logp - old_logp = log_ratio``."""
    old = torch.zeros_like(log_ratio)
    leaf = log_ratio.clone().requires_grad_(True)
    mask = torch.ones_like(log_ratio, dtype=torch.bool)
    out = loss(PolicyLossInputs(leaf, old, adv, mask))
    (grad,) = torch.autograd.grad(out.loss.sum(), leaf)
    return out, grad


def per_token_reference(logp, old, adv, mask, token_fn):
    """Loops over tokens: ``token_fn(lp, old_lp, a) -> (loss, d loss / d lp)``."""
    loss, grad = torch.zeros_like(logp), torch.zeros_like(logp)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t]:
                loss[i, t], grad[i, t] = token_fn(float(logp[i, t]), float(old[i, t]), float(adv[i, t]))
    return loss, grad
