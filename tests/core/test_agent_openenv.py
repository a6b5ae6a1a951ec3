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

from fastmcp import FastMCP  # noqa: E402
from openenv.core.env_server import Action, Environment, Observation, State  # noqa: E402
from openenv.core.env_server.mcp_environment import MCPEnvironment  # noqa: E402


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    feedback: str


class GuessEnvironment(Environment):
    """Guess the number 5 in two tries: a reward of 1 for a guess that names it."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session its own instance, nothing shared

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


# ----------------------------------------------------------------- a server, by URL


@pytest.fixture
def guess_server():
    """The environment behind OpenEnv's own server (``create_app``, served by uvicorn on
    127.0.0.1), as a Space or a container serves one; yields its URL."""
    import socket
    import threading
    import time

    import uvicorn
    from openenv.core.env_server import create_app

    app = create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=16)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "the OpenEnv server did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def _guessing(environment, guess: str, model, tmp_path):
    """One rollout of the scripted policy, always guessing ``guess``, against ``environment`` (a
    server's URL, or a function making a client of it)."""
    plugin = ScriptedPlugin()
    plugin.backend.call = guess
    spec = _spec(model, tmp_path / "o", name="scripted", group_size=2, agent={"max_total_tokens": 400})
    spec["rewards"] = [{"name": "env_reward"}]
    return Trainer(spec, agent=openenv_agent(environment, "guess"), plugins=[plugin])._build() \
        .actor.collect(0).scored.rollout


def test_an_openenv_server_by_url_runs_its_episodes(guess_server, long_model, tmp_path):  # noqa: F811
    """A running server given by URL: each episode its own session of OpenEnv's asynchronous
    GenericEnvClient (dict actions and observations, nothing of the environment's package),
    the same episodes as the in-process environment gives."""
    rollout = _guessing(guess_server, "7", long_model, tmp_path)
    assert not rollout.episodes.failed.any(), [m[-1] for m in rollout.episodes.messages]
    assert list(rollout.episodes.env_rewards) == [0.0] * 4 and rollout.episodes.turns.tolist() == [2] * 4
    assert [m["content"] for m in rollout.episodes.messages[0]] == ["7", "No, try again.", "7"]


def test_a_server_guessed_right_ends_the_episode_with_its_reward(guess_server, long_model, tmp_path):  # noqa: F811
    rollout = _guessing(guess_server, "5", long_model, tmp_path)
    assert list(rollout.episodes.env_rewards) == [1.0] * 4 and rollout.episodes.turns.tolist() == [1] * 4


def test_a_synchronous_client_of_a_server_runs_its_episodes(guess_server, long_model, tmp_path):  # noqa: F811
    """OpenEnv's synchronous wrapper (``EnvClient.sync()``), made per episode: its blocking
    calls step in a worker thread; the episodes are the URL form's."""
    from openenv.core import GenericEnvClient

    rollout = _guessing(lambda: GenericEnvClient(base_url=guess_server).sync(), "7", long_model, tmp_path)
    assert not rollout.episodes.failed.any(), [m[-1] for m in rollout.episodes.messages]
    assert list(rollout.episodes.env_rewards) == [0.0] * 4 and rollout.episodes.turns.tolist() == [2] * 4
    assert [m["content"] for m in rollout.episodes.messages[0]] == ["7", "No, try again.", "7"]


def test_a_name_that_is_not_a_url_is_refused_naming_what_to_pass():
    with pytest.raises(ValueError, match=r"'coding-env' is not a server URL.*AutoEnv.from_env"):
        openenv_agent("coding-env", "code")


# ----------------------------------------------------------------- tool (MCP) environments


class CalculatorEnvironment(MCPEnvironment):
    """A tool environment as OpenEnv's docs write one: a FastMCP server's tools; the
    ``calculator`` tool's result for 2+3 is rewarded 1 (through the observation's reward)."""

    def __init__(self):
        mcp = FastMCP("calculator")

        @mcp.tool()
        def calculator(expression: str) -> str:
            """Evaluate an arithmetic expression and return its exact value."""
            return str(eval(expression, {"__builtins__": {}}))  # the test's own expressions only

        super().__init__(mcp)
        self._state = State(episode_id="calc", step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
        return Observation()

    def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
        return Observation(metadata={"error": f"unknown action {type(action).__name__}"})

    @property
    def state(self) -> State:
        return self._state


def test_an_openenv_tool_environment_is_played_with_tool_calls(long_model, tmp_path):  # noqa: F811
    """action=None: the MCP tools offered in each request, the scripted policy's calculator
    call a CallToolAction whose text result is the tool message, its final answer the end."""
    plugin = ScriptedPlugin()
    spec = _spec(long_model, tmp_path / "o", name="scripted", group_size=2, agent={"max_total_tokens": 2000})
    rollout = Trainer(spec, agent=openenv_agent(CalculatorEnvironment), plugins=[plugin])._build() \
        .actor.collect(0).scored.rollout
    episodes = rollout.episodes
    assert not episodes.failed.any(), [m[-1] for m in episodes.messages]
    assert episodes.tool_calls.tolist() == [1] * 4 and episodes.turns.tolist() == [2] * 4
    first = episodes.messages[0]
    assert [m["role"] for m in first] == ["assistant", "tool", "assistant"]
    assert first[1]["content"] == "5" and first[2]["content"] == "The answer is 5."


def test_an_openenv_tool_environment_trains_two_steps_on_the_real_policy(long_model, tmp_path):  # noqa: F811
    spec = _spec(long_model, tmp_path / "o", max_new_tokens=8, group_size=4,
                 agent={"concurrency": 8, "max_total_tokens": 2000})
    spec["train"].update(steps=2)
    spec["rewards"] = [{"name": "spread"}]

    def spread(completions, **_):  # any reward with a spread in each group, for advantages
        return [float(len(str(c)) % 5) for c in completions]

    result = Trainer(spec, agent=openenv_agent(CalculatorEnvironment), reward_funcs={"spread": spread}).train()
    assert result.status == "finished" and result.step == 2
    for row in result.history:
        assert row["env/failed_episodes"] == 0.0 and row["env/turns_per_episode"] >= 1.0, row
