"""Tinker's loss functions on grpo-core's: each maps the per-token log-probs of a datum's
``target_tokens`` (``logp``, with grad) and its loss inputs to a per-token loss, *summed* over
the batch's tokens as Tinker's are (no mean: the caller scales by its own weights or
advantages).

- ``cross_entropy``: ``-w * logp`` (loss input ``weights``), the SFT stage's token NLL;
- ``importance_sampling``: ``-exp(logp - q) * A`` (``logprobs`` q, ``advantages`` A): the
  ratio of ``clip`` without its clip, written here;
- ``ppo``: ``-min(r A, clip(r, lo, hi) A)`` with ``r = exp(logp - q)``: grpo-core's ``clip``
  loss with ``eps_low = 1 - lo`` and ``eps_high = hi - 1``;
- ``cispo``: ``-sg(clip(r, lo, hi)) A logp``: grpo-core's ``cispo`` with the same mapping;
- ``dro``: ``-(A logp - beta/2 (logp - q)^2)``, Tinker's formula, written here;
- ``gspo``: GSPO-token (Zheng et al., https://arxiv.org/abs/2507.18071) as Tinker documents it:
  the sequence ratio ``s = exp(mean over M of (logp - q))``, ``M`` the positions the datum's
  ``sequence_ratio_mask`` marks, carried by every token as ``s_t = sg(s) exp(logp - sg(logp))``,
  then ``-min(s_t A, clip(s_t, lo, hi) A)`` on every position: grpo-core's ``gspo`` loss when
  ``M`` is the completion and the prompt's advantages are zero (as the cookbook writes them).

``lo``/``hi`` are ``loss_fn_config``'s ``clip_low_threshold``/``clip_high_threshold`` (Tinker's
defaults 0.8 and 1.2 for ``ppo`` and ``cispo``; Tinker's GSPO page does not state its own, so
``gspo`` takes the same two keys with the same defaults, and the guide says so); ``dro`` takes
``beta``. Every other name (``stable_reinforce``, whose objective Tinker has not published, an
unknown one) is refused by name (:class:`LossRefused`); so is a config key a loss does not
take. grpo-core's ``clip`` and ``cispo`` run with ``log_ratio_clamp`` off, so the numbers are
Tinker's formulas exactly.

:func:`grpo_core_sections` says the same the other way: the ``algorithm`` and ``train`` keys of
a grpo-core spec whose own update (its learner, its loss plugins, its AdamW) takes the step a
Tinker ``forward_backward`` + ``optim_step`` takes on the same batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from grpo_plugins.losses.clip import clipped_surrogate, ppo_clip_loss, sequence_log_ratio
from grpo_plugins.losses.trust_region import cispo_loss
from grpo_plugins.tinker.wire import Refused
from torch import Tensor

__all__ = ["LOSSES", "LossRefused", "grpo_core_sections", "loss_terms"]

#: Each served loss: the loss inputs it reads beside ``target_tokens``, its config keys with
#: their defaults.
LOSSES: dict[str, tuple[tuple[str, ...], dict[str, float]]] = {
    "cross_entropy": (("weights",), {}),
    "importance_sampling": (("logprobs", "advantages"), {}),
    "ppo": (("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": (("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "dro": (("logprobs", "advantages"), {"beta": 0.05}),
    "gspo": (("logprobs", "advantages", "sequence_ratio_mask"),
             {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
}


class LossRefused(Refused):
    """A loss (or loss config) this server does not serve; the message names it."""


def _eps(config: dict[str, float]) -> tuple[float, float]:
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    if not 0.0 < low <= 1.0 <= high:
        raise LossRefused(f"clip thresholds must satisfy 0 < clip_low_threshold <= 1 <= clip_high_threshold; "
                          f"got {low} and {high}")
    return 1.0 - low, high - 1.0


def _ppo(logp: Tensor, x: dict[str, Tensor], mask: Tensor, config: dict[str, float]) -> Tensor:
    eps_low, eps_high = _eps(config)
    return ppo_clip_loss(logp, x["logprobs"], x["advantages"], mask, eps_low=max(eps_low, 1e-12),
                         eps_high=max(eps_high, 1e-12), log_ratio_clamp=None).loss


def _cispo(logp: Tensor, x: dict[str, Tensor], mask: Tensor, config: dict[str, float]) -> Tensor:
    eps_low, eps_high = _eps(config)
    return cispo_loss(logp, x["logprobs"], x["advantages"], mask, eps_low=eps_low or None,
                      eps_high=max(eps_high, 1e-12), log_ratio_clamp=None).loss


def _importance_sampling(logp: Tensor, x: dict[str, Tensor], mask: Tensor, config: dict[str, float]) -> Tensor:
    return torch.where(mask, -torch.exp(logp - x["logprobs"]) * x["advantages"], torch.zeros_like(logp))


def _dro(logp: Tensor, x: dict[str, Tensor], mask: Tensor, config: dict[str, float]) -> Tensor:
    loss = -(x["advantages"] * logp - 0.5 * config["beta"] * (logp - x["logprobs"]) ** 2)
    return torch.where(mask, loss, torch.zeros_like(logp))


def _gspo(logp: Tensor, x: dict[str, Tensor], mask: Tensor, config: dict[str, float]) -> Tensor:
    _eps(config)  # the thresholds' check
    q, adv = x["logprobs"], x["advantages"]
    in_ratio = mask & (x["sequence_ratio_mask"] != 0)
    empty = mask.any(dim=1) & ~in_ratio.any(dim=1)
    if bool(empty.any()):
        rows = empty.nonzero().flatten().tolist()
        raise LossRefused(f"gspo: the sequence_ratio_mask of datum(s) {rows} marks none of their tokens; "
                          "the sequence ratio is a mean over the marked tokens (mark the sampled ones)")
    log_s = sequence_log_ratio(logp.detach(), q, in_ratio)
    safe = torch.where(mask, logp, torch.zeros_like(logp))
    ratio = torch.exp(log_s[:, None] + safe - safe.detach())
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    loss = clipped_surrogate(ratio, clipped, torch.where(mask, adv, torch.zeros_like(adv)))
    return torch.where(mask, loss, torch.zeros_like(loss))


def _cross_entropy(logp: Tensor, x: dict[str, Tensor], mask: Tensor, config: dict[str, float]) -> Tensor:
    return torch.where(mask, -logp * x["weights"], torch.zeros_like(logp))


#: Each served loss's per-token terms from ``(logp, the padded loss inputs, mask, config)``.
_TERMS: dict[str, Callable[..., Tensor]] = {
    "cross_entropy": _cross_entropy, "importance_sampling": _importance_sampling, "ppo": _ppo,
    "cispo": _cispo, "dro": _dro, "gspo": _gspo,
}


def check(loss_fn: str, config: dict[str, float | str]) -> dict[str, float]:
    """The loss's config with its defaults filled in; :class:`LossRefused` naming an unserved
    loss or a key the loss does not take."""
    if loss_fn not in LOSSES:
        raise LossRefused(f"loss_fn {loss_fn!r} is not served by tinker-serve; served: {', '.join(LOSSES)} "
                          "(and custom losses, which the SDK runs through cross_entropy)")
    _, defaults = LOSSES[loss_fn]
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise LossRefused(f"loss_fn_config key(s) {unknown} are not taken by {loss_fn!r}; "
                          f"it takes {sorted(defaults) or 'none'}")
    return {**defaults, **{k: float(v) for k, v in config.items()}}


def loss_terms(loss_fn: str, config: dict[str, float], logp: Tensor, inputs: dict[str, Tensor],
               mask: Tensor) -> Tensor:
    """The per-token loss ``(B, T)`` of ``loss_fn``, zero where ``mask`` is False; ``inputs``
    are the datums' loss inputs padded to ``(B, T)``."""
    reads, _ = LOSSES[loss_fn]
    missing = [name for name in reads if name not in inputs]
    if missing:
        raise LossRefused(f"loss_fn {loss_fn!r} needs loss_fn_inputs {list(reads)} beside target_tokens; "
                          f"missing {missing}")
    return _TERMS[loss_fn](logp, inputs, mask, config)


#: The cap of grpo-core's rollout correction that never truncates (Tinker's importance
#: sampling weighs every token by its whole ratio); any ratio above it is past float32 anyway.
NO_CAP = 1e30


def _policy_loss(loss_fn: str, config: dict[str, float]) -> tuple[dict, dict, str]:
    """``(policy_loss, rollout_correction, logprobs role)`` of a served policy loss."""
    if loss_fn == "importance_sampling":  # ratio 1 at mu = 1: the plain policy gradient, weighed by exp(logp - q)
        return {"name": "clip", "log_ratio_clamp": None}, {"level": "token", "mode": "truncate", "cap": NO_CAP}, \
            "sampler"
    eps_low, eps_high = _eps(config)
    if loss_fn in ("ppo", "gspo"):
        if eps_low <= 0.0:
            raise LossRefused(f"{loss_fn} with clip_low_threshold 1 has no grpo-core counterpart (its eps_low must "
                              "be in (0, 1))")
        loss = {"name": "clip" if loss_fn == "ppo" else "gspo", "eps_low": eps_low, "eps_high": eps_high,
                "log_ratio_clamp": None}
    else:  # cispo
        loss = {"name": "cispo", "eps_low": eps_low or None, "eps_high": eps_high, "log_ratio_clamp": None}
    if eps_high <= 0.0:
        raise LossRefused(f"{loss_fn} with clip_high_threshold 1 has no grpo-core counterpart (eps_high must be > 0)")
    return loss, {"level": "off"}, "old"


def grpo_core_sections(loss_fn: str, config: dict[str, float | str] | None, adam: dict[str, float]
                       ) -> tuple[dict, str]:
    """The ``algorithm`` and ``train`` sections of a grpo-core spec whose update takes the step
    that ``forward_backward(data, loss_fn, config)`` then ``optim_step(adam)`` take, and what
    the datums' ``logprobs`` are in grpo-core's batch: ``"old"`` (the old policy's log-probs,
    the ratio's denominator: ``ppo``, ``cispo``, ``gspo``) or ``"sampler"`` (the sampler's, which the
    rollout correction weighs the loss by: ``importance_sampling``).

    The same batch: each datum's tokens are a prompt then a completion whose positions carry
    its advantages (zero on the prompt's, as the cookbook writes them). The mapping:

    - Tinker sums the per-token loss: aggregation ``token-sum``; one optimizer step per batch
      (``mu`` 1, one mini-batch), no KL term, no entropy bonus;
    - ``importance_sampling`` (``-exp(logp - q) A``): ``clip`` at ``mu`` 1 (its ratio is 1, its
      gradient the plain policy gradient) weighed by the rollout correction's token ratio
      ``exp(logp - q)``, never truncated (``cap`` :data:`NO_CAP`);
    - ``ppo``, ``cispo``, ``gspo``: grpo-core's ``clip``, ``cispo``, ``gspo`` with
      ``eps_low = 1 - lo``, ``eps_high = hi - 1``, no log-ratio clamp; the correction off
      (``gspo``: the datums' ``sequence_ratio_mask`` marking their completions);
    - ``AdamParams``: ``lr``, ``adam_betas``, ``adam_eps``, ``weight_decay`` as given (Tinker's
      defaults where unset), ``grad_clip_norm`` as ``max_grad_norm`` (0: none), a constant
      schedule without warm-up (the Tinker client sets each step's learning rate).

    ``cross_entropy`` is grpo-core's SFT stage, not an algorithm; ``dro`` has no grpo-core
    loss: both are refused here, by name."""
    if loss_fn not in ("importance_sampling", "ppo", "cispo", "gspo"):
        raise LossRefused(f"loss_fn {loss_fn!r} has no grpo-core algorithm to map to; mapped: importance_sampling, "
                          "ppo, cispo, gspo (cross_entropy is grpo-core's sft stage)")
    policy_loss, correction, role = _policy_loss(loss_fn, check(loss_fn, config or {}))
    adam = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
            "grad_clip_norm": 0.0, **adam}
    algorithm = {"policy_loss": policy_loss, "aggregation": {"name": "token-sum"}, "kl": {"beta": 0.0},
                 "rollout_correction": correction, "mu": 1, "entropy_coef": 0.0}
    train = {"lr": adam["learning_rate"], "adam_betas": [adam["beta1"], adam["beta2"]], "adam_eps": adam["eps"],
             "weight_decay": adam["weight_decay"], "max_grad_norm": adam["grad_clip_norm"] or None,
             "warmup_steps": 0, "schedule": "constant", "mini_batches": 1}
    return {"algorithm": algorithm, "train": train}, role
