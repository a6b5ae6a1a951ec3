"""The reference implementations of three algorithms outside verl, OpenRLHF and TRL, re-implemented
for the peer-equivalence tests (none of them is installed):

- ROLL's TOPR: ``roll/pipeline/agentic/agentic_actor_pg_worker.py`` ``_compute_topr_loss``
  (alibaba/ROLL at commit 8eb27cc2dc34c4d1310b169d9b86d339004d811a);
- AReaL's M2PO mask: ``areal/trainer/ppo/actor.py`` ``_apply_m2po_masking`` / ``_get_m2po_loss_mask``,
  and its decoupled PPO loss with token-level rejection sampling: ``areal/utils/functional/functional.py``
  ``apply_rejection_sampling`` / ``ppo_actor_loss_fn`` (inclusionAI/AReaL at commit
  4aef98d8d818af55b43621aaadba047ae10f4e77);
- the tinker-cookbook's on-policy distillation advantage: ``tinker_cookbook/distillation/train_on_policy.py``
  ``incorporate_kl_penalty`` and ``tinker_cookbook/rl/metrics.py`` ``discounted_future_sum_vectorized``
  (thinking-machines-lab/tinker-cookbook at commit 9dfcc3a2cf44432d621a01005073dc6d76a1e87a).
"""

from __future__ import annotations

import torch


def roll_topr_loss(ratio, log_probs, advantages, scores, positive_weight=1.0, negative_weight=1.0):
    """Per-token TOPR loss: rows with score > 0 get -A logp, the others -sg(clamp(ratio, 0, 1)) A logp."""
    positive = (scores > 0).float()[:, None].expand_as(log_probs)
    negative = (scores <= 0).float()[:, None].expand_as(log_probs)
    positive_loss = -advantages * log_probs * positive
    negative_loss = -torch.clamp(ratio, min=0.0, max=1.0).detach() * advantages * log_probs * negative
    return positive_weight * positive_loss + negative_weight * negative_loss


def areal_m2po_mask(old_logp, prox_logp, loss_mask, m2_threshold):
    """The kept tokens: sort (old - prox)^2 over the loss mask from the largest, drop the first k with
    k the first index where the mean of the rest is below the threshold (else all but one)."""
    delta = old_logp - prox_logp
    m2 = delta * delta
    flat = loss_mask.view(-1)
    selected = m2.view(-1)[flat]
    if selected.numel() == 0:
        return loss_mask
    sorted_m2, indices = torch.sort(selected, descending=True)
    restored = torch.argsort(indices)
    n = sorted_m2.numel()
    suffix_mean = sorted_m2.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=sorted_m2.dtype)
    below = torch.where(suffix_mean < m2_threshold)[0]
    num_to_mask = below[0].item() if len(below) > 0 else n - 1
    keep_sorted = torch.ones_like(sorted_m2, dtype=torch.bool)
    keep_sorted[:num_to_mask] = False
    full = torch.zeros_like(flat, dtype=torch.bool)
    full[flat] = keep_sorted[restored]
    return full.view_as(loss_mask)


def areal_decoupled_ppo_loss(logprobs, proximal_logprobs, old_logprobs, advantages, loss_mask, eps_clip,
                             eps_clip_higher, upper, lower=None):
    """``ppo_actor_loss_fn`` (token level, no dual clip) with ``rejection_sampling: {level: token,
    action: mask, metric: ratio, upper, lower}``: the behaviour weight ``exp(prox - old)`` where it lies
    in ``[lower, upper]`` (``<= upper`` without a lower bound), the token taken out of the loss mask
    elsewhere; the clipped loss against the proximal policy times that weight, summed over the kept
    tokens and divided by the tokens of the original mask."""
    count = loss_mask.count_nonzero() or 1
    log_ratio = proximal_logprobs.detach() - old_logprobs.detach()
    weight = torch.exp(log_ratio)
    in_bounds = weight <= upper if lower is None else (weight >= lower) & (weight <= upper)
    loss_mask = loss_mask & in_bounds
    weight = torch.where(loss_mask, weight, 0.0)
    ratio = torch.where(loss_mask, torch.exp(logprobs - proximal_logprobs), 0)
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + (eps_clip if eps_clip_higher is None else eps_clip_higher))
    pg_loss = torch.max(-advantages * ratio, -advantages * clipped) * weight
    return torch.where(loss_mask, pg_loss, 0).sum() / count


def tinker_kl_advantages(sampled_logprobs, teacher_logprobs, mask, kl_penalty_coef=1.0, kl_discount_factor=0.0):
    """Per row: -coef * mask * (sampled - teacher), then the discounted future sum when the factor is > 0."""
    out = []
    for i in range(sampled_logprobs.shape[0]):
        m = mask[i].float()
        kl_advantages = -kl_penalty_coef * m * ((sampled_logprobs[i] - teacher_logprobs[i]) * m)
        if kl_discount_factor > 0:
            result, running = torch.empty_like(kl_advantages), torch.zeros(1, dtype=kl_advantages.dtype)
            for t in range(len(kl_advantages) - 1, -1, -1):
                running = kl_advantages[t] + kl_discount_factor * running
                result[t] = running
            kl_advantages = result
        out.append(kl_advantages)
    return torch.stack(out)
