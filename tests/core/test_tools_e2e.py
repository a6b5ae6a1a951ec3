"""Multi-turn rollouts end to end: specs/tools.yaml (validated, and run on a tiny model),
and a third-party environment from a local plugin file run by ``grpo-run`` in a real
subprocess."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from grpo_core.cli import main
from grpo_core.spec import load_spec
from grpo_core.testing import save_tiny_model

SPECS = Path(__file__).resolve().parents[2] / "specs"

COUNTDOWN = '''
from grpo_core import hookimpl
from grpo_core.contracts import Observation


class Countdown:
    """Says "go on" after the first model turn and ends the episode after the second,
    rewarding the length of the last turn."""

    tools = []
    stop = tuple("0123456789 ")  # a turn ends at a digit or a space

    def reset(self, row):
        return {"turns": 0}

    def step(self, state, text):
        state["turns"] += 1
        if state["turns"] >= 2:
            return Observation(done=True, reward=float(len(text)))
        return Observation(messages=[{"role": "user", "content": "go on"}])


@hookimpl
def register_environments(register):
    register.add("countdown", Countdown())
'''


def test_the_tools_spec_validates_without_loading_a_model():
    spec = load_spec(SPECS / "tools.yaml", external_plugins=False).spec
    env = spec.rollout.environment
    assert env.name == "tools" and env.component.plugin == "grpo_plugins.environments.tools"
    assert env.options.tools == ["calculator"] and env.max_turns == 3 and env.max_total_tokens == 160
    assert spec.data.options.operations == ("*",) and spec.data.options.min_value == 100
    assert [r.name for r in spec.rewards] == ["accuracy", "tool_success"]
    assert spec.train.threads is not None


@pytest.fixture(scope="module")
def long_tiny_model(tmp_path_factory) -> Path:
    """The tiny model with room for the tool prompt (its byte-level vocabulary spends a token
    on nearly every character of the tools' JSON schemas)."""
    path = save_tiny_model(tmp_path_factory.mktemp("tools-model") / "model")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 2048  # rotary positions: no weights depend on it
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_tools_spec_runs_its_loop_on_a_tiny_model(long_tiny_model, tmp_path, kit):
    out = tmp_path / "tools"
    code = main([str(SPECS / "tools.yaml"),
                 "--set", "model.package=null", "--set", "model.gguf_file=null",
                 "--set", f"model.path={long_tiny_model}", "--set", "train.steps=1", "--set", "train.threads=1",
                 "--set", "data.train_size=8", "--set", "eval.max_prompts=2", "--set", "rollout.group_size=2",
                 "--set", "rollout.max_new_tokens=4", "--set", "rollout.environment.max_total_tokens=24",
                 "--set", "train.progress=false", "--set", "tracking=[]", "--set", f"train.output_dir={out}"])
    assert code == 0
    rows = kit.read_metrics(out / "metrics.jsonl")
    step = next(r for r in rows if "env/turns_per_episode" in r)
    assert 1 <= step["env/turns_per_episode"] <= 3
    assert step["env/model_tokens"] > 0 and "env/tool_calls" in step and "env/tool_call_rate" in step
    evals = [r for r in rows if "eval/env/turns_per_episode" in r]
    assert len(evals) == 2  # at the start and at the end
    assert (out / "final" / "config.json").exists()


def test_a_third_party_environment_from_a_local_plugin_file_runs_from_a_spec(tmp_path, write_spec, child, kit):
    (tmp_path / "countdown.py").write_text(textwrap.dedent(COUNTDOWN))
    spec = write_spec(
        tmp_path, plugins=["countdown.py"],
        rollout={"environment": {"name": "countdown", "max_turns": 3, "max_total_tokens": 64}},
        rewards=[{"name": "env_reward"}], train={"steps": 2},
    )
    proc = child([spec], cwd=tmp_path)
    assert proc.wait(180) == 0, proc.output()
    rows = [r for r in kit.read_metrics(tmp_path / "out" / "metrics.jsonl") if "env/turns_per_episode" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["env/turns_per_episode"] == 2.0  # the environment ended every episode after two turns
        assert r["env/env_tokens"] > 0  # "go on" sat between the turns, as context
        assert r["env/tool_calls"] == 0.0
        assert r["rewards/env_reward/mean"] >= 1.0  # its reward reached the reward function


def test_the_docs_tool_example_registers_an_environment(tmp_path):
    import re

    from grpo_core.plugin_manager import load_plugins

    readme = (SPECS.parent / "docs" / "guides" / "environments.md").read_text(encoding="utf-8")
    (code,) = re.findall(r"```python\n(# my_tools\.py.*?)```", readme, re.S)
    path = tmp_path / "my_tools.py"
    path.write_text(code)
    component = load_plugins([path], external=False).registry.get("environment", "words")
    env = component.build(component.options(tools=[]))
    assert [t["function"]["name"] for t in env.tools] == ["word_count"]
    obs = env.step(env.reset({}), '<tool_call>{"name": "word_count", "arguments": {"text": "a b c"}}</tool_call>')
    assert obs.messages == [{"role": "tool", "content": "3"}]
