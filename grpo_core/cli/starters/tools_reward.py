"""Reward for tool calls: 1.0 for a <tool_call> naming the expected tool with the expected
arguments, 0.5 for the right tool with other arguments, 0.0 otherwise."""

import json
import re

from grpo_core import hookimpl
from grpo_core.contracts import completion_text

CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def tool_call(prompts, completions, expected_call, **columns):
    scores = []
    for completion, expected in zip(completions, expected_call):
        match = CALL.search(completion_text(completion))
        try:
            call = json.loads(match.group(1)) if match else None
        except ValueError:
            call = None
        if not isinstance(call, dict) or call.get("name") != expected["name"]:
            scores.append(0.0)
        else:
            scores.append(1.0 if call.get("arguments") == expected["arguments"] else 0.5)
    return scores


@hookimpl
def register_reward_functions(register):
    register.add("tool_call", tool_call)
