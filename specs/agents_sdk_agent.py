"""The agent of specs/agent_sdk.yaml: the calculator task written with the OpenAI Agents SDK
(``pip install openai-agents``) on its default model, the Responses API.

Nothing in it knows about grpo-core but the last lines, which register it: a function tool, an
``Agent`` named by a model name, and ``Runner.run``, given the episode's client through the
run's provider (a process-wide ``set_default_openai_client`` cannot carry one key per episode).
A run that would go past three model turns ends there (the SDK raises ``MaxTurnsExceeded``):
the episode is scored as it stands. It returns None: the spec's reward functions score the
episode's messages.
"""

import openai
from agents import Agent, MaxTurnsExceeded, RunConfig, Runner, function_tool, set_tracing_disabled
from agents.models.openai_provider import OpenAIProvider
from grpo_plugins.environments.calculator import calculator

from grpo_core import hookimpl

set_tracing_disabled(True)  # no trace upload to OpenAI's servers


@function_tool(name_override="calculator")
def calculator_tool(expression: str) -> str:
    """Evaluate an arithmetic expression and return its exact value.

    Args:
        expression: The arithmetic expression.
    """
    return calculator(expression)


async def agents_sdk_agent(episode):
    client = openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0)
    agent = Agent(name="calculator", tools=[calculator_tool], model=episode.model)  # the default model
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client, use_responses=True))
    try:
        await Runner.run(agent, episode.row["prompt"][-1]["content"], run_config=config, max_turns=3)
    except MaxTurnsExceeded:
        pass
    finally:
        await client.close()
    return None


@hookimpl
def register_agents(register):
    register.add("agents-sdk-calculator", agents_sdk_agent)
