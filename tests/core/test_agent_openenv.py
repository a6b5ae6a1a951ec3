"""An OpenEnv environment (``openenv-core``), unchanged, run as an agent through the endpoint
(``grpo_plugins.agents.openenv``): each observation a user message, each answer an action, the
steps' rewards the episode's. The environment here is written as OpenEnv's docs write one (an
``Environment`` subclass with its ``Action`` and ``Observation``), on the real package.
The test command installs ``openenv-core`` with ``--no-deps`` (it depends on ``gradio`` for its
web UI only); what it imports, ``fastmcp``, ``tomli`` and ``tomli-w``, is in the ``test`` extra.
Skipped where ``openenv-core`` is not installed (the agents guide says how)."""

from __future__ import annotations

import pytest
from grpo_plugins.agents import openenv_agent

from grpo_core import Trainer

from .test_agents import ScriptedPlugin, _spec, long_model  # noqa: F401 - a fixture

pytest.importorskip("openenv.core.env_server", reason="openenv-core is not installed")
pytestmark = pytest.mark.usefixtures("one_thread")

from openenv.core.env_server import Action, Environment, Observation, State  # noqa: E402


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    feedback: str


class GuessEnvironment(Environment):
    """Guess the number 5 in two tries: a reward of 1 for a guess that names it."""

    def __init__(self):
        super().__init__()
        self._state = State(episode_id="guess", step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self._state = State(episode_id=episode_id or "guess", step_count=0)
        return GuessObservation(feedback="Guess my number (1-9).")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        right = "5" in action.guess
        done = right or self._state.step_count >= 2
        return GuessObservation(feedback="Right." if right else "No, try again.", done=done,
                                reward=1.0 if right else 0.0)

    @property
    def state(self) -> State:
        return self._state


def test_an_openenv_environment_runs_unchanged_as_an_agent(long_model, tmp_path):  # noqa: F811
    """The scripted policy answers 7 twice: two actions, each step's reward 0, the
    observations (the first one, then the feedback) as user messages, none failed."""
    plugin = ScriptedPlugin()
    plugin.backend.call = "7"
    spec = _spec(long_model, tmp_path / "o", name="scripted", group_size=2, agent={"max_total_tokens": 400})
    spec["rewards"] = [{"name": "env_reward"}]
    rollout = Trainer(spec, agent=openenv_agent(GuessEnvironment, GuessAction), plugins=[plugin])._build() \
        .actor.collect(0).scored.rollout
    assert not rollout.episodes.failed.any(), [m[-1] for m in rollout.episodes.messages]
    assert list(rollout.episodes.env_rewards) == [0.0] * 4
    assert rollout.episodes.turns.tolist() == [2] * 4
    first = rollout.episodes.messages[0]
    assert [m["role"] for m in first] == ["assistant", "user", "assistant"] and first[1]["content"] == \
        "No, try again."


def test_an_openenv_environment_trains_two_steps_on_the_real_policy(long_model, tmp_path):  # noqa: F811
    """The hf backend: two training steps, no failed episode, the rewards the environment's."""
    spec = _spec(long_model, tmp_path / "o", max_new_tokens=8, group_size=4, agent={"concurrency": 8})
    spec["train"].update(steps=2)
    spec["rewards"] = [{"name": "env_reward"}]
    result = Trainer(spec, agent=openenv_agent(GuessEnvironment, GuessAction)).train()
    assert result.status == "finished" and result.step == 2
    for row in result.history:
        assert row["env/failed_episodes"] == 0.0 and row["env/turns_per_episode"] >= 1.0, row
