"""Every built-in policy loss against the ``PolicyLoss`` contract: inf/NaN on padding never leak
into the loss, the gradient or the metrics; zero advantage is zero loss where a loss declares it;
each is registered by its module with its options model; invalid options say what is valid."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_plugins.losses.clip import ClipOptions, ClipPolicyLoss, GSPOOptions, GSPOPolicyLoss
from grpo_plugins.losses.cov import ClipCovOptions, ClipCovPolicyLoss, KLCovOptions, KLCovPolicyLoss
from grpo_plugins.losses.off_policy import (
    M2POOptions,
    M2POPolicyLoss,
    OPSMOptions,
    OPSMPolicyLoss,
    TOPROptions,
    TOPRPolicyLoss,
    VESPOOptions,
    VESPOPolicyLoss,
)
from grpo_plugins.losses.policy_gradient import GPGPolicyLoss, PolicyGradientOptions, REINFORCEPolicyLoss
from grpo_plugins.losses.trust_region import (
    CISPOOptions,
    CISPOPolicyLoss,
    DPPOOptions,
    DPPOPolicyLoss,
    GMPOOptions,
    GMPOPolicyLoss,
    SAPOOptions,
    SAPOPolicyLoss,
)
from pydantic import ValidationError

from grpo_core.contracts import PolicyLossInputs
from grpo_core.plugin_manager import load_plugins

from .conftest import F64, NAN

#: Each loss with its defaults (and clip with a dual clip): those that skip zero-advantage rows.
SKIPPING = {
    "clip": ClipPolicyLoss(ClipOptions()),
    "clip-dual": ClipPolicyLoss(ClipOptions(dual_clip=3.0)),
    "gspo": GSPOPolicyLoss(GSPOOptions()),
    "cispo": CISPOPolicyLoss(CISPOOptions()),
    "sapo": SAPOPolicyLoss(SAPOOptions()),
    "gmpo": GMPOPolicyLoss(GMPOOptions()),
    "gpg": GPGPolicyLoss(PolicyGradientOptions()),
    "reinforce": REINFORCEPolicyLoss(PolicyGradientOptions()),
    "dppo": DPPOPolicyLoss(DPPOOptions()),
    "dppo-kl": DPPOPolicyLoss(DPPOOptions(divergence="kl")),
    "opsm": OPSMPolicyLoss(OPSMOptions(delta=0.01)),
    "m2po": M2POPolicyLoss(M2POOptions(threshold=1e-4)),
    "topr": TOPRPolicyLoss(TOPROptions()),
    "topr-sequence": TOPRPolicyLoss(TOPROptions(level="sequence")),
    "vespo": VESPOPolicyLoss(VESPOOptions()),
}
#: The covariance losses, selecting every token so that padding is next to selected tokens.
COVARIANCE = {
    "clip-cov": ClipCovPolicyLoss(ClipCovOptions(clip_cov_ratio=1.0, clip_cov_lb=-10.0)),
    "kl-cov": KLCovPolicyLoss(KLCovOptions(kl_cov_ratio=1.0)),
}


@pytest.mark.parametrize("name", [*SKIPPING, *COVARIANCE])
def test_padding_inf_nan_never_leaks(name):
    loss = {**SKIPPING, **COVARIANCE}[name]
    logp = torch.tensor([[-0.5, -math.inf, NAN], [-1.0, math.inf, -math.inf]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-0.6, NAN, -math.inf], [-1.1, -math.inf, NAN]], dtype=F64)
    adv = torch.tensor([[1.0, NAN, math.inf], [-1.0, 2.0, NAN]], dtype=F64)
    mask = torch.tensor([[True, False, False], [True, False, False]])
    sampled = torch.tensor([[-0.9, math.inf, NAN], [-0.2, NAN, -math.inf]], dtype=F64)
    out = loss(PolicyLossInputs(logp, old, adv, mask, sampling_logp=sampled))
    assert torch.equal(out.loss[~mask], torch.zeros(4, dtype=F64)) and torch.isfinite(out.loss).all()
    (grad,) = torch.autograd.grad(out.loss.sum(), logp)
    assert torch.isfinite(grad).all() and torch.equal(grad[~mask], torch.zeros(4, dtype=F64))
    for metric, value in out.metrics.items():
        assert value.shape == mask.shape and not value.requires_grad, metric
        assert torch.equal(value[~mask], torch.zeros(4, dtype=F64)), metric
    if name in COVARIANCE:
        assert out.metrics["cov/selected"].sum() >= 1


@pytest.mark.parametrize("loss", [*SKIPPING.values(), ClipPolicyLoss(ClipOptions(dual_clip=2.0))],
                         ids=[*SKIPPING, "clip-dual-2"])
def test_zero_advantage_is_zero_loss(loss):
    assert type(loss).zero_advantage_is_zero_loss is True
    logp = torch.tensor([[-0.1, -4.0, -2.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-3.0, -0.5, -2.0]], dtype=F64)  # ratios far from 1
    out = loss(PolicyLossInputs(logp, old, torch.zeros(1, 3, dtype=F64), torch.ones(1, 3, dtype=torch.bool)))
    assert torch.equal(out.loss, torch.zeros(1, 3, dtype=F64))
    (grad,) = torch.autograd.grad(out.loss.sum(), logp)
    assert torch.equal(grad, torch.zeros(1, 3, dtype=F64))


CLIP_METRICS = {"ratio", "ratio/max", "clip/low", "clip/high", "clip/region"}


@pytest.mark.parametrize(("name", "impl", "options", "module", "metrics"), [
    ("clip", ClipPolicyLoss, ClipOptions, "clip", CLIP_METRICS),
    ("gspo", GSPOPolicyLoss, GSPOOptions, "clip", CLIP_METRICS),
    ("cispo", CISPOPolicyLoss, CISPOOptions, "trust_region", {"ratio", "ratio/max"}),
    ("sapo", SAPOPolicyLoss, SAPOOptions, "trust_region", {"ratio", "ratio/max"}),
    ("gmpo", GMPOPolicyLoss, GMPOOptions, "trust_region", {"ratio", "ratio/max"}),
    ("gpg", GPGPolicyLoss, PolicyGradientOptions, "policy_gradient", {"ratio", "ratio/max"}),
    ("reinforce", REINFORCEPolicyLoss, PolicyGradientOptions, "policy_gradient", {"ratio", "ratio/max"}),
    ("dppo", DPPOPolicyLoss, DPPOOptions, "trust_region", CLIP_METRICS),
    ("opsm", OPSMPolicyLoss, OPSMOptions, "off_policy", CLIP_METRICS | {"opsm/masked", "opsm/kl"}),
    ("m2po", M2POPolicyLoss, M2POOptions, "off_policy", {"ratio", "ratio/max", "m2po/masked", "m2po/m2"}),
    ("topr", TOPRPolicyLoss, TOPROptions, "off_policy", {"ratio", "ratio/max", "topr/negative", "clip/high"}),
    ("vespo", VESPOPolicyLoss, VESPOOptions, "off_policy", {"ratio", "ratio/max", "vespo/weight"}),
])
def test_registered_and_buildable(name, impl, options, module, metrics):
    component = load_plugins(external=False).registry.get("policy_loss", name)
    assert component.impl is impl and component.options is options
    assert component.plugin == f"grpo_plugins.losses.{module}"
    logp = torch.tensor([[-0.5, -1.0]], dtype=F64)
    batch = PolicyLossInputs(logp, logp - 0.01, torch.ones(1, 2, dtype=F64), torch.ones(1, 2, dtype=torch.bool))
    out = component.build(options())(batch)
    assert out.loss.shape == (1, 2) and (out.loss != 0).all() and metrics <= set(out.metrics)


def test_the_registry_lists_the_losses_in_their_order():
    assert load_plugins(external=False).registry.names("policy_loss") == [
        "clip", "gspo", "cispo", "sapo", "gmpo", "dppo", "gpg", "reinforce", "clip-cov", "kl-cov", "opsm", "m2po",
        "topr", "vespo"]


@pytest.mark.parametrize("model, kwargs, message", [
    (ClipOptions, {"eps": 0.2}, "Extra inputs are not permitted"),
    (GSPOOptions, {"dual_clip": 3.0}, "Extra inputs are not permitted"),
    (ClipOptions, {"eps_low": 0.0}, "eps_low must be in \\(0, 1\\)"),
    (ClipOptions, {"eps_low": 1.0}, "eps_low must be in \\(0, 1\\)"),
    (GSPOOptions, {"eps_high": -1e-4}, "eps_high must be a positive finite number.*or null"),
    (ClipOptions, {"dual_clip": 1.0}, "dual_clip must be a finite number > 1.*or null"),
    (ClipOptions, {"log_ratio_clamp": 0.0}, "log_ratio_clamp must be a positive finite number"),
    (CISPOOptions, {"eps": 0.2}, "Extra inputs are not permitted"),
    (CISPOOptions, {"eps_low": 1.0}, "eps_low must be in \\(0, 1\\).*or null"),
    (CISPOOptions, {"eps_high": 0.0}, "eps_high must be a positive finite number"),
    (SAPOOptions, {"tau_pos": 0.0}, "tau_pos must be a positive finite number \\(a temperature\\)"),
    (SAPOOptions, {"tau_neg": math.inf}, "tau_neg must be a positive finite number"),
    (SAPOOptions, {"log_ratio_clamp": -1.0}, "log_ratio_clamp must be a positive finite number.*or null"),
    (GMPOOptions, {"eps_low": -0.4}, "eps_low must be a positive finite number \\(a bound in log space\\)"),
    (PolicyGradientOptions, {"eps_low": 0.2}, "Extra inputs are not permitted"),
    (ClipCovOptions, {"clip_cov_ratio": 0.0}, "clip_cov_ratio must be in \\(0, 1\\]"),
    (ClipCovOptions, {"clip_cov_lb": 5.0, "clip_cov_ub": 1.0}, "clip_cov_lb must be below clip_cov_ub"),
    (ClipCovOptions, {"eps_low": 1.5}, "eps_low must be in \\(0, 1\\)"),
    (KLCovOptions, {"kl_cov_ratio": 2.0}, "kl_cov_ratio must be in \\(0, 1\\]"),
    (KLCovOptions, {"kl_coef": 0.0}, "kl_coef must be a positive finite number"),
    (KLCovOptions, {"eps_low": 0.2}, "Extra inputs are not permitted"),
    (DPPOOptions, {"divergence": "js"}, "Input should be 'tv' or 'kl'"),
    (DPPOOptions, {"delta_low": 0.0}, "delta_low must be a positive finite number \\(a divergence bound\\)"),
    (DPPOOptions, {"truncation": math.nan}, "truncation must be a positive finite number"),
    (OPSMOptions, {"delta": 0.0}, "delta must be a positive finite number"),
    (OPSMOptions, {"eps_low": 1.0}, "eps_low must be in \\(0, 1\\)"),
    (M2POOptions, {"threshold": -0.04}, "threshold must be a positive finite number \\(the second-moment bound\\)"),
    (TOPROptions, {"level": "batch"}, "Input should be 'token' or 'sequence'"),
    (TOPROptions, {"negative_weight": -1.0}, "greater than or equal to 0"),
    (VESPOOptions, {"k_pos": 0.0}, "k_pos must be a positive finite number \\(an exponent\\)"),
])
def test_options_invalid_values_say_what_is_valid(model, kwargs, message):
    with pytest.raises(ValidationError, match=message):
        model(**kwargs)


def test_option_descriptions_cite_their_papers():
    for model, paper in [(CISPOOptions, "2506.13585"), (SAPOOptions, "2511.20347"), (GMPOOptions, "2507.20673"),
                         (OPSMOptions, "2512.02556"), (M2POOptions, "2510.01161"), (TOPROptions, "2503.14286"),
                         (VESPOOptions, "2602.10693"), (DPPOOptions, "2602.04879")]:
        texts = [model.__doc__ or ""] + [f.description or "" for f in model.model_fields.values()]
        assert any(paper in text for text in texts), model
        assert all(f.description for f in model.model_fields.values()), model
    assert "2504.02546" in PolicyGradientOptions.__doc__
