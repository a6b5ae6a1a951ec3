"""What an agent sends or does stays in its own episode (issue 47, items 8 and 9): any
malformed request body is a 400 with a message, after which the episode goes on; an agent
that exits, raises ``SystemExit``/``KeyboardInterrupt`` or ends its thread fails its own
episode, and the others complete and train."""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import shutil
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest
import torch
from safetensors.torch import load_file

from grpo_core import Trainer

from .conftest import BASE_SPEC, merge
from .test_agents import ScriptedPlugin, calculator_agent

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def long_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with room for tool schemas in its prompts."""
    model = tmp_path_factory.mktemp("containment") / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (model / "config.json").write_text(json.dumps(config))
    return model


def _spec(model: Path, out: Path, **rollout) -> dict:
    return merge({"model": {"path": str(model)}, **BASE_SPEC},
                 {"rollout": {"max_new_tokens": 96, **rollout}, "train": {"output_dir": str(out)},
                  "rewards": [{"name": "accuracy"}]})


# ----------------------------------------------------------------------------- item 8: malformed bodies
def _post(episode, body: bytes, path: str = "/v1/chat/completions") -> tuple[int, str]:
    """A raw POST of ``body`` to the episode's endpoint: the status and the error message."""
    url = urlsplit(episode.base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=20)
    try:
        connection.request("POST", url.path.removesuffix("/v1") + path, body=body,
                           headers={"Authorization": f"Bearer {episode.api_key}", "Content-Type": "application/json"})
        answer = connection.getresponse()
        data = answer.read()
        try:
            return answer.status, json.loads(data)["error"]["message"]
        except (ValueError, KeyError, TypeError):  # not an error: what came back
            return answer.status, data.decode(errors="replace")[:300]
    finally:
        connection.close()


def _chat(**fields) -> bytes:
    return json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def _raw_chat(text: str) -> bytes:
    """A chat body with ``text`` spliced in as one more field (JSON that json.dumps would not write)."""
    return b'{"model": "policy", "messages": [{"role": "user", "content": "hi"}], ' + text.encode() + b"}"


MALFORMED = {
    "nested 100,000 deep": (b"[" * 100_000 + b"]" * 100_000, "nests deeper than 100 levels"),
    "nested 100,000 deep in a field": (
        _raw_chat('"tools": ' + "[" * 100_000 + "]" * 100_000), "nests deeper than 100 levels"),
    "nested 101 deep": (_raw_chat('"metadata": ' + "[" * 101 + "]" * 101), "nests deeper than 100 levels"),
    "invalid UTF-8": (b'{"messages": [{"role": "user", "content": "\xff\xfe caf\xe9"}]}', "not valid UTF-8"),
    "a lone surrogate": (_raw_chat('"user": "\\ud800"'), "not valid Unicode"),
    "not JSON": (b'{"messages": [', "the body is not JSON"),
    "empty": (b"", "messages: a non-empty list of {role, content} objects"),
    "an array": (b'[{"role": "user", "content": "hi"}]', "the body must be a JSON object, not an array"),
    "a string": (b'"hello"', "the body must be a JSON object, not a string"),
    "null": (b"null", "the body must be a JSON object, not null"),
    "NaN": (_raw_chat('"temperature": NaN'), "NaN is not JSON"),
    "Infinity": (_raw_chat('"max_tokens": -Infinity'), "-Infinity is not JSON"),
    "a number beyond a float": (_raw_chat('"temperature": 1e400'), "number 1e400 is out of range"),
    "an integer of 5,000 digits": (_raw_chat('"n": ' + "9" * 5000), "the body is not JSON"),
    "messages a string": (_chat(messages="hi"), "messages: a non-empty list of {role, content} objects"),
    "a role that is a number": (_chat(messages=[{"role": 5, "content": "hi"}]), "messages: a non-empty list"),
    "content a number": (_chat(messages=[{"role": "user", "content": 5}]), "messages[0].content: a string, "
                         "null or a list of content parts ({type: text, text: ...}); got int"),
    "content parts not objects": (_chat(messages=[{"role": "user", "content": ["hi"]}]),
                                  "messages[0].content: a string, null or a list of content parts"),
    "tool_calls a string": (_chat(messages=[{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "", "tool_calls": "calc"}]),
                            "messages[1].tool_calls: a list of {id, type, function: {name, arguments}} objects"),
    "a tool call's function a string": (
        _chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "a", "function": "calc"}]}]),
        "messages[0].tool_calls"),
    "tools a string": (_chat(tools="calculator"), "tools: a list of tool objects"),
    "a tool's function a string": (_chat(tools=[{"type": "function", "function": "calculator"}]),
                                   "tools[0].function: an object with a string name"),
    "n a string": (_chat(n="2"), "n: '2'; 1 to 2 completions per request"),
    "n true": (_chat(n=True), "n: True; 1 to 2 completions per request"),
    "n huge": (_chat(n=10**30), "n: 1000000000000000000000000000000; 1 to 2"),
    "max_tokens true": (_chat(max_tokens=True), "max_tokens: True; a positive integer"),
    "max_tokens a float": (_chat(max_tokens=2.5), "max_tokens: 2.5; a positive integer"),
    "max_completion_tokens negative": (_chat(max_completion_tokens=-3), "max_tokens: -3; a positive integer"),
    "temperature a string": (_chat(temperature="hot"), "temperature: 'hot'"),
    "temperature true": (_chat(temperature=True), "temperature: True"),
    "temperature an integer beyond a float": (_raw_chat('"temperature": 1' + "0" * 400), "temperature: 1000"),
    "top_k true": (_chat(top_k=True), "top_k: True"),
    "a lone surrogate in a key": (_raw_chat('"\\udfff": 1'), "not valid Unicode"),
    "top_k a list": (_chat(top_k=[1]), "top_k: [1]"),
    "stop a number": (_chat(stop=5), "stop: a string or a list of at most 8 non-empty strings"),
    "stream a string": (_chat(stream="no"), "stream: a boolean"),
    "stream_options a string": (_chat(stream=True, stream_options="usage"),
                                "stream_options: an object {include_usage: a boolean}; got 'usage'"),
    "logprobs a string": (_chat(logprobs="yes"), "logprobs: a boolean"),
    "prompt a list": (json.dumps({"prompt": [1, 2, 3]}).encode(), "prompt: a non-empty string"),
}


def test_any_malformed_body_is_a_400_with_a_message_and_the_episode_goes_on(long_model, tmp_path):
    """Each episode's agent first sends every malformed body (raw bytes over HTTP), then
    runs its ordinary tool loop: every malformed body gets a 400 naming what is wrong (the
    connection is answered, never dropped), and every episode completes as if they had not
    been sent."""
    seen: dict[int, list] = {}

    def clumsy(episode):
        answers = []
        for name, (body, _) in MALFORMED.items():
            path = "/v1/completions" if name == "prompt a list" else "/v1/chat/completions"
            try:
                answers.append(_post(episode, body, path))
            except (OSError, http.client.HTTPException, ValueError) as exc:  # dropped, or no JSON error
                answers.append((None, f"{type(exc).__name__}: {exc}"))
        seen[episode.index] = answers
        return calculator_agent(episode)

    spec = _spec(long_model, tmp_path / "o", name="scripted", group_size=2, agent={"max_total_tokens": 240})
    run = Trainer(spec, agent=clumsy, plugins=[ScriptedPlugin()])._build()
    rollout = run.actor.collect(0).scored.rollout
    assert sorted(seen) == [0, 1]
    for answers in seen.values():
        wrong = [(name, status, message) for (name, (_, words)), (status, message) in zip(MALFORMED.items(), answers)
                 if status != 400 or words not in message]
        assert not wrong, "\n".join(map(str, wrong))
    assert not rollout.episodes.failed.any(), [m[-1] for m in rollout.episodes.messages]
    assert rollout.episodes.turns.tolist() == [2] * 4 and rollout.episodes.tool_calls.tolist() == [1] * 4


def test_a_message_the_chat_template_cannot_render_is_a_400_and_the_episode_goes_on(long_model, tmp_path):
    """A template that raises on a role it does not know (as Llama's and Gemma's do): the
    request is answered 400 naming the roles, not dropped, and the episode continues."""
    model = tmp_path / "strict"
    shutil.copytree(long_model, model)
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% endfor %}" + template)
    answers = []

    def odd_roles(episode):
        first = [{"role": "narrator", "content": "once upon a time"}]
        answers.append(_post(episode, _chat(messages=first)))
        with openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, timeout=20) as client:
            messages = list(episode.row["prompt"])
            reply = client.chat.completions.create(model="policy", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "narrator", "content": "and then"}]
            answers.append(_post(episode, _chat(messages=messages)))
            messages[-1] = {"role": "user", "content": "and then?"}
            client.chat.completions.create(model="policy", messages=messages)

    spec = _spec(model, tmp_path / "o", name="scripted", group_size=2, agent={"max_total_tokens": 240})
    spec["train"]["prompts_per_step"] = 1
    rollout = Trainer(spec, agent=odd_roles, plugins=[ScriptedPlugin()])._build().actor.collect(0).scored.rollout
    assert [status for status, _ in answers] == [400] * 4, answers
    assert all("the chat template cannot render" in message and "narrator" in message for _, message in answers)
    assert not rollout.episodes.failed.any(), rollout.episodes.messages
    assert rollout.episodes.turns.tolist() == [2, 2]


# ----------------------------------------------------------------------------- item 9: agents that exit
def _exits(kind: str) -> None:
    """What a hostile agent does in place of its episode."""
    if kind == "sys.exit":
        sys.exit(3)
    if kind == "SystemExit":
        raise SystemExit("bye")
    if kind == "KeyboardInterrupt":
        raise KeyboardInterrupt
    if kind == "_thread.exit":  # ends the thread it runs in: the agents' event loop's, for a coroutine
        import _thread

        _thread.exit()


WORDS = {"sys.exit": "raised SystemExit (sys.exit(3) was called)",
         "SystemExit": "raised SystemExit (sys.exit('bye') was called)",
         "KeyboardInterrupt": "raised KeyboardInterrupt (in the agent's code: not a Ctrl-C",
         "_thread.exit": "raised SystemExit"}


def _reward(episode, text: str | None) -> float:
    """The answer's vowels plus the episode's place in its group: a tiny random policy's six
    tokens can tie across a whole group, and a tied group has no advantage to train on."""
    return float(sum(ch in "aeiou" for ch in text or "")) + episode.index


def _one_hostile(kind: str, coroutine: bool):
    """An agent of which one episode per step of 8 (the first to start) does ``kind``, the
    others ask the policy once and return the vowels of its answer (plus the episode's index)
    as the reward."""
    started = itertools.count()

    def hostile_now() -> bool:
        return next(started) % 8 == 0

    async def async_agent(episode):
        if hostile_now():
            if kind == "loop.stop":  # the loop every coroutine agent runs in
                asyncio.get_running_loop().stop()
            elif kind == "a callback exits":  # outside the episode's own code
                asyncio.get_running_loop().call_soon(sys.exit, 4)
            else:
                _exits(kind)
        async with openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0) as client:
            reply = await client.chat.completions.create(model=episode.model, messages=episode.row["prompt"],
                                                         max_tokens=6)
        return _reward(episode, reply.choices[0].message.content)

    def sync_agent(episode):
        if hostile_now():
            _exits(kind)
        with openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0) as client:
            reply = client.chat.completions.create(model=episode.model, messages=episode.row["prompt"], max_tokens=6)
        return _reward(episode, reply.choices[0].message.content)

    return async_agent if coroutine else sync_agent


@pytest.mark.parametrize(("kind", "coroutine"), [
    ("sys.exit", True), ("sys.exit", False), ("SystemExit", True), ("KeyboardInterrupt", True),
    ("KeyboardInterrupt", False), ("_thread.exit", True), ("_thread.exit", False),
    ("loop.stop", True), ("a callback exits", True),
])
def test_an_agent_that_exits_fails_its_own_episode_and_the_others_train(long_model, tmp_path, kind, coroutine,
                                                                        caplog):
    """Two training steps of 2 prompts x G=4 agent episodes with the real policy (the hf
    backend): one episode per step exits (or, a coroutine, stops the event loop all coroutine
    agents share, or schedules an exit outside its own code). The run finishes; that episode
    alone fails, with its reason; the seven others are scored and trained on."""
    threads = {t.name for t in threading.enumerate()}
    spec = _spec(long_model, tmp_path / "o", agent={"concurrency": 8, "timeout_s": 60}, max_new_tokens=6)
    spec["rewards"] = [{"name": "env_reward"}]
    spec["train"].update(steps=2, log_completions_every=1)
    result = Trainer(spec, agent=_one_hostile(kind, coroutine)).train()
    assert result.status == "finished" and result.step == 2
    escapes = kind in ("loop.stop", "a callback exits")  # the episode itself goes on
    for row in result.history:
        assert row["env/failed_episodes"] == (0.0 if escapes else 1 / 8), (kind, row)
        assert row["env/turns_per_episode"] == (1.0 if escapes else 7 / 8), row
    assert any(row["reward_std"] > 0 for row in result.history)
    before, after = (load_file(folder / "model.safetensors") for folder in (long_model, result.final_model))
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the steps updated the policy
    failures = [r.getMessage() for r in caplog.records if r.name == "grpo.agents" and "episodes failed" in r.message]
    if escapes:
        assert not failures
        stopped = [r.getMessage() for r in caplog.records if "stopped the agents' event loop" in r.getMessage()]
        assert len(stopped) == 2, stopped
    else:
        assert len(failures) == 2 and all(f.startswith("1 of 8 agent episodes failed") for f in failures), failures
        assert all(WORDS[kind] in f for f in failures), failures
    time.sleep(0.5)
    assert {t.name for t in threading.enumerate()} <= threads


@pytest.mark.parametrize("reward", [1e300, -(10**39), float("nan"), float("inf")])
def test_an_agent_reward_beyond_float32_fails_its_episode_not_the_run(long_model, tmp_path, reward):
    """1e300 is finite in Python but has no float32 value (issue 47, item 11): as the
    agent's own reward it fails that episode, as NaN does, instead of stopping the run at
    the reward table."""

    def generous(episode):
        calculator_agent(episode)
        return reward if episode.index == 0 else 1.0

    spec = _spec(long_model, tmp_path / "o", name="scripted", group_size=2, agent={"max_total_tokens": 240})
    spec["rewards"] = [{"name": "env_reward"}]
    rollout = Trainer(spec, agent=generous, plugins=[ScriptedPlugin()])._build().actor.collect(0).scored.rollout
    assert rollout.episodes.failed.tolist() == [True, False, True, False]
    assert f"returned the reward {reward!r:.40}; rewards are finite numbers within float32's range (|r| <= " \
           "3.403e+38), or None" in rollout.episodes.messages[0][-1]["content"]


def test_what_clients_send_beyond_the_strict_minimum_is_still_served(long_model, tmp_path):
    """The strict body checks refuse no well-formed request: a UTF-8 byte-order mark, a tool
    in the flat form ({type, name, parameters}), extra fields, integers as large as JSON
    writes them."""
    answers = []

    def lenient(episode):
        body = {"model": "policy", "messages": episode.row["prompt"], "user": "me", "seed": 10**30,
                "metadata": {"a": [[[1]]]}, "tools": [{"type": "function", "name": "f", "parameters": {}}],
                "max_tokens": 10**30, "n": 1, "stream": False, "logprobs": True, "temperature": 1}
        answers.append(_post(episode, b"\xef\xbb\xbf" + json.dumps(body).encode()))

    spec = _spec(long_model, tmp_path / "o", name="scripted", group_size=2, agent={"max_total_tokens": 240})
    rollout = Trainer(spec, agent=lenient, plugins=[ScriptedPlugin()])._build().actor.collect(0).scored.rollout
    assert [status for status, _ in answers] == [200] * 4, answers
    assert not rollout.episodes.failed.any() and rollout.episodes.turns.tolist() == [1] * 4
