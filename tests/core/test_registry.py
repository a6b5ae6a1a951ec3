"""The registry and its registrar: who registered what, duplicate names, valid names and
options models, and the message for an unknown name.

Every test builds a fresh plugin manager with ``load_plugins(external=False, objects=...)``
and registers inline plugin classes on it; nothing module-level is patched.
"""

from __future__ import annotations

import inspect

import pytest
from pydantic import BaseModel, ConfigDict, Field

from grpo_core import hookimpl, hookspecs
from grpo_core.commands import COMMANDS_HOOK
from grpo_core.errors import PluginError
from grpo_core.kinds import KINDS
from grpo_core.options import Options
from grpo_core.plugin_manager import load_plugins
from grpo_core.registry import Component, Registry


def noop_reward(prompts, completions, **kwargs):
    """Scores every completion 0.

    More text that is not part of the description."""
    return [0.0 for _ in completions]


class ToyOptions(Options):
    alpha: float = Field(1.0, gt=0, description="A positive number.")


class ToyFactory:
    """A toy advantage estimator built from its options."""

    def __init__(self, options: ToyOptions):
        self.options = options

    def __call__(self, inputs):
        return inputs.mask.float() * self.options.alpha


def plugin(name: str, hook: str = "register_reward_functions", **adds):
    """An inline plugin class ``name`` whose ``hook`` calls ``register.add`` for each item
    of ``adds`` (``component_name=(impl, kwargs)``)."""

    def register(self, register):
        for comp_name, (impl, kwargs) in adds.items():
            register.add(comp_name, impl, **kwargs)

    return type(name, (), {hook: hookimpl(register, specname=hook)})()


# --------------------------------------------------------------------------- hook specs
def test_one_hook_per_kind_named_register_kinds():
    specs = {
        name
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if getattr(fn, "grpo_spec", None) is not None
    }
    assert specs == {kind.hook for kind in KINDS.values()} | {COMMANDS_HOOK}  # and one hook for commands
    assert set(KINDS) >= {  # the design's eight kinds (more may come)
        "advantage_estimator", "kl_penalty", "policy_loss", "loss_aggregator",
        "rollout_backend", "reward_function", "dataset", "tracker",
    }
    for kind, entry in KINDS.items():
        hook = entry.hook
        # register_<kind>s, with English plurals (penalty -> penalties, loss -> losses)
        if kind.endswith("y"):
            plural = kind[:-1] + "ies"
        elif kind.endswith("s"):
            plural = kind + "es"
        else:
            plural = kind + "s"
        assert hook == f"register_{plural}"
        fn = getattr(hookspecs, hook)
        assert list(inspect.signature(fn).parameters) == ["register"]
        assert fn.__doc__ and "called once" in fn.__doc__
        assert entry.label and callable(entry.protocol)  # one table: hook, words, contract
    commands = getattr(hookspecs, COMMANDS_HOOK)
    assert list(inspect.signature(commands).parameters) == ["register"]
    assert "called once" in commands.__doc__ and "Added in" in commands.__doc__


# --------------------------------------------------------------------------- add
def test_add_records_the_plugin_and_description():
    plugins = load_plugins(
        external=False,
        objects=[
            plugin("RewardPlugin", toy=(noop_reward, {})),
            plugin(
                "AdvPlugin",
                "register_advantage_estimators",
                toy=(ToyFactory, {"options": ToyOptions, "description": "explicit words"}),
            ),
        ],
    )
    reward = plugins.registry.get("reward_function", "toy")
    assert reward == Component(
        "reward_function", "toy", noop_reward, None, "RewardPlugin", "Scores every completion 0."
    )
    adv = plugins.registry.get("advantage_estimator", "toy")
    assert (adv.plugin, adv.options, adv.description) == ("AdvPlugin", ToyOptions, "explicit words")
    # the same name in two kinds is two components, no clash
    assert plugins.info["RewardPlugin"].components == {"reward_function": ["toy"]}
    assert plugins.info["AdvPlugin"].components == {"advantage_estimator": ["toy"]}


def test_names_keep_registration_order():
    plugins = load_plugins(
        external=False,
        objects=[plugin("P", zeta=(noop_reward, {}), alpha=(noop_reward, {}), mid=(noop_reward, {}))],
    )
    names = plugins.registry.names("reward_function")
    assert names[-3:] == ["zeta", "alpha", "mid"]
    # built-ins first, in DEFAULT_PLUGINS order, then the inline plugin
    assert names.index("accuracy") < names.index("zeta")


def test_build_returns_the_impl_or_calls_the_factory():
    plugins = load_plugins(
        external=False,
        objects=[
            plugin("R", plain=(noop_reward, {})),
            plugin("A", "register_advantage_estimators", fac=(ToyFactory, {"options": ToyOptions})),
        ],
    )
    assert plugins.registry.get("reward_function", "plain").build() is noop_reward
    fac = plugins.registry.get("advantage_estimator", "fac")
    assert fac.build().options == ToyOptions()  # default options when none given
    assert fac.build(ToyOptions(alpha=3)).options.alpha == 3


# --------------------------------------------------------------------------- duplicates
def test_same_name_twice_names_both_plugins():
    with pytest.raises(PluginError) as info:
        load_plugins(
            external=False,
            objects=[plugin("FirstPlugin", dup=(noop_reward, {})), plugin("SecondPlugin", dup=(noop_reward, {}))],
        )
    message = str(info.value)
    assert "reward function 'dup' is registered twice" in message
    assert "by plugin 'FirstPlugin' and by plugin 'SecondPlugin'" in message
    assert "GRPO_DISABLED_PLUGINS" in message


def test_same_name_as_a_builtin_names_the_builtin_module():
    with pytest.raises(PluginError) as info:
        load_plugins(
            external=False,
            objects=[plugin("Shadow", "register_advantage_estimators", grpo=(ToyFactory, {"options": ToyOptions}))],
        )
    message = str(info.value)
    assert "advantage estimator 'grpo' is registered twice" in message
    assert "'grpo_plugins.advantages.grpo'" in message and "'Shadow'" in message


def test_same_name_twice_in_one_plugin_is_an_error():
    class Twice:
        @hookimpl
        def register_trackers(self, register):
            register.add("t", object())
            register.add("t", object())

    with pytest.raises(PluginError, match="tracker 't' is registered twice: by plugin 'Twice' and by plugin 'Twice'"):
        load_plugins(external=False, objects=[Twice()])


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("bad", ["", "-lead", "has space", "a/b", 3, None])
def test_invalid_component_name_says_what_names_may_be(bad):
    class BadName:
        @hookimpl
        def register_datasets(self, register):
            register.add(bad, object())

    with pytest.raises(PluginError) as info:
        load_plugins(external=False, objects=[BadName()])
    message = str(info.value)
    assert f"plugin 'BadName' registered a dataset with an invalid name {bad!r}" in message
    assert "letters, digits and _ . + -" in message


def test_options_must_be_a_pydantic_model():
    class NotAModel:
        alpha: float = 1.0

    class P:
        @hookimpl
        def register_kl_penalties(self, register):
            register.add("k", ToyFactory, options=NotAModel)

    with pytest.raises(PluginError) as info:
        load_plugins(external=False, objects=[P()])
    assert "plugin 'P' registered KL penalty 'k' with options=" in str(info.value)
    assert "must be a pydantic BaseModel subclass (or None)" in str(info.value)


@pytest.mark.parametrize("extra", [None, "ignore", "allow"])
def test_options_model_must_forbid_extra_keys(extra):
    config = ConfigDict() if extra is None else ConfigDict(extra=extra)
    Loose = type("LooseOptions", (BaseModel,), {"model_config": config, "__annotations__": {"a": int}, "a": 1})

    class P:
        @hookimpl
        def register_policy_losses(self, register):
            register.add("loose", ToyFactory, options=Loose)

    with pytest.raises(PluginError) as info:
        load_plugins(external=False, objects=[P()])
    message = str(info.value)
    assert "policy loss 'loose'" in message and "LooseOptions that accepts unknown keys" in message
    assert "extra='forbid'" in message and "grpo_core.options.Options" in message


def test_forbidding_model_is_accepted_and_options_base_forbids():
    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid")

    class P:
        @hookimpl
        def register_loss_aggregators(self, register):
            register.add("strict", ToyFactory, options=Strict)
            register.add("opts", ToyFactory, options=ToyOptions)

    registry = load_plugins(external=False, objects=[P()]).registry
    assert registry.get("loss_aggregator", "strict").options is Strict
    assert Options.model_config["extra"] == "forbid"


def test_hook_that_raises_is_named():
    class Broken:
        @hookimpl
        def register_rollout_backends(self, register):
            raise KeyError("oops")

    with pytest.raises(PluginError) as info:
        load_plugins(external=False, objects=[Broken()])
    assert "plugin 'Broken' failed in register_rollout_backends: KeyError: 'oops'" in str(info.value)


# --------------------------------------------------------------------------- lookup
def test_unknown_name_lists_available_and_closest():
    registry = load_plugins(external=False).registry
    with pytest.raises(PluginError) as info:
        registry.get("policy_loss", "clpi")
    assert str(info.value) == ("unknown policy loss 'clpi'; did you mean 'clip'?; available: "
                               + ", ".join(registry.names("policy_loss")))
    assert ", ".join(registry.names("policy_loss")).startswith("clip, gspo, ")


def test_unknown_name_without_close_match_still_lists_available():
    registry = load_plugins(external=False).registry
    message = registry.unknown_message("loss_aggregator", "zzzzzz")
    assert "did you mean" not in message
    assert message.endswith("available: " + ", ".join(registry.names("loss_aggregator")))
    assert "token-mean" in message


def test_unknown_name_in_an_empty_kind_says_none_registered():
    assert Registry().unknown_message("tracker", "x") == "unknown tracker 'x'; available: (none registered)"


def test_find_is_none_and_get_raises_for_unknown():
    registry = Registry()
    assert registry.find("dataset", "nope") is None
    with pytest.raises(PluginError, match="unknown dataset 'nope'"):
        registry.get("dataset", "nope")
