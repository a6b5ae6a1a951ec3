"""verl 0.9.1's formulas, re-implemented for the peer-equivalence tests (verl is not installed).

Each function follows the verl function named in its docstring step by step, as read in the
``verl-0.9.1-py3-none-any.whl`` wheel from PyPI: ``verl/trainer/ppo/core_algos.py`` (advantage
estimators, policy losses, ``kl_penalty``, ``agg_loss``), ``verl/trainer/ppo/rollout_corr_helper.py``
(rollout correction), ``verl/utils/torch_functional.py`` (``masked_mean``/``masked_var``/
``masked_whiten``) and ``verl/trainer/distillation/losses.py`` (on-policy distillation). Inputs:
``scores (B,)`` (verl's ``token_level_rewards`` summed), ``mask (B, T)`` float, ``index`` a list.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

SAFETY_BOUND = 20.0  # rollout_corr_helper.SAFETY_BOUND


# --------------------------------------------------------------------------- torch_functional
def masked_mean(values, mask, axis=None):
    """``masked_mean``: sum / (count + 1e-8)."""
    total = (values * mask).sum() if axis is None else (values * mask).sum(dim=axis)
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    return total / (count + 1e-8)


def masked_var(values, mask):
    """``masked_var`` (unbiased): the masked mean of the squared deviations times n / (n - 1)."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    n = mask.sum()
    return variance * (n / (n - 1))


def masked_whiten(values, mask):
    """``masked_whiten``: (x - mean) * rsqrt(var + 1e-8)."""
    return (values - masked_mean(values, mask)) * torch.rsqrt(masked_var(values, mask) + 1e-8)


# --------------------------------------------------------------------------- advantages
def _groups(index):
    groups = defaultdict(list)
    for i, idx in enumerate(index):
        groups[idx].append(i)
    return groups


def grpo(scores, mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """``compute_grpo_outcome_advantage``: per group torch.mean / torch.std (unbiased); a group of one
    gets mean 0 and std 1."""
    out = scores.clone()
    for rows in _groups(index).values():
        group = scores[rows]
        mean, std = (torch.tensor(0.0), torch.tensor(1.0)) if len(rows) == 1 else (group.mean(), group.std())
        for i in rows:
            out[i] = (scores[i] - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores[i] - mean
    return out[:, None] * mask


def gdpo(score_list, mask, index, weights=None, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """``compute_gdpo_outcome_advantage``: grpo on each reward key's scores, the weighted sum, then
    ``masked_whiten`` over the response tokens."""
    weights = [1.0] * len(score_list) if weights is None else weights
    total = None
    for w, scores in zip(weights, score_list):
        part = w * grpo(scores, mask, index, epsilon, norm_adv_by_std_in_grpo)
        total = part if total is None else total + part
    return masked_whiten(total, mask) * mask


def rloo(scores, mask, index):
    """``compute_rloo_outcome_advantage``: r * n / (n - 1) - mean * n / (n - 1)."""
    out = scores.clone()
    for rows in _groups(index).values():
        n = len(rows)
        if n > 1:
            mean = scores[rows].mean()
            for i in rows:
                out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    return out[:, None] * mask


def reinforce_plus_plus_baseline(scores, mask, index):
    """``compute_reinforce_plus_plus_baseline_outcome_advantage``: r - group mean on every token, then
    ``masked_whiten`` over the batch."""
    out = scores.clone()
    for rows in _groups(index).values():
        mean = torch.tensor(0.0) if len(rows) == 1 else scores[rows].mean()
        for i in rows:
            out[i] = scores[i] - mean
    tokens = out[:, None].expand_as(mask) * mask
    return masked_whiten(tokens, mask) * mask


def reinforce_plus_plus(token_level_rewards, mask, gamma):
    """``compute_reinforce_plus_plus_outcome_advantage``: discounted returns, then ``masked_whiten``."""
    returns = torch.zeros_like(token_level_rewards)
    running = 0
    for t in reversed(range(token_level_rewards.shape[1])):
        new_running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = new_running * mask[:, t]
        running = new_running * mask[:, t] + running * (1 - mask[:, t])
    return masked_whiten(returns, mask) * mask


def opo(scores, mask, index):
    """``compute_opo_outcome_advantage``: r - sum_j |o_j| r_j / sum_j |o_j| per group."""
    lengths = mask.sum(dim=-1)
    out = scores.clone()
    for rows in _groups(index).values():
        baseline = torch.tensor(0.0) if len(rows) == 1 else (lengths[rows] * scores[rows]).sum() / lengths[rows].sum()
        for i in rows:
            out[i] = scores[i] - baseline
    return out[:, None] * mask


def remax(token_level_rewards, reward_baselines, mask):
    """``compute_remax_outcome_advantage``: reward-to-go minus the greedy completion's reward."""
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - reward_baselines[:, None] * mask


def gpg(scores, mask, index, f_norm=1.0):
    """``compute_gpg_outcome_advantage``: alpha = B / count_nonzero(scores), alpha (r - mean) / f_norm."""
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    out = scores.clone()
    for rows in _groups(index).values():
        mean = torch.tensor(0.0) if len(rows) == 1 else scores[rows].mean()
        for i in rows:
            out[i] = alpha * (scores[i] - mean) / f_norm
    return out[:, None] * mask


# --------------------------------------------------------------------------- kl
def kl_penalty(logprob, ref_logprob, name):
    """``kl_penalty`` / ``kl_penalty_forward``: with a trailing '+', the value of the estimator and
    the gradient of k2 (straight-through)."""
    base = name[:-1] if name.endswith("+") else name
    if base in ("kl", "k1"):
        forward = logprob - ref_logprob
    elif base == "abs":
        forward = (logprob - ref_logprob).abs()
    elif base in ("mse", "k2"):
        forward = 0.5 * (logprob - ref_logprob).square()
    elif base in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        forward = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    else:
        raise ValueError(name)
    if not name.endswith("+") or name in ("mse", "k2"):
        return forward
    backward = 0.5 * (logprob - ref_logprob).square()
    return backward - backward.detach() + forward.detach()


def adaptive_kl_update(value, current_kl, n_steps, target, horizon):
    """``AdaptiveKLController.update``: the coefficient after one step of ``n_steps`` rows."""
    proportional_error = min(max(current_kl / target - 1, -0.2), 0.2)
    return value * (1 + proportional_error * n_steps / horizon)


# --------------------------------------------------------------------------- aggregation
def agg_loss(loss_mat, loss_mask, mode, loss_scale_factor=None):
    """``agg_loss`` in one process (``dp_size`` 1, the batch counts its own tokens and sequences)."""
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if mode == "token-sum":
        return (loss_mat * loss_mask).sum()
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = (loss_mat * loss_mask).sum(dim=-1)
        seq_mask = (loss_mask.sum(dim=-1) > 0).float()
        loss = (seq_losses * seq_mask).sum() / seq_mask.sum()
        if mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    if mode == "seq-mean-token-mean":
        counts = loss_mask.sum(dim=-1)
        seq_losses = (loss_mat * loss_mask).sum(dim=-1) / (counts + 1e-8)
        seq_mask = (counts > 0).float()
        return (seq_losses * seq_mask).sum() / seq_mask.sum()
    raise ValueError(mode)


# --------------------------------------------------------------------------- policy losses (per-token, before agg)
def vanilla(old_log_prob, log_prob, advantages, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0):
    """``compute_policy_loss_vanilla``'s per-token ``pg_losses``: the log-ratio clamped to +-20, the
    clip, the dual clip at ``clip_ratio_c`` for A < 0 (always on)."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip1 = torch.maximum(pg1, pg2)
    clip2 = torch.min(-advantages * clip_ratio_c, clip1)
    return torch.where(advantages < 0, clip2, clip1)


def gspo(old_log_prob, log_prob, advantages, mask, clip_ratio_low, clip_ratio_high):
    """``compute_policy_loss_gspo``: the token form sg(log s) + logp - sg(logp), clamped at 10 from above."""
    lengths = mask.sum(dim=-1).clamp(min=1)
    log_s = ((log_prob - old_log_prob) * mask).sum(dim=-1) / lengths
    log_ratio = torch.clamp(log_prob - log_prob.detach() + log_s.detach()[:, None], max=10.0)
    ratio = torch.exp(log_ratio)
    return torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))


def sapo(old_log_prob, log_prob, advantages, tau_pos=1.0, tau_neg=1.05):
    """``compute_policy_loss_sapo``: gate sigmoid(tau (r - 1)) * 4 / tau, tau_pos where A > 0."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    taus = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=advantages.dtype),
                       torch.as_tensor(tau_neg, dtype=advantages.dtype))
    return -(torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)) * advantages


def cispo(old_log_prob, log_prob, advantages, clip_ratio_low, clip_ratio_high):
    """``compute_policy_loss_cispo``: -sg(clamp(r, 1 - low, 1 + high)) A logp."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    return -torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high).detach() * advantages * log_prob


def geo_mean_loss(old_log_prob, log_prob, advantages, mask, clip_ratio_low, clip_ratio_high):
    """``compute_policy_loss_geo_mean``: the scalar loss (it aggregates itself: a mean over rows)."""
    l = log_prob - old_log_prob  # noqa: E741 (verl's negative_approx_kl)
    sign = torch.sign(advantages)
    clamped = torch.clamp(l, -clip_ratio_low, clip_ratio_high)
    l_min = sign * torch.min(sign * l, sign * clamped)
    lengths = mask.sum(dim=-1)
    ratio = torch.exp((l_min * mask).sum(dim=-1) / (lengths + 1e-8))
    advantage = (advantages * mask).sum(dim=-1) / (lengths + 1e-8)
    return torch.mean(-advantage * ratio)


def gpg_loss(log_prob, advantages):
    """``compute_policy_loss_gpg``: -logp * A."""
    return -log_prob * advantages


def reinforce_loss(log_prob, advantages):
    """``compute_policy_loss_reinforce`` without IS weights: -A * logp."""
    return -advantages * log_prob


def clip_cov(old_log_prob, log_prob, advantages, mask, clip_ratio_low, clip_ratio_high, clip_cov_ratio, lb, ub):
    """``compute_policy_loss_clip_cov``; the random draw is a permutation of the candidates, so the
    tests give it no choice (``clip_cov_ratio`` large enough to take every candidate)."""
    ratio = torch.exp(log_prob - old_log_prob)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_by_origin = (pg2 > pg1) & (mask > 0)
    cov = (advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob.detach(), mask))
    cov = cov.detach().clone()
    cov[mask == 0] = -torch.inf
    cov[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * mask.sum().item()), 1)
    candidates = torch.nonzero((cov < ub) & (cov > lb) & (mask > 0))
    assert len(candidates) <= clip_num, "the test must leave the random draw no choice"
    corr = torch.ones_like(advantages)
    corr[candidates[:, 0], candidates[:, 1]] = 0
    return torch.maximum(pg1, pg2) * corr


def kl_cov(old_log_prob, log_prob, advantages, mask, kl_cov_ratio, ppo_kl_coef):
    """``compute_policy_loss_kl_cov``: -A r, plus coef * |log r| on the top covariance tokens."""
    l = log_prob - old_log_prob  # noqa: E741
    ratio = torch.exp(l)
    losses = -advantages * ratio
    with_kl = -advantages * ratio + ppo_kl_coef * l.abs()
    valid = mask > 0
    valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    adv, lp = advantages[valid].detach().reshape(-1), log_prob[valid].detach().reshape(-1)
    cov = (adv - adv.mean()) * (lp - lp.mean())
    k = max(1, int(len(cov) * kl_cov_ratio))
    top = valid_idx[torch.topk(cov, k, largest=True).indices]
    width = advantages.shape[1]
    losses = losses.clone()
    losses[top // width, top % width] = with_kl[top // width, top % width]
    return losses


def dppo(old_log_prob, log_prob, advantages, divergence, clip_ratio_low, clip_ratio_high, clip_ratio_c):
    """``compute_policy_loss_dppo_tv`` / ``_kl``: -A sg(min(r, c)) logp on the valid tokens."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    if divergence == "tv":
        positive, negative = (prob - old_prob) <= clip_ratio_high, (prob - old_prob) >= -clip_ratio_low
    else:
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        positive = (binary_kl <= clip_ratio_high) | (prob <= old_prob)
        negative = (binary_kl <= clip_ratio_low) | (prob >= old_prob)
    valid = torch.where(advantages > 0, positive, negative).detach().float()
    return -advantages * truncated * log_prob * valid


# --------------------------------------------------------------------------- rollout correction
def _parse_is_threshold(spec):
    if isinstance(spec, str) and "_" in spec:
        lower, upper = spec.split("_", 1)
        return float(upper), float(lower)
    return float(spec), None


def rollout_is_weights(log_ratio, mask, rollout_is, threshold, batch_normalize=False):
    """``compute_rollout_correction_weights``: TIS (clamp at the upper bound) or, with a
    "lower_upper" threshold, IcePop (zero outside); optionally divided by their mean over the
    response tokens (per sequence at the sequence level)."""
    upper, lower = _parse_is_threshold(threshold)
    if rollout_is == "token":
        raw = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        total = (log_ratio * mask).sum(dim=-1, keepdim=True)
        raw = torch.exp(torch.clamp(total, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    if batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(weights, mask)
        else:
            seq = masked_mean(weights, mask, axis=-1)
            seq_mask = (mask.sum(dim=-1) > 0).to(weights.dtype)
            mean = (seq * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
    return weights


def rollout_rejection_mask(log_ratio, mask, option, threshold):
    """``compute_rollout_rejection_mask`` for the k1 options: the statistic is -log_ratio (per token,
    or summed / averaged over the sequence), kept when in [log lower, log upper]; a single number u
    means [1/u, u]."""
    if "_" in str(threshold):
        lower, upper = (float(x) for x in str(threshold).split("_", 1))
    else:
        upper = float(threshold)
        lower = 1.0 / upper
    k1 = -torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    if option == "token_k1":
        stat = k1
        keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
    else:
        summed = (k1 * mask).sum(dim=-1)
        stat = summed if option == "seq_sum_k1" else summed / (mask.sum(dim=-1) + 1e-8)
        keep = ((stat >= math.log(lower)) & (stat <= math.log(upper)))[:, None].expand_as(mask)
    return mask * keep.to(mask.dtype)


# --------------------------------------------------------------------------- distillation
def distillation_policy_gradient_loss(old_log_prob, log_prob, teacher_log_prob, task_advantages, mask,
                                      loss_agg_mode, distillation_loss_coef=1.0, loss_max_clamp=10.0):
    """``distillation_ppo_loss`` with ``use_policy_gradient`` and ``loss_mode="k1"``, ``use_task_rewards``
    on: the vanilla PPO loss of the task advantages plus coef times the vanilla loss of the
    advantages -clamp(k1(logp, teacher)) (computed from the current log-probs, detached)."""
    task = agg_loss(vanilla(old_log_prob, log_prob, task_advantages), mask, loss_agg_mode)
    k1 = kl_penalty(log_prob, teacher_log_prob, "k1")
    if loss_max_clamp is not None:
        k1 = k1.clamp(min=-loss_max_clamp, max=loss_max_clamp)
    distill = agg_loss(vanilla(old_log_prob, log_prob, -k1.detach()), mask, loss_agg_mode)
    return task + distill * distillation_loss_coef
