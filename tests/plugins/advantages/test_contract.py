"""Every built-in advantage estimator against its registration: registered by its module, built
with its default options, flagged as it needs (step scores, a greedy baseline), nonzero on a
batch with signal; options that cite their papers, refuse unknown keys and say what is valid."""

from __future__ import annotations

import pytest
import torch
from grpo_plugins.advantages.grpo import GPGOptions, GRPOOptions, OPOOptions
from grpo_plugins.advantages.passk import PassKOptions
from grpo_plugins.advantages.process import ProcessOptions
from grpo_plugins.advantages.reinforce import ReinforceNoBaselineOptions, ReinforcePlusPlusOptions, ReMaxOptions
from pydantic import ValidationError

from grpo_core.contracts import AdvantageInputs
from grpo_core.plugin_manager import load_plugins

from .conftest import F64, inputs

#: The design's required estimators, by module.
ESTIMATORS = {"grpo": "grpo", "process": "process", "dapo-token-scale": "grpo", "rloo": "reinforce",
              "reinforce++": "reinforce"}
#: The others, by module, with options to build them with.
NEW = {"passk": ("passk", {"k": 1}), "opo": ("grpo", {}), "gpg": ("grpo", {}), "remax": ("reinforce", {}),
       "reinforce++-no-baseline": ("reinforce", {"gamma": 0.9})}


def test_estimators_registered_and_buildable():
    registry = load_plugins(external=False).registry
    steps = dict(
        step_scores=torch.tensor([[1.0], [0.0]], dtype=F64),
        step_ends=torch.tensor([[2], [1]]),
        step_mask=torch.ones(2, 1, dtype=torch.bool),
    )
    batch = inputs([1.0, 0.0], **steps)
    for name, module in ESTIMATORS.items():
        component = registry.get("advantage_estimator", name)
        assert component.plugin == f"grpo_plugins.advantages.{module}"
        built = component.build(component.options() if component.options else None)
        out = built(batch)
        assert out.shape == (2, 3) and out.abs().sum() > 0, name


def test_new_estimators_registered_built_and_flagged():
    registry = load_plugins(external=False).registry
    batch = AdvantageInputs(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]),
                            torch.ones(4, 3, dtype=torch.bool), baseline_scores=torch.tensor([0.5, 0.5, 0.0, 0.0]))
    for name, (module, options) in NEW.items():
        component = registry.get("advantage_estimator", name)
        assert component.plugin == f"grpo_plugins.advantages.{module}"
        assert "arxiv.org" in component.description, name
        built = component.build(component.options(**options))
        assert built.needs_greedy_baseline is (name == "remax")
        assert built.needs_step_scores is False
        out = built(batch)
        assert out.shape == (4, 3) and out.abs().sum() > 0, name


def test_the_registry_lists_the_estimators_by_module():
    assert load_plugins(external=False).registry.names("advantage_estimator") == [
        "grpo", "dapo-token-scale", "gpg", "opo", "process", "rloo", "reinforce++", "reinforce++-no-baseline",
        "remax", "passk", "gdpo", "opd"]


@pytest.mark.parametrize("model", [GRPOOptions, ProcessOptions, ReinforcePlusPlusOptions])
def test_options_reject_unknown_keys(model):
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        model(nonsense=1)


@pytest.mark.parametrize("model", [PassKOptions, OPOOptions, GPGOptions, ReMaxOptions, ReinforceNoBaselineOptions])
def test_options_cite_the_paper_and_reject_unknown_keys(model):
    text = (model.__doc__ or "") + " ".join(f.description or "" for f in model.model_fields.values())
    assert "https://arxiv.org/abs/" in text
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        model(nonsense=1)


@pytest.mark.parametrize("model, kwargs, message", [
    (GRPOOptions, {"std": "sample"}, "'population' or 'unbiased'"),
    (GRPOOptions, {"std_scope": "global"}, "'group' or 'batch'"),
    (GRPOOptions, {"eps": -1.0}, "greater than or equal to 0"),
    (ProcessOptions, {"eps": float("nan")}, "finite number"),
    (ReinforcePlusPlusOptions, {"eps": 0.0}, "greater than 0"),
    (PassKOptions, {}, "k\n  Field required"),
    (PassKOptions, {"k": 0}, "greater than or equal to 1"),
    (GPGOptions, {"eps": -1.0}, "greater than or equal to 0"),
    (ReMaxOptions, {"missing_baseline": "mean"}, "'zero' or 'group-mean'"),
    (ReinforceNoBaselineOptions, {"gamma": 1.5}, "less than or equal to 1"),
    (ReinforceNoBaselineOptions, {"gamma": 0.0}, "greater than 0"),
])
def test_options_invalid_values_say_what_is_valid(model, kwargs, message):
    with pytest.raises(ValidationError, match=message):
        model(**kwargs)
