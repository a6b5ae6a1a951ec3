"""OpenRLHF 0.11.2's formulas, re-implemented for the peer-equivalence tests (OpenRLHF is not
installed).

Read in the ``openrlhf-0.11.2-cp311-cp311-manylinux1_x86_64.whl`` wheel from PyPI:
``openrlhf/trainer/ppo_utils/experience_maker.py`` (``compute_advantages_and_returns``,
``get_cumulative_returns``), ``openrlhf/models/utils.py`` (``compute_approx_kl``, ``compute_reward``),
``openrlhf/models/loss.py`` (``PolicyLoss``, ``aggregate_loss``) and the flags of
``openrlhf/cli/train_ppo_ray.py``. Rewards arrive as ``(P, G)`` groups of ``n_samples_per_prompt``.
"""

from __future__ import annotations

import torch

KL_IS_WEIGHT_CLIP = 10.0  # openrlhf/models/utils.py


def masked_mean(values, mask, dim=None):
    return (values * mask).sum() / mask.sum() if dim is None else (values * mask).sum(dim) / mask.sum(dim)


# --------------------------------------------------------------------------- advantages
def shaped_rewards(rewards, estimator):
    """The baseline step of ``compute_advantages_and_returns``; ``rewards`` is ``(P, G)``."""
    n = rewards.shape[1]
    if estimator == "rloo":
        return rewards - (rewards.sum(-1, keepdim=True) - rewards) / (n - 1)
    if estimator in ("reinforce_baseline", "dr_grpo"):
        return rewards - rewards.mean(-1, keepdim=True)
    if estimator == "group_norm":
        return (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-9)
    if estimator == "reinforce":
        return rewards
    raise ValueError(estimator)


def compute_reward(r, kl_coef, kl, action_mask, reward_clip_range=(-10, 10)):
    """``compute_reward``: the reward clamped to ``--reward.clip_range`` (default -10, 10) on each row's
    last action token, minus kl_coef * kl per token."""
    r = r.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    eos = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    last = torch.zeros_like(kl).scatter_(dim=1, index=eos, src=r.unsqueeze(1).to(kl.dtype))
    return last - kl_coef * kl


def cumulative_returns(rewards, action_mask, gamma):
    """``get_cumulative_returns``."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.size(0), dtype=rewards.dtype)
    rewards = action_mask * rewards
    for t in reversed(range(rewards.size(1))):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns


def advantages(rewards, action_mask, estimator, gamma=1.0, no_std_norm=False):
    """The advantages of one batch: shaped rewards on the last token, returns (gamma 1 except for
    ``reinforce``), then for ``reinforce``/``reinforce_baseline`` the batch normalization
    (population variance, ``clamp(min=1e-8).rsqrt()``)."""
    shaped = shaped_rewards(rewards, estimator).reshape(-1)
    reward = compute_reward(shaped, 0.0, torch.zeros_like(action_mask, dtype=shaped.dtype), action_mask)
    adv = cumulative_returns(reward, action_mask, gamma if estimator == "reinforce" else 1.0)
    if estimator in ("reinforce", "reinforce_baseline"):
        n = action_mask.sum()
        mean = (adv * action_mask).sum() / n
        rstd = 1 if no_std_norm else (((adv - mean).pow(2) * action_mask).sum() / n).clamp(min=1e-8).rsqrt()
        adv = (adv - mean) * rstd
    return adv


# --------------------------------------------------------------------------- kl
def compute_approx_kl(log_probs, log_probs_base, kl_estimator, log_probs_old=None, unbiased_gradient=False):
    """``compute_approx_kl``: k1 / k2 / k3 (k3's log-ratio bounded below at -10), every value clamped
    to [-10, 10]; with ``unbiased_gradient`` the value of that estimator and the gradient of
    w * k2, w = clamp(pi / pi_old, max 10) detached."""
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_estimator == "k1":
        value = log_ratio
    elif kl_estimator == "k2":
        value = log_ratio**2 / 2.0
    else:
        bounded = log_ratio.clamp(min=-10)
        value = (-bounded).exp() - 1 + bounded
    value = value.clamp(min=-10, max=10)
    if not unbiased_gradient:
        return value
    w = 1.0 if log_probs_old is None else (
        (log_probs.float() - log_probs_old.float()).exp().clamp(max=KL_IS_WEIGHT_CLIP).detach())
    surrogate = w * (log_ratio**2 / 2.0)
    return value.detach() + surrogate - surrogate.detach()


# --------------------------------------------------------------------------- loss
def aggregate_loss(loss, loss_mask, token_level_loss=True):
    """``aggregate_loss`` in one process (no global counts passed)."""
    if token_level_loss:
        return masked_mean(loss, loss_mask)
    counts = loss_mask.sum(dim=-1)
    seq_loss = (loss * loss_mask).sum(dim=-1) / (counts + 1e-8)
    seq_mask = (counts > 0).float()
    return masked_mean(seq_loss, seq_mask)


def policy_loss(log_probs, old_log_probs, advantages, action_mask, *, clip_eps_low=0.2, clip_eps_high=0.2,
                dual_clip=None, token_level_loss=True, policy_loss_type="ppo", is_correction_level="off",
                is_correction_mode="mask", is_correction_gating="ratio", is_correction_threshold=(0.5, 5.0),
                rollout_log_probs=None):
    """``PolicyLoss.forward``'s loss (the gating statistics ``binary_kl``/``tv`` left out: grpo-core has
    no such gate). ``is_correction_threshold`` is the (low, high) pair the CLI makes of one or two
    numbers (a single number h is (0, h))."""
    raw = log_probs - old_log_probs
    if policy_loss_type == "ppo":
        ratio = raw.clamp(min=-20.0, max=20.0).exp()
    else:
        token_level_loss = False
        log_ratio = log_probs - rollout_log_probs if is_correction_level != "off" else raw
        ratio = ((log_ratio * action_mask).sum(dim=-1) / action_mask.sum(dim=-1).clamp(min=1)).exp().unsqueeze(
            -1) * action_mask
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high) * advantages
    if dual_clip is None:
        loss = -torch.min(surr1, surr2)
    else:
        clip1 = torch.min(surr1, surr2)
        loss = -torch.where(advantages < 0, torch.max(clip1, dual_clip * advantages), clip1)
    if is_correction_level != "off" and policy_loss_type == "ppo":
        assert is_correction_gating == "ratio"
        low, high = is_correction_threshold
        is_log_ratio = (old_log_probs - rollout_log_probs).detach()
        token_is = is_log_ratio.exp()
        if is_correction_level == "seq":
            stat = masked_mean(is_log_ratio, action_mask, dim=-1).unsqueeze(-1).exp()
        else:
            stat = is_log_ratio.exp()
        if is_correction_mode == "clip":
            coef = stat.clamp(min=low, max=high)
        else:
            coef = torch.where((stat >= low) & (stat <= high), token_is, 0.0)
        loss = coef * loss
    return aggregate_loss(loss, action_mask, token_level_loss)
