"""The agent of specs/agent.yaml: an ordinary OpenAI-client tool loop with a calculator.

Nothing in it knows about grpo-core but the last five lines, which register it: the episode's
``base_url`` and ``api_key`` go to the official ``openai`` client (``pip install openai``),
the row's prompt starts the conversation, and each tool call the policy makes is answered
with the calculator's result, up to three model turns. It returns None: the spec's reward
functions score the episode's messages.
"""

import json

import openai
from grpo_plugins.environments.calculator import calculator

from grpo_core import hookimpl

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression and return its exact value.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "The arithmetic expression."}},
            "required": ["expression"],
        },
    },
}]


async def calculator_agent(episode):
    async with openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0) as client:
        messages = list(episode.row["prompt"])
        for _ in range(3):
            reply = await client.chat.completions.create(model=episode.model, messages=messages, tools=TOOLS)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                try:
                    result = calculator(**json.loads(call.function.arguments))
                except Exception as exc:  # a malformed call is the model's mistake: tell it
                    result = f"error: {exc}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


@hookimpl
def register_agents(register):
    register.add("calculator-agent", calculator_agent)
