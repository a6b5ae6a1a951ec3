"""A ``verifiers`` environment, unchanged, run as an agent through the endpoint
(``grpo_plugins.agents.verifiers``): its rollout protocol talks to the policy with an
``AsyncOpenAI`` client on the episode's key, its rubric's reward is the episode's, and its
dataset is the run's rows. The environments here are written as verifiers' docs write them (a
module with ``load_environment``, found by id), a ``ToolEnv`` and a ``MultiTurnEnv``, on the
real package (0.1.10, in the ``test`` extra). Skipped where verifiers is not installed."""

from __future__ import annotations

import textwrap

import pytest
from grpo_plugins.agents import verifiers_agent
from grpo_plugins.agents.verifiers import load_environment

from grpo_core import Trainer
from grpo_core.errors import UsageError

from .test_agent_frameworks import Sampled
from .test_agents import ScriptedPlugin, _spec, long_model  # noqa: F401 - a fixture

vf = pytest.importorskip("verifiers", reason="verifiers is not installed")
pytestmark = pytest.mark.usefixtures("one_thread")

# Each module is an environment package as `prime env init` lays one out: load_environment(**args).
CALC_ENV = '''
import datasets
import verifiers as vf
from grpo_plugins.environments.calculator import calculator


def load_environment(rows: int = 2) -> vf.Environment:
    dataset = datasets.Dataset.from_list([{"question": "What is 2+3?", "answer": "5"}] * rows)
    eval_dataset = datasets.Dataset.from_list([{"question": "What is 1+4?", "answer": "5"}])

    def correct(completion, answer) -> float:
        return 1.0 if answer in (completion[-1]["content"] or "") else 0.0

    rubric = vf.Rubric(funcs=[correct])
    return vf.ToolEnv(tools=[calculator], dataset=dataset, eval_dataset=eval_dataset, rubric=rubric, max_turns=3,
                      system_prompt="Use the calculator.")
'''

GUESS_ENV = '''
import datasets
import verifiers as vf


class GuessEnv(vf.MultiTurnEnv):
    """Guess the number 5 in two tries: 'No, try again.' after a wrong guess."""

    async def env_response(self, messages, state, **kwargs):
        if "5" in (messages[-1]["content"] or ""):
            state["final_env_response"] = [{"role": "user", "content": "Right."}]
            return state["final_env_response"]
        return [{"role": "user", "content": "No, try again."}]


def load_environment() -> vf.Environment:
    dataset = datasets.Dataset.from_list([{"question": "Guess my number (1-9).", "answer": "5"},
                                          {"question": "Guess a digit.", "answer": "5"}])

    def guessed(completion, answer) -> float:
        return float(any(answer in (m["content"] or "") for m in completion if m["role"] == "assistant"))

    return GuessEnv(dataset=dataset, rubric=vf.Rubric(funcs=[guessed]), max_turns=2)
'''

BROKEN_ENV = """
import datasets
import verifiers as vf


class BrokenEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        raise vf.InfraError("the sandbox is gone")


def load_environment() -> vf.Environment:
    def anything(completion) -> float:
        return 1.0

    return BrokenEnv(dataset=datasets.Dataset.from_list([{"question": "Go.", "answer": "5"}]),
                     rubric=vf.Rubric(funcs=[anything]), max_turns=3)
"""


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    """The two environment modules, importable by id for this module's tests."""
    import sys

    folder = tmp_path_factory.mktemp("vf_envs")
    (folder / "vf_calc_env.py").write_text(textwrap.dedent(CALC_ENV))
    (folder / "vf_guess_env.py").write_text(textwrap.dedent(GUESS_ENV))
    (folder / "vf_broken_env.py").write_text(textwrap.dedent(BROKEN_ENV))
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))


def _by_id(model, out, env_id, **rollout):
    """A spec naming the environment by id twice, as a YAML spec does: its rows, its agent."""
    spec = _spec(model, out, group_size=4, agent={"name": "verifiers", "environment": env_id,
                                                  "max_total_tokens": 600, "concurrency": 8}, **rollout)
    spec["data"] = {"name": "verifiers", "environment": env_id}
    spec["rewards"] = [{"name": "env_reward"}]
    return spec


def test_a_verifiers_tool_env_by_id_runs_its_tool_loop(envs, long_model, tmp_path):  # noqa: F811
    """The scripted policy calls the calculator, then answers 5: each episode one tool call and
    two model turns, the tool's result shown as verifiers' ToolEnv shows it, the rubric's reward
    (1: the answer names 5), and the prompt the environment's own (its system prompt)."""
    spec = _by_id(long_model, tmp_path / "o", "vf-calc-env", name="scripted")
    rollout = Trainer(spec, plugins=[ScriptedPlugin()])._build().actor.collect(0).scored.rollout
    episodes = rollout.episodes
    assert not episodes.failed.any(), [m[-1] for m in episodes.messages]
    assert episodes.tool_calls.tolist() == [1] * 8 and episodes.turns.tolist() == [2] * 8
    assert list(episodes.env_rewards) == [1.0] * 8
    first = episodes.messages[0]
    assert [m["role"] for m in first] == ["assistant", "tool", "assistant"]
    assert first[1]["content"] == "5" and first[2]["content"] == "The answer is 5."


def test_the_verifiers_dataset_is_the_environments_rows_with_its_eval_rows(envs):
    from grpo_plugins.agents.verifiers import VerifiersDataset, VerifiersDatasetOptions

    calc = VerifiersDataset(VerifiersDatasetOptions(environment="vf-calc-env", env_args={"rows": 3}))
    train, held_out = calc.load("train"), calc.load("eval")
    assert len(train) == 3 and len(held_out) == 1
    assert train[0]["prompt"] == [{"role": "system", "content": "Use the calculator."},
                                  {"role": "user", "content": "What is 2+3?"}]
    assert train[0]["answer"] == "5" and held_out[0]["prompt"][-1]["content"] == "What is 1+4?"
    # no eval rows of its own: none held out, not its training rows again
    guess = VerifiersDataset(VerifiersDatasetOptions(environment="vf-guess-env"))
    assert len(guess.load("train")) == 2 and guess.load("eval") == []
    # one environment per id and arguments, shared by the agent and the dataset
    assert load_environment("vf-calc-env", {"rows": 3}) is load_environment("vf-calc-env", {"rows": 3})


def test_a_verifiers_multi_turn_env_trains_two_steps_on_the_real_policy(envs, long_model, tmp_path):  # noqa: F811
    """The hf backend, the environment object given in Python: two steps, no failed episode,
    each step trained exactly the token ids the endpoint answered (read off the client's wire)."""
    sampled = Sampled()
    env = vf.load_environment("vf-guess-env")
    spec = _spec(long_model, tmp_path / "t", max_new_tokens=8, group_size=4,
                 agent={"concurrency": 8, "max_total_tokens": 400})
    spec["train"].update(steps=2)
    spec["rewards"] = [{"name": "sampled"}]
    result = Trainer(spec, agent=verifiers_agent(env, http_client=sampled.async_client), reward_funcs={
        "sampled": sampled}, train_dataset=env.get_dataset()).train()
    assert result.status == "finished" and result.step == 2
    for row in result.history:
        assert row["env/failed_episodes"] == 0.0 and row["env/turns_per_episode"] >= 1.0, row
    sampled.check(2)


def test_a_verifiers_rollout_that_ends_on_an_error_fails_its_episode(envs, long_model, tmp_path, caplog):  # noqa: F811
    """An environment whose step raises verifiers' ``InfraError`` ends its rollout with an
    error (verifiers records it and scores the rollout 0): the episode fails, naming the error,
    instead of training a reward of 0 it did not earn."""
    spec = _by_id(long_model, tmp_path / "e", "vf-broken-env", name="scripted")
    with caplog.at_level("WARNING", logger="grpo.agents"):
        rollout = Trainer(spec, plugins=[ScriptedPlugin()])._build().actor.collect(0).scored.rollout
    assert rollout.episodes.failed.all() and set(rollout.episodes.turns.tolist()) == {1}
    assert "the verifiers rollout ended on an error: InfraError('the sandbox is gone')" in caplog.text, caplog.text


def test_an_unknown_verifiers_environment_is_named_with_what_an_id_is(envs, long_model, tmp_path):  # noqa: F811
    with pytest.raises(UsageError, match=r"'no-such-env'.*module 'no_such_env' has load_environment"):
        load_environment("no-such-env")
    with pytest.raises(UsageError, match="env_args go with an environment id"):
        load_environment(object(), {"rows": 1})
