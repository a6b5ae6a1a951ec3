"""Policy losses ``gpg`` and ``reinforce``: the plain policy gradient ``-A * logp``, with no
importance ratio and no clip (GPG, https://arxiv.org/abs/2504.02546; REINFORCE, Williams 1992):
the vanilla policy gradient ``-A_t grad logp_t`` whatever ``old_logp`` is.
"""

from __future__ import annotations

import torch
from grpo_plugins.losses.common import BoundPolicyLoss, ratio_metrics
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.contracts import PolicyLossOutput, masked_fill_zero
from grpo_core.options import Options

__all__ = ["GPGPolicyLoss", "PolicyGradientOptions", "REINFORCEPolicyLoss", "policy_gradient_loss"]


class PolicyGradientOptions(Options):
    """``gpg`` and ``reinforce`` take no options: ``loss_t = -A_t * logp_t``, no ratio and no clip
    (GPG, https://arxiv.org/abs/2504.02546; REINFORCE, Williams 1992)."""


class GPGPolicyLoss(BoundPolicyLoss):
    """GPG: the plain policy gradient -A * logp, no ratio, clip, critic or reference (https://arxiv.org/abs/2504.02546);
    the paper aggregates with token-mean."""


@GPGPolicyLoss.binds
def policy_gradient_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> PolicyLossOutput:
    """The plain policy-gradient loss ``loss_t = -A_t * logp_t`` (REINFORCE, Williams 1992,
    https://doi.org/10.1007/BF00992696; GPG, Chu et al., https://arxiv.org/abs/2504.02546).

    No importance ratio and no clip: the gradient is ``-A_t grad logp_t`` whatever ``old_logp``
    is (with ``mu > 1`` the later passes are biased, as the papers accept). ``old_logp`` only
    feeds the ``ratio`` metric. Shapes ``(B, T)``; returns ``loss (B, T)`` zero on padding and
    metrics ``ratio``, ``ratio/max`` (``exp(logp - old_logp)``, logged, not used).
    """
    advantages = masked_fill_zero(advantages, mask)
    safe_logp = masked_fill_zero(logp, mask)
    ratio = torch.exp((safe_logp.detach() - masked_fill_zero(old_logp, mask)).clamp(max=20.0))
    return PolicyLossOutput(masked_fill_zero(-advantages * safe_logp, mask), ratio_metrics(ratio, mask))


class REINFORCEPolicyLoss(GPGPolicyLoss):
    """REINFORCE: -A * logp, no ratio (Williams 1992); with seq-mean-token-sum it is -1/B sum_i A_i log pi(o_i)."""


@hookimpl
def register_policy_losses(register):
    register.add("gpg", GPGPolicyLoss, options=PolicyGradientOptions)
    register.add("reinforce", REINFORCEPolicyLoss, options=PolicyGradientOptions)
