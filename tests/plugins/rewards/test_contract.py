"""The rule and model rewards as registered components (by their modules, built from their options,
named and described), and ``completion_text``, which every reward reads completions with."""

from __future__ import annotations

import pytest
from grpo_plugins.rewards.answers import AccuracyOptions
from grpo_plugins.rewards.format import FormatOptions
from grpo_plugins.rewards.length import OverlongOptions
from grpo_plugins.rewards.model import RewardModelOptions

from grpo_core.contracts import completion_text
from grpo_core.plugin_manager import load_plugins

from .conftest import chat


@pytest.mark.parametrize(
    "completion, text",
    [
        ("plain 19", "plain 19"),
        (chat("it is 19"), "it is 19"),
        ({"role": "assistant", "content": "one message"}, "one message"),
        ([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}], "ab"),
        ([{"role": "assistant", "content": [{"type": "text", "text": "parts"}]}], "parts"),
        ([], ""),
    ],
)
def test_completion_text_of_each_representation(completion, text):
    assert completion_text(completion) == text


def test_completion_text_rejects_other_types():
    with pytest.raises(TypeError, match="string or a list of chat messages"):
        completion_text(19)


REGISTERED = {
    "accuracy": (AccuracyOptions, {}, "answers"),
    "format": (FormatOptions, {"pattern": r"\d+"}, "format"),
    "overlong": (OverlongOptions, {"max_length": 16}, "length"),
    "reward_model": (RewardModelOptions, {"path": "/nonexistent"}, "model"),
}


@pytest.mark.parametrize("name", sorted(REGISTERED))
def test_registered_and_buildable_from_options(name):
    registry = load_plugins(external=False).registry
    component = registry.get("reward_function", name)
    options_model, values, module = REGISTERED[name]
    assert component.plugin == f"grpo_plugins.rewards.{module}"
    assert component.options is options_model
    assert component.description
    built = component.build(options_model(**values))
    assert callable(built) and built.__name__ == name and name in repr(built)


@pytest.mark.parametrize("model", [m for m, _, _ in REGISTERED.values()])
def test_every_option_has_a_description(model):
    for field_name, field in model.model_fields.items():
        assert field.description, f"{model.__name__}.{field_name} has no description"
