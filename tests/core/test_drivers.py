"""Episode drivers (grpo_core.train.actor.drivers, the EpisodeDriver contract): each spec's driver
is looked up by name in the registry (by default the one of the episode source it sets), a
misnamed or misplaced one is refused naming what is valid, and a third-party driver from a local
plugin file (CONTRIBUTING's example) runs a real training step."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from grpo_core.cli import main
from grpo_core.errors import SpecError
from grpo_core.spec import load_spec

CONTRIBUTING = Path(__file__).resolve().parents[2] / "CONTRIBUTING.md"
BASE = {"model": {"path": "some/model"}, "rewards": [{"name": "accuracy"}], "data": {"name": "arithmetic"}}
TOOLS = {"name": "tools", "tools": ["calculator"]}


@pytest.mark.parametrize(("rollout", "driver"), [
    ({}, "single-turn"),
    ({"environment": TOOLS}, "environment"),
    ({"agent": {"name": "verifiers", "environment": "x"}}, "agent"),
    ({"routing": {"routes": {"calc": {"environment": TOOLS}}}}, "routing"),
])
def test_the_default_driver_is_the_one_of_the_episode_source(rollout, driver):
    spec = load_spec({**BASE, "rollout": rollout}, external_plugins=False).spec
    assert spec.rollout.driver.name == driver
    assert spec.rollout.driver.component.plugin == "grpo_plugins.drivers"
    assert type(spec.rollout.driver.build()).__name__ == {
        "single-turn": "SingleTurn", "environment": "EnvironmentDriver", "agent": "AgentDriver",
        "routing": "RoutedDriver"}[driver]
    if driver == "routing":
        assert spec.rollout.routing.routes["calc"].driver.name == "environment"


def test_an_unknown_driver_is_refused_listing_the_registered_ones():
    with pytest.raises(SpecError) as info:
        load_spec({**BASE, "rollout": {"driver": {"name": "singel-turn"}}}, external_plugins=False)
    message = str(info.value)
    assert "rollout.driver.name" in message and "unknown episode driver 'singel-turn'" in message
    assert "available: single-turn, environment, agent, routing" in message


def test_each_built_driver_is_its_own(tmp_path):
    """Two routes with the same driver get a driver each (built with options: a fresh one)."""
    spec = load_spec({**BASE, "rollout": {"routing": {"routes": {"a": {"environment": TOOLS},
                                                                  "b": {"environment": TOOLS}}}}},
                     external_plugins=False).spec
    routes = spec.rollout.routing.routes
    assert routes["a"].driver.build() is not routes["b"].driver.build()


def test_a_driver_without_its_source_is_refused_naming_the_setting(write_spec, tmp_path, capsys):
    spec = write_spec(tmp_path, rollout={"driver": {"name": "environment"}}, train={"steps": 1})
    assert main([str(spec)]) != 0
    assert re.search(r"episode driver 'environment' runs rollout.environment .*set it", capsys.readouterr().err)


def test_the_contributing_driver_runs_a_training_step(write_spec, tmp_path, kit):
    """CONTRIBUTING's ``register_episode_drivers`` example, loaded from a local plugin file and
    chosen by ``rollout.driver``, runs every rollout of a real run: its prefix is in each prompt
    (a recording subclass counts the calls and checks the prompts it hands the backend)."""
    text = CONTRIBUTING.read_text(encoding="utf-8")
    section = text[text.index("### `register_episode_drivers(register)`"):]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)[:1]
    log = tmp_path / "calls.jsonl"
    recorder = textwrap.dedent(f'''
        import json


        class Recording(Prefilled):
            def run(self, backend, prompts, group_size, sampling):
                batch = super().run(backend, prompts, group_size, sampling)
                starts = [list(p.ids) + self.prefix for p in prompts]
                pairs = zip(batch.prompt_ids, batch.prompt_mask)
                kept = [row[mask].tolist()[-len(self.prefix):] for row, mask in pairs]
                with open({str(log)!r}, "a") as f:
                    f.write(json.dumps({{"prompts": len(prompts), "g": group_size, "rows": len(batch.completions),
                                        "prefixed": kept == [s[-len(self.prefix):] for s in starts]}}) + "\\n")
                return batch


        @hookimpl
        def register_episode_drivers(register):
            register.add("recording", Recording, options=PrefillOptions)
    ''')
    plugin = code.replace("@hookimpl\ndef register_episode_drivers", "def _unused") + recorder
    (tmp_path / "prefilled.py").write_text(plugin)
    spec = write_spec(tmp_path, plugins=["prefilled.py"], train={"steps": 2},
                      rollout={"driver": {"name": "recording", "prefix": "So:"}})
    assert main([str(spec)]) == 0
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2  # one rollout per step, both through the plugin's driver
    assert all(c == {"prompts": 2, "g": 4, "rows": 8, "prefixed": True} for c in calls), calls
    assert [r["step"] for r in kit.read_metrics(tmp_path / "out" / "metrics.jsonl") if "reward" in r] == [1, 2]


def test_process_supervision_on_a_multi_turn_driver_is_refused(write_spec, tmp_path, capsys):
    """A driver that declares ``multi_turn`` (here ``environment``) gets no step scores: the run
    stops before training, naming the driver and what to use."""
    spec = write_spec(tmp_path, rollout={"environment": TOOLS}, algorithm={"advantage": {"name": "process"}},
                      train={"steps": 1})
    assert main([str(spec)]) != 0
    err = capsys.readouterr().err
    assert "episode driver 'environment': process supervision (step scores) is not supported" in err, err[-2000:]
    assert "use outcome rewards" in err
