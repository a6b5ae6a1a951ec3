"""The spec: safe YAML, composed models, slots resolved in two phases (the name in the
registry, then the keys with that plugin's options model), every error at once with its
YAML path and line, ``--set`` overrides, and a description on every field.

One test per error message, each asserting that the message lists what is valid.
"""

from __future__ import annotations

import textwrap
import typing
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from grpo_core import hookimpl
from grpo_core.errors import SpecError
from grpo_core.kinds import KINDS
from grpo_core.options import Options
from grpo_core.plugin_manager import load_plugins
from grpo_core.spec import Slot, Spec, SpecPath, dump_spec, load_spec
from grpo_core.spec.models import RewardSlot
from grpo_core.spec.slots import field_types, iter_slots

MINIMAL = """\
model:
  path: some/model
rewards:
  - name: accuracy
"""


class ToyOptions(Options):
    alpha: float = Field(1.0, gt=0, description="A positive number.")
    mode: Literal["fast", "slow"] = Field("fast", description="How.")
    table: SpecPath | None = Field(None, description="A file, relative to the spec.")


class ToyAdvantage:
    """A toy advantage estimator."""

    def __init__(self, options: ToyOptions):
        self.options = options

    def __call__(self, inputs):
        return inputs.mask.float() * self.options.alpha


def bare_advantage(inputs):
    """An advantage estimator without options."""


class ToyPlugin:
    @hookimpl
    def register_advantage_estimators(self, register):
        register.add("toy", ToyAdvantage, options=ToyOptions)
        register.add("bare", bare_advantage)


@pytest.fixture
def plugins():
    """A fresh plugin manager: the built-ins plus ToyPlugin."""
    return load_plugins(external=False, objects=[ToyPlugin()])


@pytest.fixture
def load(tmp_path, plugins):
    """``load(text, *overrides)``: write ``text`` to ``spec.yaml`` and load it."""

    def run(text: str, *overrides: str, name: str = "spec.yaml"):
        path = tmp_path / name
        path.write_text(textwrap.dedent(text), encoding="utf-8")
        return load_spec(path, overrides, plugins=plugins)

    return run


@pytest.fixture
def problems(load):
    """``problems(text, *overrides)``: the list of problems of an invalid spec."""

    def run(text: str, *overrides: str) -> list[str]:
        with pytest.raises(SpecError) as info:
            load(text, *overrides)
        return info.value.problems

    return run


# --------------------------------------------------------------------------- valid specs
def test_minimal_spec_fills_every_default_and_resolves_every_slot(load):
    loaded = load(MINIMAL)
    spec = loaded.spec
    assert spec.model.path == "some/model"
    assert spec.algorithm.advantage.name == "grpo" and spec.rollout.name == "hf"
    assert [t.name for t in spec.tracking] == ["mlflow"]
    slots = list(iter_slots(spec))
    assert {path for path, _ in slots} >= {
        ("data",), ("rollout",), ("rewards", 0), ("algorithm", "advantage"), ("algorithm", "kl"),
        ("algorithm", "policy_loss"), ("algorithm", "aggregation"), ("tracking", 0),
    }
    for path, slot in slots:
        component = slot.component
        assert (component.kind, component.name) == (slot.kind, slot.name), path
        if component.options is None:
            assert slot.options is None
        else:  # the plugin's defaults, validated, kept on the slot
            assert slot.options == component.options(), path


def test_plugin_options_are_validated_by_its_model_and_kept(load):
    spec = load(
        """\
        model: {path: m}
        rewards: [{name: accuracy}]
        algorithm:
          advantage: {name: toy, alpha: 2, mode: slow}
        """
    ).spec
    slot = spec.algorithm.advantage
    assert isinstance(slot.options, ToyOptions)
    assert (slot.options.alpha, slot.options.mode) == (2.0, "slow")
    built = slot.build()
    assert isinstance(built, ToyAdvantage) and built.options is slot.options
    # the options are not left as raw extra keys on the slot, and dump back flat
    assert slot.model_extra == {}
    assert slot.model_dump() == {"name": "toy", "alpha": 2.0, "mode": "slow", "table": None}


def test_engine_fields_of_a_slot_stay_on_the_slot(load):
    spec = load(
        """\
        model: {path: m}
        rewards:
          - {name: accuracy, weight: 0.5, answer_column: gold}
        algorithm:
          kl: {name: kl, beta: 0.1, placement: reward}
        """
    ).spec
    reward, kl = spec.rewards[0], spec.algorithm.kl
    assert reward.weight == 0.5 and reward.options.answer_column == "gold"
    assert (kl.beta, kl.placement) == (0.1, "reward") and not hasattr(kl.options, "beta")


def test_paths_resolve_against_the_spec_folder(tmp_path, load, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)
    spec = load(
        """\
        model: {path: m}
        rewards: [{name: accuracy}]
        train: {output_dir: runs/one}
        algorithm:
          advantage: {name: toy, table: data/t.csv}
        checkpoint: {}
        """
    ).spec
    assert spec.train.output_dir == tmp_path / "runs" / "one"
    assert spec.algorithm.advantage.options.table == tmp_path / "data" / "t.csv"
    absolute = load(MINIMAL + f"train: {{output_dir: {tmp_path / 'abs'}}}\n").spec
    assert absolute.train.output_dir == tmp_path / "abs"


def test_a_mapping_is_a_source_too(plugins):
    loaded = load_spec({"model": {"path": "m"}, "rewards": [{"name": "accuracy"}]}, plugins=plugins)
    assert loaded.path is None and loaded.spec.rewards[0].name == "accuracy"


def test_dump_and_reload_gives_the_same_spec(tmp_path, load):
    first = load(
        """\
        model: {path: m, lora: {r: 4}}
        rewards: [{name: accuracy}, {name: format, pattern: '^\\d+$', weight: 0.5}]
        algorithm: {advantage: {name: toy, alpha: 3, table: t.csv}}
        train: {output_dir: out}
        """
    ).spec
    text = dump_spec(first)
    second = load(text, name="resolved.yaml").spec
    assert second.model_dump() == first.model_dump()
    assert dump_spec(second) == text


def test_dump_keeps_every_character_of_strings(tmp_path, plugins):
    """NEL (U+0085) and the Unicode line separators survive the dump (PyYAML folds a raw
    NEL into a space when it reads it back)."""
    odd = ["a\x85b", "\x85", "caf\xe9 \u2028 \u2029 \t \n end ", "\x00\x1b\ufeff"]
    first = load_spec(
        {"model": {"path": "m"}, "rewards": [{"name": "accuracy"}], "rollout": {"stop": odd}, "run_name": odd[0]},
        plugins=plugins,
    ).spec
    (tmp_path / "dumped.yaml").write_text(dump_spec(first), encoding="utf-8")
    second = load_spec(tmp_path / "dumped.yaml", plugins=plugins).spec
    assert second.rollout.stop == odd and second.run_name == odd[0]
    assert "caf\xe9" in dump_spec(first)  # still readable: unicode is written as is


# --------------------------------------------------------------------------- safe YAML
@pytest.mark.parametrize(
    ("tag", "shown"),
    [
        ("!!python/object/apply:os.system ['touch {marker}']", "!!python/object/apply:os.system"),
        ("!!python/object/new:os.system ['touch {marker}']", "!!python/object/new:os.system"),
        ("!!python/name:os.system", "!!python/name:os.system"),
        ("!!python/object:collections.OrderedDict {{}}", "!!python/object:collections.OrderedDict"),
    ],
)
def test_python_tags_are_rejected_not_executed(tmp_path, problems, tag, shown):
    marker = tmp_path / "executed"
    found = problems(f"model: {tag.format(marker=marker)}\nrewards: [{{name: accuracy}}]\n")
    assert len(found) == 1
    assert found[0].startswith(f"YAML tag '{shown}' is not allowed (line 1, column 8): ")
    assert "safe loader" in found[0]
    assert not marker.exists()


def test_invalid_yaml_says_where(problems):
    assert problems("model: {path: m\nrewards: []\n") == [
        "not valid YAML (line 2, column 8): expected ',' or '}', but got ':'"
    ]


def test_spec_file_must_exist(tmp_path, plugins):
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path / "missing.yaml", plugins=plugins)
    assert info.value.problems == [f"spec file {tmp_path / 'missing.yaml'} does not exist"]


def test_spec_file_must_be_utf8(tmp_path, plugins):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("model: {path: caf\xe9}\n".encode("latin-1"))
    with pytest.raises(SpecError, match=r"cannot read spec file .*latin1.yaml: 'utf-8' codec can't decode"):
        load_spec(path, plugins=plugins)


@pytest.mark.parametrize(("text", "got"), [("- a\n- b\n", "list"), ("just text\n", "str"), ("3\n", "int")])
def test_top_level_must_be_a_mapping(problems, text, got):
    assert problems(text) == [f"spec: the top level must be a mapping of sections, got {got}"]


def test_empty_file_is_missing_the_required_sections(problems):
    assert problems("") == ["spec.model: required but missing", "spec.rewards: required but missing"]


# --------------------------------------------------------------------------- unknown names
SLOTS = [
    # (YAML that selects `name` in the slot, its path, the kind)
    ("data: {{name: {name}}}", "data.name", "dataset"),
    ("rollout: {{name: {name}}}", "rollout.name", "rollout_backend"),
    ("algorithm: {{advantage: {{name: {name}}}}}", "algorithm.advantage.name", "advantage_estimator"),
    ("algorithm: {{kl: {{name: {name}}}}}", "algorithm.kl.name", "kl_penalty"),
    ("algorithm: {{policy_loss: {{name: {name}}}}}", "algorithm.policy_loss.name", "policy_loss"),
    ("algorithm: {{aggregation: {{name: {name}}}}}", "algorithm.aggregation.name", "loss_aggregator"),
    ("tracking: [{{name: {name}}}]", "tracking.0.name", "tracker"),
]


@pytest.mark.parametrize(("section", "path", "kind"), SLOTS, ids=[s[2] for s in SLOTS])
def test_unknown_plugin_name_lists_that_kind_and_the_closest(problems, plugins, section, path, kind):
    names = plugins.registry.names(kind)
    typo = names[0][:-1] + "X" + names[0][-1]  # one letter inserted before the last one
    found = problems(MINIMAL + section.format(name=typo) + "\n")
    assert found == [
        f"spec.{path} (line 5): unknown {KINDS[kind].label} '{typo}'; did you mean '{names[0]}'?; "
        f"available: {', '.join(names)}"
    ]


def test_unknown_reward_name_lists_the_reward_functions(problems, plugins):
    names = ", ".join(plugins.registry.names("reward_function"))
    assert problems("model: {path: m}\nrewards:\n  - name: accuracy\n  - name: fromat\n") == [
        f"spec.rewards.1.name (line 4): unknown reward function 'fromat'; did you mean 'format'?; available: {names}"
    ]


def test_unknown_plugin_name_far_from_any_lists_them_without_a_guess(problems, plugins):
    (found,) = problems(MINIMAL + "algorithm: {policy_loss: {name: zzzzzzzz}}\n")
    assert "did you mean" not in found
    assert found.endswith("available: " + ", ".join(plugins.registry.names("policy_loss")))


# --------------------------------------------------------------------------- unknown keys
def test_unknown_top_level_key_names_the_closest_and_lists_sections(problems):
    assert problems(MINIMAL + "trian: {steps: 3}\n") == [
        "spec.trian (line 5): unknown key 'trian'; did you mean 'train'?; valid keys: "
        + ", ".join(Spec.model_fields)
    ]


def test_unknown_section_key_lists_that_sections_keys(problems):
    from grpo_core.spec.models import LoraSection, TrainSection

    assert problems(MINIMAL + "train:\n  steps: 3\n  zzzzzz: 1\n") == [
        "spec.train.zzzzzz (line 7): unknown key 'zzzzzz'; valid keys: "
        + ", ".join(TrainSection.model_fields)
    ]
    found = problems("model:\n  path: m\n  lora:\n    rr: 4\nrewards: [{name: accuracy}]\n")
    assert found == [
        "spec.model.lora.rr (line 4): unknown key 'rr'; did you mean 'r'?; valid keys: "
        + ", ".join(LoraSection.model_fields)
    ]


def test_unknown_option_key_names_the_plugin_and_lists_slot_and_option_keys(problems):
    found = problems(MINIMAL + "algorithm:\n  advantage:\n    name: toy\n    alpah: 2\n")
    assert found == [
        "spec.algorithm.advantage.alpah (line 8): unknown key 'alpah' for advantage estimator "
        "'toy'; did you mean 'alpha'?; valid keys: name, alpha, mode, table"
    ]


def test_unknown_engine_key_of_a_slot_lists_engine_and_option_keys(problems, plugins):
    (found,) = problems(MINIMAL + "rollout: {name: hf, group_sise: 4}\n")
    options = plugins.registry.get("rollout_backend", "hf").options
    assert found.startswith(
        "spec.rollout.group_sise (line 5): unknown key 'group_sise' for rollout backend 'hf'; "
        "did you mean 'group_size'?; valid keys: name, group_size, max_new_tokens"
    )
    assert all(key in found for key in options.model_fields)


def test_component_without_options_lists_its_only_keys(problems):
    assert problems(MINIMAL + "algorithm: {advantage: {name: bare, alpha: 1, beta: 2}}\n") == [
        "spec.algorithm.advantage (line 5): advantage estimator 'bare' takes no options; "
        "unknown key(s): alpha, beta; valid keys: name"
    ]


# --------------------------------------------------------------------------- wrong values
def test_wrong_option_value_is_reported_with_its_path_and_line(problems):
    assert problems(MINIMAL + "algorithm:\n  advantage:\n    name: toy\n    alpha: -1\n") == [
        "spec.algorithm.advantage.alpha (line 8): Input should be greater than 0"
    ]


def test_wrong_literal_lists_the_valid_values(problems):
    (found,) = problems("model:\n  path: m\n  dtype: fp64\nrewards: [{name: accuracy}]\n")
    assert found == (
        "spec.model.dtype (line 3): Input should be 'float32', 'bfloat16' or 'float16' (got 'fp64')"
    )


def test_model_needs_a_source(problems):
    assert problems("model: {dtype: float32}\nrewards: [{name: accuracy}]\n") == [
        "spec.model (line 1): give model.path (a folder or Hub id) or model.package (an installed package)"
    ]


def test_mini_batches_must_divide_prompts(problems):
    (found,) = problems(MINIMAL + "train: {prompts_per_step: 3, mini_batches: 2}\n")
    assert "train.mini_batches (2) must divide train.prompts_per_step (3)" in found


def test_rewards_need_at_least_one(problems):
    (found,) = problems("model: {path: m}\nrewards: []\n")
    assert found.startswith("spec.rewards (line 2): List should have at least 1 item")


def test_every_problem_is_reported_at_once_with_path_and_line(problems):
    found = problems(
        """\
        model:
          path: m
          dtype: fp64
        rewards:
          - name: acuracy
          - name: accuracy
            weight: heavy
        train:
          steps: 0
          stepz: 3
        algorithm:
          kl: {name: low_var_kl, beta: -1}
          advantage: {name: grpp}
        """
    )
    by_path = {p.split(" ", 1)[0]: p for p in found}
    assert set(by_path) == {
        "spec.model.dtype", "spec.rewards.1.weight", "spec.train.steps", "spec.train.stepz",
        "spec.algorithm.kl.beta", "spec.rewards.0.name", "spec.algorithm.advantage.name",
    }
    assert by_path["spec.model.dtype"].startswith("spec.model.dtype (line 3): ")
    assert by_path["spec.rewards.1.weight"].startswith("spec.rewards.1.weight (line 7): ")
    assert by_path["spec.train.steps"].startswith("spec.train.steps (line 9): ")
    expected = "spec.train.stepz (line 10): unknown key 'stepz'; did you mean 'steps'?"
    assert by_path["spec.train.stepz"].startswith(expected)
    # unknown names are found even though the models failed: both phases report at once
    assert by_path["spec.rewards.0.name"].startswith(
        "spec.rewards.0.name (line 5): unknown reward function 'acuracy'; did you mean 'accuracy'?"
    )
    assert "unknown advantage estimator 'grpp'; did you mean 'grpo'?" in by_path["spec.algorithm.advantage.name"]


@pytest.mark.parametrize("engine_field", ["max_staleness: -1", "group_size: 1", "temperature: 0"])
def test_a_bad_engine_field_of_a_slot_does_not_hide_its_plugins_option_errors(problems, engine_field):
    """Issue 34, item 12: before, a bad ``max_staleness`` (or ``group_size``) was the only problem
    reported, the backend's bad options hidden behind it."""
    found = problems(f"model: {{path: m}}\nrewards: [{{name: accuracy}}]\n"
                     f"rollout: {{{engine_field}, dtype: float8, sampler: gumbel}}\n")
    key = engine_field.split(":")[0]
    assert [p.split(" ", 1)[0] for p in found] == [f"spec.rollout.{key}", "spec.rollout.dtype", "spec.rollout.sampler"]
    assert found[1] == "spec.rollout.dtype (line 3): Input should be 'auto', 'bfloat16', 'float16' or 'float32'"


def test_every_bad_url_and_duration_of_the_server_backend_is_reported(problems):
    found = problems(
        """\
        model: {path: m}
        rewards: [{name: accuracy}]
        rollout:
          name: vllm-server
          max_staleness: -1
          urls: [localhost, "ftp://x:1", "http://ok:1"]
          timeout_s: 1.0e+30
        """
    )
    by_path = {p.split(" ", 1)[0]: p for p in found}
    assert set(by_path) == {"spec.rollout.max_staleness", "spec.rollout.urls.0", "spec.rollout.urls.1",
                            "spec.rollout.timeout_s"}
    assert "'localhost' is not a server URL: write http://HOST:PORT" in by_path["spec.rollout.urls.0"]
    assert "'ftp://x:1' is not a server URL" in by_path["spec.rollout.urls.1"]
    assert by_path["spec.rollout.timeout_s"] == (
        "spec.rollout.timeout_s (line 7): at most 31536000 seconds (365 days), got 1e+30: a longer wait bounds "
        "nothing, and the platform's locks and sockets cannot represent one much longer")


def test_a_nested_slot_is_checked_when_its_parent_failed(problems):
    found = problems("model: {path: m}\nrewards: [{name: accuracy}]\n"
                     "rollout: {max_staleness: -1, environment: {name: toolz}}\n")
    assert any(p.startswith("spec.rollout.environment.name (line 3): unknown environment 'toolz'") for p in found)


def test_spec_error_message_counts_and_lists_every_problem(tmp_path, plugins):
    path = tmp_path / "two.yaml"
    path.write_text("model: {path: m}\nrewards: [{name: nope}]\ntrain: {steps: x}\n", encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_spec(path, plugins=plugins)
    message = str(info.value)
    assert message.startswith(f"invalid spec {path} (2 problems):\n  spec.")
    assert all(f"  {p}" in message for p in info.value.problems)
    assert info.value.exit_code == 2


# --------------------------------------------------------------------------- --set
def test_set_overrides_scalars_list_items_and_plugin_options(load):
    spec = load(
        MINIMAL,
        "train.lr=1e-5",
        "rewards.0.weight=2.5",
        "algorithm.advantage.name=toy",
        "algorithm.advantage.alpha=3",
        "rollout.stop=['\\n', END]",
        "run_name=",
    ).spec
    assert spec.train.lr == 1e-5
    assert spec.rewards[0].weight == 2.5
    assert spec.algorithm.advantage.options.alpha == 3.0
    assert spec.rollout.stop == ["\\n", "END"]
    assert spec.run_name == ""


def test_set_creates_missing_sections_and_appends_list_items(load):
    spec = load(
        "rewards: [{name: accuracy}]\n",
        "model.path=m",
        "model.lora.r=8",
        "rewards.1.name=format",
        "rewards.1.pattern=^x",
        "tracking.0.name=console",
    ).spec
    assert spec.model.path == "m" and spec.model.lora.r == 8 and spec.model.lora.alpha == 32.0
    assert [r.name for r in spec.rewards] == ["accuracy", "format"]
    assert spec.rewards[1].options.pattern == "^x"
    assert [t.name for t in spec.tracking] == ["console"]


def test_set_values_are_validated_like_the_file_and_labelled(problems, plugins):
    found = problems(
        MINIMAL + "algorithm: {advantage: {name: toy}}\n",
        "algorithm.advantage.alpha=-1",
        "train.steps=many",
        "rewards.1.name=fromat",
    )
    rewards = ", ".join(plugins.registry.names("reward_function"))
    assert sorted(found) == sorted([
        "spec.train.steps (--set): Input should be a valid integer, unable to parse string as an integer (got 'many')",
        f"spec.rewards.1.name (--set): unknown reward function 'fromat'; did you mean 'format'?; available: {rewards}",
        "spec.algorithm.advantage.alpha (--set): Input should be greater than 0",
    ])


def test_set_unknown_key_names_the_closest(problems):
    (found,) = problems(MINIMAL, "train.setps=3")
    assert found.startswith("spec.train.setps (--set): unknown key 'setps'; did you mean 'steps'?; valid keys: steps,")


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("train.lr", "spec: --set 'train.lr': expected path.to.key=value"),
        ("train..lr=1", "spec: invalid key 'train..lr': use dotted names like train.lr or rewards.0.weight"),
        ("=1", "spec: invalid key '': use dotted names like train.lr or rewards.0.weight"),
        ("rewards.5.weight=1", "spec: --set rewards.5.weight: rewards has no item 5"),
        ("rewards.3=x", "spec: --set rewards.3: rewards has no item 3"),
        ("model.path.x=1", "spec: --set model.path.x: model.path is not a mapping"),
        ("model.0=1", "spec: --set model.0: model has no item 0"),
        ("rewards.0.name=[1", "spec: --set rewards.0.name: the value '[1' is not valid YAML "
                              "(expected ',' or ']', but got '<stream end>'); quote it to pass a string"),
    ],
)
def test_set_syntax_errors_say_what_is_expected(problems, assignment, message):
    assert problems(MINIMAL, assignment) == [message]


# --------------------------------------------------------------------------- descriptions
def _models(model: type[BaseModel], seen: set) -> None:
    if model in seen:
        return
    seen.add(model)
    for field in model.model_fields.values():
        for t in field_types(field.annotation):
            if isinstance(t, type) and issubclass(t, BaseModel):
                _models(t, seen)


def test_every_field_of_every_spec_and_builtin_options_model_has_a_description():
    seen: set = set()
    _models(Spec, seen)
    registry = load_plugins(external=False).registry
    option_models = 0
    for kind in KINDS:
        for component in registry.components(kind):
            if component.options is not None:
                option_models += 1
                _models(component.options, seen)
    assert option_models >= 20  # the walk reached the plugins' models
    assert {m.__name__ for m in seen} >= {"Spec", "ModelSection", "LoraSection", "TrainSection", "RewardSlot"}
    missing = [f"{m.__module__}.{m.__name__}.{name}" for m in seen for name, f in m.model_fields.items()
               if not (f.description and f.description.strip())]
    assert missing == []


def test_every_builtin_options_model_forbids_unknown_keys():
    registry = load_plugins(external=False).registry
    for kind in KINDS:
        for component in registry.components(kind):
            if component.options is not None:
                assert component.options.model_config.get("extra") == "forbid", component


def test_every_slot_field_is_a_slot_of_a_known_kind():
    seen: set = set()
    _models(Spec, seen)
    slots = {m for m in seen if issubclass(m, Slot)}
    assert RewardSlot in slots
    # the launcher is chosen on the command line (grpo-run run --launcher): it decides where the
    # run's processes start, not what they compute, so one spec runs under any launcher
    assert {s.kind for s in slots} == set(KINDS) - {"launcher"}
    for s in slots:
        assert typing.get_type_hints(s)["name"] is str


def test_the_resume_hint_repeats_the_overrides(tmp_path):
    """A run started with --set must be resumed with the same --set, or it looks elsewhere."""
    import shlex

    from grpo_core.spec import load_spec

    spec = tmp_path / "s.yaml"
    spec.write_text("model: {path: m}\nrewards: [{name: accuracy}]\n")
    loaded = load_spec(spec, iter(["train.output_dir=/tmp/a b", "train.steps=3"]))
    assert shlex.split(loaded.command("--resume")) == [
        "grpo-run", str(spec), "--set", "train.output_dir=/tmp/a b", "--set", "train.steps=3", "--resume"]


def test_mixed_precision_no_survives_yaml(tmp_path):
    """YAML 1.1 reads a bare `no` as false; in the spec it means no mixed precision."""
    from grpo_core.spec import load_spec

    path = tmp_path / "spec.yaml"
    path.write_text("model: {path: m}\nrewards: [{name: accuracy}]\ntrain: {mixed_precision: no}\n", encoding="utf-8")
    assert load_spec(path).spec.train.mixed_precision == "no"
    assert load_spec(path, ["train.mixed_precision=no"]).spec.train.mixed_precision == "no"
    assert load_spec(path, ["train.mixed_precision=bf16"]).spec.train.mixed_precision == "bf16"
