"""``/v1/responses`` for agents (issue 48, item 3), with the official ``openai`` client's
``client.responses.create`` (sync and stream) and ``client.responses.stream``: the calculator
tool loop written against the Responses API records the tokens the same loop records through
chat completions; what is not served is a 400 naming it."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from grpo_plugins.environments.calculator import calculator

from grpo_core import Trainer

from .test_agent_containment import _post
from .test_agents import TOOLS, ScriptedPlugin, _spec, calculator_agent, long_model  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")

#: The calculator as a Responses API function tool (flat: type, name, description, parameters).
RESPONSE_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]


def _output(client, mode: str, messages: list) -> tuple[list, object]:
    """One model turn of the Responses API: its output items as input items, and the response."""
    if mode == "create":
        response = client.responses.create(model="policy", input=messages, tools=RESPONSE_TOOLS)
    elif mode == "events":  # stream=True: the raw events, the last one holds the response
        events = list(client.responses.create(model="policy", input=messages, tools=RESPONSE_TOOLS, stream=True))
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        response = events[-1].response
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == response.output_text
    else:  # the client's stream helper, which checks the events' consistency as it assembles them
        with client.responses.stream(model="policy", input=messages, tools=RESPONSE_TOOLS) as stream:
            for _ in stream:
                pass
            response = stream.get_final_response()
    return [item.model_dump(exclude_none=True) for item in response.output], response


def _responses_agent(mode: str, seen: list):
    def agent(episode):
        with openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, timeout=60) as client:
            items = list(episode.row["prompt"])
            for _ in range(3):
                output, response = _output(client, mode, items)
                seen.append(response)
                items += output
                calls = [item for item in output if item["type"] == "function_call"]
                if not calls:
                    return None
                for call in calls:
                    items.append({"type": "function_call_output", "call_id": call["call_id"],
                                  "output": calculator(**json.loads(call["arguments"]))})
        return None

    return agent


def _build_the_sdks_event_table() -> None:
    """The openai SDK parses a stream event by its ``type``, through a table it builds from the
    event classes on first use and then caches. Built from several threads at once (the eight
    episodes below), it was cached incomplete on a loaded machine (the classes' pydantic schemas
    still being built), and every later ``response.completed`` parsed as another event class. That
    is the SDK's race, not the endpoint's: build the table once, in this thread, first."""
    from openai._models import construct_type
    from openai.types.responses import ResponseStreamEvent

    event = construct_type(type_=ResponseStreamEvent, value={"type": "response.completed", "sequence_number": 0,
                                                              "response": {"id": "r", "output": []}})
    assert type(event).__name__ == "ResponseCompletedEvent"


@pytest.mark.parametrize("mode", ["create", "events", "helper"])
def test_a_responses_agent_records_what_a_chat_agent_records(long_model, tmp_path, mode):  # noqa: F811
    _build_the_sdks_event_table()
    seen: list = []
    rollouts = []
    for name, agent in (("chat", calculator_agent), ("responses", _responses_agent(mode, seen))):
        spec = _spec(long_model, tmp_path / name, name="scripted", agent={"max_total_tokens": 240, "concurrency": 8})
        rollouts.append(Trainer(spec, agent=agent, plugins=[ScriptedPlugin()])._build().actor.collect(0).scored.rollout)
    chat, responses = rollouts
    for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(chat, field), getattr(responses, field)), field
    assert not responses.episodes.failed.any(), [m[-1] for m in responses.episodes.messages]
    assert responses.episodes.turns.tolist() == [2] * 8 and responses.episodes.tool_calls.tolist() == [1] * 8
    assert len(seen) == 16 and all(r.status == "completed" and r.usage.output_tokens > 0 for r in seen)
    assert sorted(r.output_text for r in seen) == [""] * 8 + ["The answer is 5."] * 8


def test_instructions_max_output_tokens_and_what_is_not_served(long_model, tmp_path):  # noqa: F811
    """instructions are the system message, max_output_tokens cuts the answer (status
    incomplete); stored state, built-in tools and non-text inputs are 400s naming them, and
    the episode goes on."""
    answers, cut = [], []
    refused = {
        "previous_response_id": ({"previous_response_id": "resp_1"}, "previous_response_id: stored responses are "
                                 "not served; send the whole conversation as input items"),
        "conversation": ({"conversation": "conv_1"}, "conversation: stored conversations are not served"),
        "background": ({"background": True}, "background: background responses are not served"),
        "web_search": ({"tools": [{"type": "web_search"}]}, "tools[0]: the built-in tool 'web_search' is not "
                       "served; function tools only"),
        "an image": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                     "input[0].content[0]: 'input_image' content is not served; text parts only"),
        "item_reference": ({"input": [{"type": "item_reference", "id": "msg_1"}]},
                           "input[0]: item_reference items name stored items, which are not served"),
        "an unknown item": ({"input": [{"type": "computer_call_output"}]},
                            "input[0].type: 'computer_call_output' items are not served"),
        "max_output_tokens 0": ({"max_output_tokens": 0}, "max_output_tokens: 0; a positive integer"),
        "temperature": ({"temperature": 0.2}, "temperature: 0.2; this run samples at the spec's rollout.temperature"),
    }

    def agent(episode):
        for name, (fields, _) in refused.items():
            body = {"model": "policy", "input": "hi", **fields}
            answers.append((name, *_post(episode, json.dumps(body).encode(), "/v1/responses")))
        with openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, timeout=60) as client:
            response = client.responses.create(model="policy", instructions="Be brief.", input=episode.row["prompt"],
                                               max_output_tokens=3)
            cut.append(response)

    spec = _spec(long_model, tmp_path / "o", name="scripted", group_size=2, agent={"max_total_tokens": 240})
    spec["train"]["prompts_per_step"] = 1
    run = Trainer(spec, agent=agent, plugins=[ScriptedPlugin()])._build()
    rollout = run.actor.collect(0).scored.rollout
    wrong = [(name, status, message) for name, status, message in answers
             if status != 400 or refused[name][1] not in message]
    assert not wrong, wrong
    assert not rollout.episodes.failed.any()
    for response in cut:
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert response.usage.output_tokens == 3 and response.instructions == "Be brief."
    assert "Be brief." in run.tokenizer.decode(rollout.prompt_ids[0][rollout.prompt_mask[0]])
