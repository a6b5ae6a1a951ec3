"""TRL 1.16's GRPO formulas, re-implemented for the peer-equivalence tests (TRL is a benchmark
dependency of grpo-core, not a test one: the suite runs without it).

Read in TRL 1.16.0 (``pip install trl==1.16``): ``trl/trainer/grpo_trainer.py``
(``_generate_and_score_completions``: the advantages and the vLLM importance-sampling ratio;
``_compute_loss``: the per-token losses, the KL, the aggregation by ``loss_type``;
``get_off_policy_mask``; ``get_gamma_weights``), ``trl/trainer/utils.py`` (``nanstd``) and
``trl/trainer/callbacks.py`` (``SyncRefModelCallback._sync_target_model``). One
process, one gradient-accumulation step (``num_items_in_batch`` = the batch's tokens).
"""

from __future__ import annotations

import math

import torch


def nanstd(tensor, dim=None, keepdim=False):
    """``nanstd``: the Bessel-corrected std of the non-NaN values (NaN with fewer than two)."""
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count / 1.0, float("nan")))
    std = torch.sqrt(variance * correction)
    if keepdim:
        return std
    return std.squeeze() if dim is None else std.squeeze(dim)


# --------------------------------------------------------------------------- advantages
def advantages(rewards_per_func, weights, num_generations, aggregation="sum_then_normalize", scale_rewards="group"):
    """The advantages of ``_generate_and_score_completions``; ``rewards_per_func (B, F)``, NaN where a
    function returned None; 0 for a row every function left unscored."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights[None]).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
        if scale_rewards in ("group", "none"):
            std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
        else:
            std = nanstd(rewards).expand_as(rewards)
        adv = rewards - mean
        if scale_rewards != "none":
            adv = adv / (std + 1e-4)
    else:  # normalize_then_sum
        grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True)
        reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
        rewards = (reward_k * weights[None]).nansum(dim=1)
        rewards[unscorable] = torch.nan
        adv = (rewards - torch.nanmean(rewards)) / (nanstd(rewards).expand_as(rewards) + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


# --------------------------------------------------------------------------- masks and weights
def off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, threshold):
    """``get_off_policy_mask``: keep where A >= 0 or the mean (sampling - current) <= threshold."""
    kl = torch.nan_to_num(sampling_per_token_logps - per_token_logps.detach(), nan=0.0)
    avg = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (avg <= threshold)).to(mask.dtype)


def gamma_weights(advantages, log_ratio_per_token, mask, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0):
    """``get_gamma_weights`` without a vLLM ratio: phi(w) of the sequence ratio, in log space."""
    lower = math.log(1e-8)
    seq = torch.sum(torch.clamp(log_ratio_per_token, -20.0, 20.0) * mask, dim=-1, keepdim=True)
    log_w = torch.clamp(seq, lower, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return phi.detach()


def vllm_is_ratio(old_per_token_logps, sampling_per_token_logps, mask, mode, clip_min=None, clip_max=3.0):
    """The importance-sampling ratio of ``vllm_importance_sampling_mode``: per token or the
    sequence's product, then truncated to [clip_min, clip_max] or zeroed outside it."""
    diff = torch.nan_to_num((old_per_token_logps - sampling_per_token_logps) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


# --------------------------------------------------------------------------- the loss
def compute_loss(per_token_logps, old_per_token_logps, advantages, mask, *, loss_type="grpo",
                 importance_sampling_level="token", epsilon_low=0.2, epsilon_high=0.2, beta=0.0,
                 ref_per_token_logps=None, use_bias_correction_kl=True, sapo_temperature_pos=1.0,
                 sapo_temperature_neg=1.05, off_policy_mask_threshold=None, sampling_per_token_logps=None,
                 importance_sampling_ratio=None, max_completion_length=None, vespo=None):
    """``_compute_loss`` (one process, no entropy mask, no entropy bonus); ``advantages (B, 1)`` or
    ``(B, T)``; ``importance_sampling_ratio`` the vLLM ratio, applied after the policy loss (not for vespo)."""
    if off_policy_mask_threshold is not None:
        sampled = sampling_per_token_logps if sampling_per_token_logps is not None else old_per_token_logps
        opsm = off_policy_mask(advantages, per_token_logps, sampled, mask, off_policy_mask_threshold)
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_weights = log_ratio
    else:
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_weights)
    if beta != 0.0:
        d = ref_per_token_logps - per_token_logps
        per_token_kl = torch.exp(d) - d - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    if loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=epsilon_high).detach() * advantages * per_token_logps
    elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif loss_type == "sapo":
        temperatures = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token_loss = -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * advantages
    elif loss_type == "vespo":
        phi = gamma_weights(advantages, log_ratio, mask, **(vespo or {}))
        per_token_loss = -phi * advantages * per_token_logps
    else:
        raise ValueError(loss_type)
    if off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * opsm
    if importance_sampling_ratio is not None and loss_type != "vespo":
        per_token_loss = per_token_loss * importance_sampling_ratio
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type in ("grpo", "sapo"):
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    if loss_type in ("cispo", "dapo", "vespo"):
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    return (per_token_loss * mask).sum(-1).mean()  # luspo


def sync_target_model(model, target_model, alpha):
    """``SyncRefModelCallback._sync_target_model`` (``sync_ref_model``, ``ref_model_mixup_alpha``): each
    reference parameter becomes ``(1 - alpha) * ref + alpha * policy``, in place."""
    with torch.no_grad():
        for target_param, copy_param in zip(target_model.parameters(), model.parameters(), strict=True):
            target_param.mul_(1.0 - alpha).add_(copy_param, alpha=alpha)
