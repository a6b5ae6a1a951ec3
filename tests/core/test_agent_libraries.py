"""Agent libraries as their users write them, unmodified, pointed at the episode's endpoint
(issue 48): the OpenAI Agents SDK with its default model (the Responses API) and with its
chat-completions model, run and streamed; LangChain's ``ChatOpenAI``, invoked and streamed;
pydantic-ai's ``Agent`` on its chat and Responses models, run and streamed. Skipped where a
library is not installed (each is in the ``test`` extra)."""

from __future__ import annotations

import pytest
import torch
from grpo_plugins.environments.calculator import calculator

from grpo_core import Trainer

from .test_agents import ScriptedPlugin, _spec, long_model  # noqa: F401 - a fixture

agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK (openai-agents) is not installed")
pytestmark = pytest.mark.usefixtures("one_thread")


def _sdk_agent(kind: str, finals: list, sampled=None):
    """The calculator task as an OpenAI Agents SDK user writes it: a function tool, an Agent,
    ``Runner.run`` (or ``run_streamed``), with the episode's client given to the run."""
    import openai
    from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider

    set_tracing_disabled(True)  # no trace upload to OpenAI from a test

    @function_tool(name_override="calculator")
    def calculator_tool(expression: str) -> str:
        """Evaluate an arithmetic expression and return its exact value.

        Args:
            expression: The arithmetic expression, e.g. "(12 + 7) * 31".
        """
        return calculator(expression)

    async def run(episode):
        extra = {"http_client": sampled.async_client()} if sampled is not None else {}
        client = openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, **extra)
        if kind.startswith("chat"):  # the chat-completions model, given explicitly
            agent = Agent(name="calc", instructions="Use the calculator.", tools=[calculator_tool],
                          model=OpenAIChatCompletionsModel(model=episode.model, openai_client=client))
            config = RunConfig()
        else:  # the default model: a model name, resolved by the run's provider to the Responses API
            agent = Agent(name="calc", instructions="Use the calculator.", tools=[calculator_tool], model=episode.model)
            config = RunConfig(model_provider=OpenAIProvider(openai_client=client, use_responses=True))
        prompt = episode.row["prompt"][-1]["content"]
        if kind.endswith("streamed"):
            result = Runner.run_streamed(agent, prompt, run_config=config, max_turns=3)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, prompt, run_config=config, max_turns=3)
        finals.append(result.final_output)
        await client.close()
        return None

    return run


@pytest.mark.parametrize("kind", ["responses", "responses streamed", "chat", "chat streamed"])
def test_the_openai_agents_sdk_runs_the_calculator_loop(long_model, tmp_path, kind):  # noqa: F811
    """The scripted policy calls the calculator, then answers: through the SDK's Runner every
    episode makes its tool call and finishes with the answer, none fails."""
    finals: list = []
    spec = _spec(long_model, tmp_path / "o", name="scripted", group_size=4, agent={"max_total_tokens": 400})
    rollout = Trainer(spec, agent=_sdk_agent(kind, finals), plugins=[ScriptedPlugin()])._build() \
        .actor.collect(0).scored.rollout
    assert not rollout.episodes.failed.any(), [m[-1] for m in rollout.episodes.messages]
    assert rollout.episodes.tool_calls.tolist() == [1] * 8 and rollout.episodes.turns.tolist() == [2] * 8
    assert finals == ["The answer is 5."] * 8


def test_the_agents_sdk_trains_two_steps_on_the_real_policy(long_model, tmp_path, caplog):  # noqa: F811
    """The hf backend, where every answer of the tiny model is cut at max_new_tokens: with the
    SDK's chat-completions model, streamed, two training steps and no failed episode (a cut
    answer is finish_reason length). With its default model, a cut answer is a response of
    status ``incomplete``, as OpenAI's own, on which the SDK raises: those episodes fail, with
    the SDK's reason (the agents guide says so)."""
    spec = _spec(long_model, tmp_path / "o", agent={"concurrency": 8, "max_total_tokens": 400}, max_new_tokens=8)
    spec["train"].update(steps=2)
    result = Trainer(spec, agent=_sdk_agent("chat streamed", [])).train()
    assert result.status == "finished" and result.step == 2
    for row in result.history:
        assert row["env/failed_episodes"] == 0.0 and row["env/turns_per_episode"] >= 1.0, row
    spec["train"].update(steps=1, output_dir=str(tmp_path / "responses"))
    rollout = Trainer(spec, agent=_sdk_agent("responses", []))._build().actor.collect(0).scored.rollout
    cut = [bool(t) for t in rollout.truncated]
    assert rollout.episodes.failed.tolist() == cut and any(cut)
    assert "status=incomplete" in next(m[-1]["content"] for m, f in zip(rollout.episodes.messages, cut) if f)


@pytest.mark.parametrize("kind", ["responses", "responses streamed"])
def test_the_agents_sdk_default_model_trains_two_steps_with_cut_answers_completed(long_model, tmp_path, kind):  # noqa: F811
    """rollout.agent.cut_response: completed, the SDK's default model (the Responses API), the
    real policy whose answers are all cut at 8 tokens: two training steps, no failed episode,
    each step training the token ids the endpoint answered."""
    from .test_agent_frameworks import Sampled, train_two_steps

    sampled = Sampled()
    agent = _sdk_agent(kind, [], sampled)
    train_two_steps(tmp_path, long_model, agent, sampled, cut_response="completed")


def _langchain_agent(streamed: bool, finals: list):
    """The calculator loop as a LangChain user writes it: ``ChatOpenAI`` with a bound tool,
    ``invoke`` (or ``stream``, the chunks added up), ``ToolMessage`` answers."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool("calculator")
    def calculator_tool(expression: str) -> str:
        """Evaluate an arithmetic expression and return its exact value."""
        return calculator(expression)

    def run(episode):
        llm = ChatOpenAI(model=episode.model, base_url=episode.base_url, api_key=episode.api_key, max_retries=0,
                         timeout=60).bind_tools([calculator_tool])
        messages = [HumanMessage(episode.row["prompt"][-1]["content"])]
        for _ in range(3):
            if streamed:
                reply = None
                for chunk in llm.stream(messages):
                    reply = chunk if reply is None else reply + chunk
            else:
                reply = llm.invoke(messages)
            messages.append(reply)
            if not reply.tool_calls:
                finals.append(reply.content)
                return None
            for call in reply.tool_calls:
                messages.append(ToolMessage(calculator_tool.invoke(call["args"]), tool_call_id=call["id"]))
        return None

    return run


def test_langchain_chat_openai_runs_the_calculator_loop_invoked_and_streamed(long_model, tmp_path):  # noqa: F811
    """LangChain's ChatOpenAI, unmodified: every episode makes its tool call and answers, none
    fails, and the streamed episodes record the tokens of the invoked ones."""
    pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    rollouts = []
    for streamed in (False, True):
        finals: list = []
        spec = _spec(long_model, tmp_path / str(streamed), name="scripted", group_size=4,
                     agent={"max_total_tokens": 400})
        rollout = Trainer(spec, agent=_langchain_agent(streamed, finals), plugins=[ScriptedPlugin()])._build() \
            .actor.collect(0).scored.rollout
        assert not rollout.episodes.failed.any(), [m[-1] for m in rollout.episodes.messages]
        assert rollout.episodes.tool_calls.tolist() == [1] * 8 and rollout.episodes.turns.tolist() == [2] * 8
        assert finals == ["The answer is 5."] * 8
        rollouts.append(rollout)
    for field in ("prompt_ids", "completion_ids", "completion_mask"):
        assert torch.equal(getattr(rollouts[0], field), getattr(rollouts[1], field)), field


def _pydantic_ai_agent(kind: str, finals: list):
    """The calculator task as a pydantic-ai user writes it: an ``Agent`` with a plain tool on
    an OpenAI model given the episode's URL and key; ``run`` or ``run_stream``."""
    from pydantic_ai import Agent, Tool
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    def evaluate(expression: str) -> str:
        """Evaluate an arithmetic expression and return its exact value.

        Args:
            expression: The arithmetic expression.
        """
        return calculator(expression)

    async def run(episode):
        provider = OpenAIProvider(base_url=episode.base_url, api_key=episode.api_key)
        model = (OpenAIResponsesModel if kind.startswith("responses") else OpenAIChatModel)(episode.model,
                                                                                            provider=provider)
        agent = Agent(model, tools=[Tool(evaluate, name="calculator")], retries=0)
        prompt = episode.row["prompt"][-1]["content"]
        if kind.endswith("streamed"):
            async with agent.run_stream(prompt) as result:
                finals.append(await result.get_output())
        else:
            finals.append((await agent.run(prompt)).output)
        return None

    return run


@pytest.mark.parametrize("kind", ["chat", "chat streamed", "responses", "responses streamed"])
def test_pydantic_ai_runs_the_calculator_loop(long_model, tmp_path, kind):  # noqa: F811
    pytest.importorskip("pydantic_ai", reason="pydantic-ai is not installed")
    finals: list = []
    spec = _spec(long_model, tmp_path / "o", name="scripted", group_size=4, agent={"max_total_tokens": 400})
    rollout = Trainer(spec, agent=_pydantic_ai_agent(kind, finals), plugins=[ScriptedPlugin()])._build() \
        .actor.collect(0).scored.rollout
    assert not rollout.episodes.failed.any(), [m[-1] for m in rollout.episodes.messages]
    assert rollout.episodes.tool_calls.tolist() == [1] * 8 and rollout.episodes.turns.tolist() == [2] * 8
    assert finals == ["The answer is 5."] * 8


def test_the_agent_sdk_spec_runs_its_loop_on_a_tiny_model(long_model, tmp_path):  # noqa: F811
    """specs/agent_sdk.yaml as shipped (its agent the OpenAI Agents SDK on its default model),
    on the tiny model for a step, evaluation included: no failed episode, the cut answers
    completed responses."""
    from pathlib import Path

    from grpo_core.cli import main

    from .conftest import read_metrics

    specs = Path(__file__).resolve().parents[2] / "specs"
    out = tmp_path / "agent"
    code = main([str(specs / "agent_sdk.yaml"),
                 "--set", "model.package=null", "--set", "model.gguf_file=null", "--set", f"model.path={long_model}",
                 "--set", "train.steps=1", "--set", "data.train_size=8", "--set", "eval.max_prompts=2",
                 "--set", "rollout.group_size=2", "--set", "rollout.max_new_tokens=4",
                 "--set", "rollout.agent.max_total_tokens=24", "--set", "train.progress=false",
                 "--set", "tracking=[]", "--set", f"train.output_dir={out}"])
    assert code == 0
    rows = read_metrics(out / "metrics.jsonl")
    step = next(r for r in rows if "env/turns_per_episode" in r)
    assert step["env/failed_episodes"] == 0.0 and step["env/model_tokens"] > 0
    assert [r["eval/env/failed_episodes"] for r in rows if "eval/env/failed_episodes" in r] == [0.0, 0.0]
