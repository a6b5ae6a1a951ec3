"""Agent frameworks as their users write them, unmodified, pointed at the episode's endpoint
(issue 48): LangGraph's prebuilt ReAct agent over LangChain's ``ChatOpenAI``, and smolagents'
``ToolCallingAgent`` over its ``OpenAIServerModel``. Each runs its tool loop on the scripted
policy with no failed episode, and drives two training steps on the real policy with no failed
episode, every step training exactly the token ids the endpoint answered (read off the wire).
Skipped where a framework is not installed (each is in the ``test`` extra)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from grpo_plugins.environments import calculator as calculator_module
from grpo_plugins.environments.calculator import calculator

from grpo_core import Trainer

from .test_agents import CALL, Scripted, ScriptedPlugin, _spec, long_model  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def _answered_ids(response: httpx.Response) -> list[int]:
    """The token ids an endpoint answer carries: each chat choice's ``token_ids``, a
    response object's, or, streamed, the ids of its chunks (the last event's response for
    the Responses API)."""
    if response.status_code != 200:
        return []
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        ids: list[int] = []
        for line in response.text.splitlines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "response" in event and event.get("type") in ("response.completed", "response.incomplete"):
                ids = list(event["response"]["token_ids"])
            for choice in event.get("choices") or []:
                ids += choice.get("token_ids") or []
        return ids
    body = response.json()
    if body.get("object") == "response":
        return list(body["token_ids"])
    return [i for choice in body.get("choices") or [] for i in choice.get("token_ids") or []]


class Sampled:
    """What the policy sampled, episode by episode, as the endpoint answered it: give each
    episode's client :meth:`client` (an ``httpx`` client that reads every answer's
    ``token_ids``). Used as a reward function, it checks that the step trains exactly those
    ids (its ``completion_ids`` are the trained tokens), and scores by length so that the
    step has advantages."""

    __name__ = "sampled"

    def __init__(self):
        self.lock = threading.Lock()
        self.episodes: list[list[int]] = []
        self.steps: list[tuple[list, list]] = []  # per scored step: (trained, sampled), each sorted

    def _new(self) -> list[int]:
        ids: list[int] = []
        with self.lock:
            self.episodes.append(ids)
        return ids

    def client(self) -> httpx.Client:
        ids = self._new()

        def read(response: httpx.Response) -> None:
            response.read()
            ids.extend(_answered_ids(response))

        return httpx.Client(event_hooks={"response": [read]}, timeout=60)

    def async_client(self) -> httpx.AsyncClient:
        ids = self._new()

        async def read(response: httpx.Response) -> None:
            await response.aread()
            ids.extend(_answered_ids(response))

        return httpx.AsyncClient(event_hooks={"response": [read]}, timeout=60)

    def __call__(self, prompts, completions, completion_ids, **_):
        with self.lock:
            sampled, self.episodes = self.episodes, []
        self.steps.append((sorted(completion_ids), sorted(sampled)))
        return [float(len(ids) % 5) for ids in completion_ids]

    def check(self, steps: int) -> None:
        assert len(self.steps) == steps, len(self.steps)
        for trained, sampled in self.steps:
            assert trained == sampled and all(trained), (trained, sampled)


def train_two_steps(tmp_path, model, agent, sampled: Sampled, **agent_options):
    """Two training steps on the real policy (the hf backend, answers cut at 8 tokens):
    finished, no failed episode, each step trained what the endpoint answered."""
    spec = _spec(model, tmp_path / "train", max_new_tokens=8, group_size=4,
                 agent={"concurrency": 8, "max_total_tokens": 400, **agent_options})
    spec["train"].update(steps=2)
    spec["rewards"] = [{"name": "sampled"}]
    result = Trainer(spec, agent=agent, reward_funcs={"sampled": sampled}).train()
    assert result.status == "finished" and result.step == 2
    for row in result.history:
        assert row["env/failed_episodes"] == 0.0 and row["env/turns_per_episode"] >= 1.0, row
    sampled.check(2)
    return result


def _scripted_rollout(model, out, agent, plugin=None, **slot):
    spec = _spec(model, out, name="scripted", group_size=4, agent={"max_total_tokens": 2000, **slot})
    return Trainer(spec, agent=agent, plugins=[plugin or ScriptedPlugin()])._build().actor.collect(0).scored.rollout


# ----------------------------------------------------------------- LangGraph


def _langgraph_agent(finals: list, sampled: Sampled | None = None):
    """The calculator task as a LangGraph user writes it: the prebuilt ReAct agent over
    ``ChatOpenAI`` with a LangChain tool, invoked with the row's question."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool("calculator")
    def calculator_tool(expression: str) -> str:
        """Evaluate an arithmetic expression and return its exact value."""
        return calculator(expression)

    def run(episode):
        extra = {"http_client": sampled.client()} if sampled is not None else {}
        llm = ChatOpenAI(model=episode.model, base_url=episode.base_url, api_key=episode.api_key, max_retries=0,
                         timeout=60, **extra)
        graph = create_react_agent(llm, [calculator_tool])
        state = graph.invoke({"messages": [("user", episode.row["prompt"][-1]["content"])]},
                             {"recursion_limit": 8})
        finals.append(state["messages"][-1].content)
        return None

    return run


def test_a_langgraph_react_agent_runs_the_calculator_loop(long_model, tmp_path):  # noqa: F811
    """LangGraph's prebuilt ReAct agent, unmodified: every episode calls the calculator, gets
    its result as a ToolMessage, answers; none fails."""
    pytest.importorskip("langgraph.prebuilt", reason="langgraph is not installed")
    finals: list = []
    rollout = _scripted_rollout(long_model, tmp_path / "o", _langgraph_agent(finals))
    assert not rollout.episodes.failed.any(), [m[-1] for m in rollout.episodes.messages]
    assert rollout.episodes.tool_calls.tolist() == [1] * 8 and rollout.episodes.turns.tolist() == [2] * 8
    assert finals == ["The answer is 5."] * 8


def test_a_langgraph_react_agent_trains_two_steps_on_the_real_policy(long_model, tmp_path):  # noqa: F811
    pytest.importorskip("langgraph.prebuilt", reason="langgraph is not installed")
    sampled = Sampled()
    train_two_steps(tmp_path, long_model, _langgraph_agent([], sampled), sampled)


# ----------------------------------------------------------------- smolagents

FINAL = '<tool_call>{"name": "final_answer", "arguments": {"answer": "5"}}</tool_call>'


class FinalAnswerPlugin(ScriptedPlugin):
    """The scripted policy answering at once with smolagents' ``final_answer`` tool call."""

    def __init__(self):
        super().__init__()
        self.backend.call = FINAL


def _calculator_tool():
    from smolagents import tool

    @tool
    def calculator(expression: str) -> str:  # smolagents names a tool after its function
        """Evaluate an arithmetic expression and return its exact value.

        Args:
            expression: The arithmetic expression, e.g. "(12 + 7) * 31".
        """
        return calculator_module.calculator(expression)

    return calculator


def _smolagents_agent(finals: list):
    """The calculator task as a smolagents user writes it: a ``@tool``, ``OpenAIServerModel``
    given the episode's URL and key, a ``ToolCallingAgent``, ``run``."""
    from smolagents import OpenAIServerModel, ToolCallingAgent

    def run(episode):
        model = OpenAIServerModel(model_id=episode.model, api_base=episode.base_url, api_key=episode.api_key,
                                  client_kwargs={"max_retries": 0, "timeout": 60})
        agent = ToolCallingAgent(tools=[_calculator_tool()], model=model, max_steps=3, verbosity_level=0)
        finals.append(agent.run(episode.row["prompt"][-1]["content"]))
        return None

    return run


def test_a_smolagents_tool_calling_agent_runs_on_the_endpoint(long_model, tmp_path):  # noqa: F811
    """smolagents' ToolCallingAgent, unmodified, its answer a ``final_answer`` tool call:
    every episode ends with the answer, none fails."""
    pytest.importorskip("smolagents", reason="smolagents is not installed")
    finals: list = []
    rollout = _scripted_rollout(long_model, tmp_path / "o", _smolagents_agent(finals), FinalAnswerPlugin())
    assert not rollout.episodes.failed.any(), [m[-1] for m in rollout.episodes.messages]
    assert rollout.episodes.tool_calls.tolist() == [1] * 8 and rollout.episodes.turns.tolist() == [1] * 8
    assert finals == ["5"] * 8


def test_a_smolagents_agent_that_rewrites_its_history_trains_as_split_samples(long_model, tmp_path):  # noqa: F811
    """After a tool call, smolagents sends the policy's answer back rewritten as text
    (``Calling tools: [...]``) and the tool's result as an ``Observation`` user message, so its
    next request does not extend the episode. With ``rollout.agent.history: split`` (the
    default) each such request starts a new training sample of the episode, and every episode
    runs to its end; with ``refuse`` the request is a 400 and the episode fails, saying so."""
    pytest.importorskip("smolagents", reason="smolagents is not installed")
    rollout = _scripted_rollout(long_model, tmp_path / "split", _smolagents_agent([]))
    assert not rollout.episodes.failed.any(), [m[-1] for m in rollout.episodes.messages]
    assert (rollout.episodes.samples > 1).all(), rollout.episodes.samples
    refused = _scripted_rollout(long_model, tmp_path / "refuse", _smolagents_agent([]), history="refuse")
    assert refused.episodes.failed.all()
    assert all("differs from the episode's history" in m[-1]["content"] for m in refused.episodes.messages)


def test_smolagents_openai_server_model_trains_two_steps_on_the_real_policy(long_model, tmp_path):  # noqa: F811
    """``OpenAIServerModel.generate``, as smolagents' agents call it (its stop sequences
    included), once per episode: two training steps, no failed episode, the sampled tokens
    trained."""
    pytest.importorskip("smolagents", reason="smolagents is not installed")
    from smolagents import ChatMessage, MessageRole, OpenAIServerModel

    sampled = Sampled()

    def run(episode):
        model = OpenAIServerModel(model_id=episode.model, api_base=episode.base_url, api_key=episode.api_key,
                                  client_kwargs={"max_retries": 0, "http_client": sampled.client()})
        question = [{"type": "text", "text": episode.row["prompt"][-1]["content"]}]
        model.generate([ChatMessage(role=MessageRole.USER, content=question)],
                       stop_sequences=["Observation:", "Calling tools:"])
        return None

    train_two_steps(tmp_path, long_model, run, sampled)
