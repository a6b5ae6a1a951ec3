"""Agent episodes through the OpenAI-compatible endpoint: an agent written with the official
``openai`` client records exactly the sequences the in-process tools environment makes, the
endpoint batches concurrent episodes, and hostile agents get bounded, clear outcomes."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import openai
import pytest
import torch
from grpo_plugins.environments.calculator import calculator
from transformers.utils import get_json_schema

from grpo_core import Trainer, hookimpl
from grpo_core.contracts import RolloutBatch
from grpo_core.train.experience import Timer

from .conftest import BASE_SPEC, merge

pytestmark = pytest.mark.usefixtures("one_thread")

TOOLS = [get_json_schema(calculator)]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'


def calculator_agent(episode):
    """A tool loop written as any OpenAI-client agent is: up to three calls, each tool call
    answered with the calculator's result (encoded as the tools environment encodes it)."""
    with openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, timeout=60) as client:
        messages = list(episode.row["prompt"])
        for _ in range(3):
            reply = client.chat.completions.create(model=episode.model, messages=messages, tools=TOOLS)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return None
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": calculator(**json.loads(call.function.arguments))})
    return None


class Scripted:
    """A rollout backend that answers by rule instead of sampling, so that two paths to the
    same episodes see the same sampled tokens: a calculator call while the prompt holds no
    tool result, then a final answer ending with EOS. It counts its generate calls."""

    call, answer = CALL, "The answer is 5."  # what it writes before and after a tool result

    def setup(self, run):  # declares no capabilities: the contract's defaults
        self.tokenizer, self.calls, self.rows = run.tokenizer, 0, 0

    def sync_weights(self, model):
        pass

    def generate(self, prompt_ids, group_size, sampling):
        self.calls += 1
        texts, ids = [], []
        for prompt in prompt_ids:
            answered = "<|tool|>" in self.tokenizer.decode(prompt)
            text = self.answer if answered else self.call
            seq = self.tokenizer(text, add_special_tokens=False)["input_ids"] + (
                [self.tokenizer.eos_token_id] if answered else [])
            for _ in range(group_size):  # cut at max_new_tokens, as a backend must
                texts.append(self.tokenizer.decode(seq[: sampling.max_new_tokens], skip_special_tokens=True))
                ids.append(seq[: sampling.max_new_tokens])
        self.rows += len(ids)
        width = max(map(len, ids))
        completion = torch.zeros((len(ids), width), dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.bool)
        for row, seq in enumerate(ids):
            completion[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = True
        from grpo_core.contracts import left_pad

        p_ids, p_mask = left_pad(prompt_ids, self.tokenizer.pad_token_id)
        truncated = torch.tensor([seq[-1] != self.tokenizer.eos_token_id and not t.endswith("</tool_call>")
                                  for seq, t in zip(ids, texts)])
        return RolloutBatch(p_ids, p_mask, completion, mask, truncated, texts)


class ScriptedPlugin:
    __name__ = "scripted"

    def __init__(self):
        self.backend = Scripted()

    @hookimpl
    def register_rollout_backends(self, register):
        register.add("scripted", self.backend)


@pytest.fixture(scope="module")
def long_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with room for tool schemas in its prompts."""
    model = tmp_path_factory.mktemp("agent") / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (model / "config.json").write_text(json.dumps(config))
    return model


def _spec(model: Path, out: Path, **rollout) -> dict:
    return merge({"model": {"path": str(model)}, **BASE_SPEC},
                 {"rollout": {"max_new_tokens": 96, **rollout}, "train": {"output_dir": str(out)},
                  "rewards": [{"name": "accuracy"}]})


def test_an_openai_client_agent_records_what_the_tools_environment_makes(long_model, tmp_path):
    """The same sampled tokens, two paths: the in-process tools environment, and an agent
    written with the official openai client through the endpoint. The recorded sequences
    are equal token for token (prompt, completion, loss mask with holes), and so is one
    update's gradient on them."""
    env_spec = _spec(long_model, tmp_path / "env", name="scripted",
                     environment={"name": "tools", "tools": ["calculator"], "max_turns": 3, "max_total_tokens": 240})
    agent_spec = _spec(long_model, tmp_path / "agent", name="scripted",
                       agent={"max_total_tokens": 240, "concurrency": 8})
    in_process = Trainer(env_spec, plugins=[ScriptedPlugin()])._build()
    through = Trainer(agent_spec, agent=calculator_agent, plugins=[ScriptedPlugin()])._build()
    a, b = in_process.actor.collect(0), through.actor.collect(0)
    ra, rb = a.scored.rollout, b.scored.rollout
    assert torch.equal(ra.prompt_ids, rb.prompt_ids) and torch.equal(ra.prompt_mask, rb.prompt_mask)
    assert torch.equal(ra.completion_ids, rb.completion_ids)
    assert torch.equal(ra.completion_mask, rb.completion_mask)
    assert torch.equal(ra.truncated, rb.truncated)
    assert rb.episodes.turns.tolist() == ra.episodes.turns.tolist() == [2] * 8
    assert rb.episodes.tool_calls.tolist() == ra.episodes.tool_calls.tolist() == [1] * 8
    assert not rb.episodes.failed.any()
    # holes: the tool result is context, the two model turns are trained
    mask = rb.completion_mask[0]
    assert mask.any() and not mask.all() and mask[: mask.nonzero()[-1] + 1].float().mean() < 1
    grads = []
    for run, experience in ((in_process, a), (through, b)):
        before = [p.detach().clone() for p in run.model.parameters()]
        run.learner.learn(experience)
        grads.append([p.detach() - q for p, q in zip(run.model.parameters(), before)])
    for ga, gb in zip(*grads):
        assert torch.equal(ga, gb)


def test_concurrent_episodes_share_generate_calls(long_model, tmp_path):
    """16 episodes (2 prompts x G=8) of two model turns each: batched, the endpoint needs a
    handful of generate calls, not 32; the first turn of each prompt is one prompt x 8."""
    spec = _spec(long_model, tmp_path / "o", name="scripted", group_size=8,
                 agent={"concurrency": 16, "batch_window_ms": 3000})
    plugin = ScriptedPlugin()
    run = Trainer(spec, agent=calculator_agent, plugins=[plugin])._build()
    experience = run.actor.collect(0)
    assert experience.scored.rollout.episodes.turns.tolist() == [2] * 16
    assert plugin.backend.rows == 32
    assert plugin.backend.calls <= 4, plugin.backend.calls


def test_sixty_four_agents_connecting_at_once_are_all_served(long_model, tmp_path):
    """64 openai-client agents open their connections together: none is refused (the server's
    listen backlog was the standard library's 5, and a real run lost episodes to
    'APIConnectionError: Connection error.')."""
    spec = _spec(long_model, tmp_path / "o", name="scripted", group_size=16,
                 agent={"concurrency": 64, "max_total_tokens": 240})
    spec = merge(spec, {"train": {"prompts_per_step": 4}})
    run = Trainer(spec, agent=calculator_agent, plugins=[ScriptedPlugin()])._build()
    for step in range(2):
        episodes = run.actor.collect(step).scored.rollout.episodes
        assert len(episodes.failed) == 64
        assert not episodes.failed.any(), [m[-1]["content"] for m, f in zip(episodes.messages, episodes.failed) if f]
        assert episodes.turns.tolist() == [2] * 64


def test_a_slow_or_crashing_agent_does_not_stall_the_others(long_model, tmp_path):
    """Episode 0 of each group raises, episode 1 hangs past its deadline: both are failed
    episodes (no token in the loss), the rest finish, and the rollout ends at the deadline."""

    def moody(episode):
        if episode.index == 0:
            raise ValueError("the agent broke")
        if episode.index == 1:
            time.sleep(30)
        return calculator_agent(episode)

    spec = _spec(long_model, tmp_path / "o", name="scripted", group_size=4, agent={"timeout_s": 3})
    run = Trainer(spec, agent=moody, plugins=[ScriptedPlugin()])._build()
    t0 = time.monotonic()
    rollout = run.actor.collect(0).scored.rollout
    assert time.monotonic() - t0 < 15
    failed = rollout.episodes.failed.tolist()
    assert failed == [True, True, False, False] * 2
    assert not rollout.completion_mask[torch.tensor(failed)].any()
    assert rollout.completion_mask[~torch.tensor(failed)].any(dim=1).all()
    messages = rollout.episodes.messages
    assert "raised ValueError: the agent broke" in messages[0][-1]["content"]
    assert "timed out after 3 s" in messages[1][-1]["content"]


def _hostile(kind: str):
    def agent(episode):
        with openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, timeout=20) as client:
            return talk(episode, client)

    def talk(episode, client):
        messages = list(episode.row["prompt"])
        if kind == "flood":
            for _ in range(10_000):
                reply = client.chat.completions.create(model="policy", messages=messages)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "again"}]
        if kind == "huge":
            messages = [{"role": "user", "content": "x" * 1_100_000}]
        if kind == "key":
            client.api_key = "not-the-key"
        if kind == "temperature":
            return client.chat.completions.create(model="policy", messages=messages, temperature=0.3)
        if kind == "edit":
            first = client.chat.completions.create(model="policy", messages=messages)
            edited = [*messages, {"role": "assistant", "content": "something else"}, {"role": "user", "content": "?"}]
            del first
            return client.chat.completions.create(model="policy", messages=edited)
        client.chat.completions.create(model="policy", messages=messages)
        return None

    return agent


@pytest.mark.parametrize(("kind", "status", "words"), [
    ("flood", 429, "more than 5 requests (rollout.agent.max_calls)"),
    ("huge", 413, "rollout.agent.max_request_bytes"),
    ("key", 401, "unknown episode key"),
    ("temperature", 400, "temperature: 0.3; this run samples at the spec's rollout.temperature, 1.0"),
    ("edit", 400, "message 1 differs from the episode's history"),
])
def test_hostile_agents_get_a_clear_bounded_outcome(long_model, tmp_path, kind, status, words, caplog):
    spec = _spec(long_model, tmp_path / "o", name="scripted", group_size=2,
                 agent={"max_calls": 5, "timeout_s": 20, "concurrency": 2, "history": "refuse"})
    run = Trainer(spec, agent=_hostile(kind), plugins=[ScriptedPlugin()])._build()
    t0 = time.monotonic()
    rollout = run.actor.collect(0).scored.rollout
    assert time.monotonic() - t0 < 20
    assert rollout.episodes.failed.all()
    text = rollout.episodes.messages[0][-1]["content"]
    assert str(status) in text and words in text, text
    assert not rollout.completion_mask.any()
    # a training run's console says why, not only the env/failed_episodes count
    warned = [r.getMessage() for r in caplog.records if r.name == "grpo.agents"]
    n = len(rollout.episodes.failed)
    assert len(warned) == 1 and warned[0].startswith(f"{n} of {n} agent episodes failed") and words in warned[0]


def test_an_agent_trains_end_to_end_with_the_hf_backend(long_model, tmp_path):
    """The real policy behind the endpoint (the hf backend), an async agent, its reward:
    a few steps train, episodes are logged, and nothing is left running."""

    async def vowels(episode):
        async with openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0) as client:
            reply = await client.chat.completions.create(model=episode.model, messages=episode.row["prompt"],
                                                         max_tokens=6)
        # plus the episode's place in its group: a tiny random policy's answers can tie across
        # a whole group, which then has nothing to train on
        return float(sum(ch in "aeiou" for ch in reply.choices[0].message.content or "")) + episode.index

    threads = {t.name for t in threading.enumerate()}
    spec = _spec(long_model, tmp_path / "o", agent={"concurrency": 8}, max_new_tokens=8)
    spec["rewards"] = [{"name": "env_reward"}]
    result = Trainer(spec, agent=vowels).train()
    assert result.status == "finished" and result.step == 4
    for row in result.history:
        assert row["env/failed_episodes"] == 0.0 and row["env/turns_per_episode"] == 1.0, row
    assert any(row["reward_std"] > 0 for row in result.history)
    time.sleep(0.5)
    assert {t.name for t in threading.enumerate()} <= threads


def test_the_learner_sees_the_episode_prompt_shared_by_its_group(long_model, tmp_path):
    """Agents whose first prompts differ after a shared start: the group's prompt is the
    common prefix, the rest of each first prompt is context in its completion."""

    def varied(episode):
        with openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0) as client:
            messages = [*episode.row["prompt"], {"role": "user", "content": ["alpha", "omega"][episode.index]}]
            client.chat.completions.create(model="policy", messages=messages)

    spec = _spec(long_model, tmp_path / "o", name="scripted", group_size=2)
    run = Trainer(spec, agent=varied, plugins=[ScriptedPlugin()])._build()
    experience = run.actor.collect(0)
    rollout = experience.scored.rollout
    tokenizer = run.tokenizer
    prompt = tokenizer.decode(rollout.prompt_ids[0][rollout.prompt_mask[0]])
    first_row = tokenizer.decode(rollout.completion_ids[0])
    assert "alpha" not in prompt and "omega" not in prompt and "alpha" in first_row
    batch, _ = run.learner.prepare(experience, Timer())
    assert batch.mask.sum() == rollout.completion_mask.sum()


class SlowEcho:
    """An in-process environment whose step waits (a remote tool): the user answers the
    first turn, the second ends the episode. It counts the steps in flight at once."""

    tools: list = []
    stop = ()

    def __init__(self):
        self.in_flight = self.most = 0

    def reset(self, row):
        return {"turn": 0}

    def _enter(self):
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)

    def _answer(self, state):
        from grpo_core.contracts import Observation

        state["turn"] += 1
        if state["turn"] == 1:
            return Observation([{"role": "user", "content": "and then?"}])
        return Observation(done=True)

    def step(self, state, text):
        self._enter()
        time.sleep(0.05)
        self.in_flight -= 1
        return self._answer(state)


class AsyncSlowEcho(SlowEcho):
    async def step(self, state, text):
        import asyncio

        self._enter()
        await asyncio.sleep(0.05)
        self.in_flight -= 1
        return self._answer(state)


def test_an_async_environment_steps_its_episodes_together(long_model, tmp_path):
    """The same episodes as a synchronous environment's, token for token, with the 16 steps
    of a turn awaited together instead of one after the other."""
    rollouts, envs = [], (SlowEcho(), AsyncSlowEcho())
    for env in envs:
        spec = _spec(long_model, tmp_path / type(env).__name__, group_size=8, max_new_tokens=4,
                     environment={"max_turns": 2, "max_total_tokens": 64})
        rollouts.append(Trainer(spec, environment=env)._build().actor.collect(0).scored.rollout)
    sync, together = rollouts
    assert torch.equal(sync.completion_ids, together.completion_ids)
    assert torch.equal(sync.completion_mask, together.completion_mask)
    assert together.episodes.turns.tolist() == [2] * 16
    assert (envs[0].most, envs[1].most) == (1, 16)


def test_rows_route_to_their_own_environment_or_agent(long_model, tmp_path):
    """rollout.routing: a column names each row's route; tools rows run in the in-process
    tools environment, agent rows through the endpoint, and the batch keeps the prompts'
    order. A row naming no route stops the run, naming its value and the routes."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + 3?"}], "answer": str(a + 3),
             "task": "tools" if a % 2 else "agent"} for a in range(8)]
    routing = {"column": "task", "routes": {
        "tools": {"environment": {"name": "tools", "tools": ["calculator"], "max_total_tokens": 240}},
        "agent": {"agent": {"name": "calculator_agent", "max_total_tokens": 240}}}}
    spec = _spec(long_model, tmp_path / "o", name="scripted", routing=routing)
    spec["data"] = {"name": "arithmetic"}
    run = Trainer(spec, agent=calculator_agent, train_dataset=rows, plugins=[ScriptedPlugin()])._build()
    experience = run.actor.collect(0)
    g = experience.scored.rollout.group_size
    for p, prompt in enumerate(experience.scored.prompts):
        first = experience.scored.rollout.episodes.messages[p * g][0]
        assert ("tool_calls" in first) == (prompt.row["task"] == "agent"), (prompt.row, first)
    assert experience.scored.rollout.episodes.tool_calls.tolist() == [1] * (2 * g)
    bad = [{**rows[0], "task": "chess"}] * 4
    with pytest.raises(Exception, match=r"column 'task' holds values that name no route: 'chess' \(4 rows\); "
                                         "routes: tools, agent"):
        Trainer(spec, agent=calculator_agent, train_dataset=bad, plugins=[ScriptedPlugin()])._build()


def test_the_agent_spec_runs_its_loop_on_a_tiny_model(long_model, tmp_path):
    """specs/agent.yaml as shipped (its agent file an ordinary openai tool loop), on the
    tiny model for a step, evaluation included."""
    from grpo_core.cli import main

    from .conftest import read_metrics

    specs = Path(__file__).resolve().parents[2] / "specs"
    out = tmp_path / "agent"
    code = main([str(specs / "agent.yaml"),
                 "--set", "model.package=null", "--set", "model.gguf_file=null", "--set", f"model.path={long_model}",
                 "--set", "train.steps=1", "--set", "data.train_size=8", "--set", "eval.max_prompts=2",
                 "--set", "rollout.group_size=2", "--set", "rollout.max_new_tokens=4",
                 "--set", "rollout.agent.max_total_tokens=24", "--set", "train.progress=false",
                 "--set", "tracking=[]", "--set", f"train.output_dir={out}"])
    assert code == 0
    rows = read_metrics(out / "metrics.jsonl")
    step = next(r for r in rows if "env/turns_per_episode" in r)
    assert step["env/failed_episodes"] == 0.0 and step["env/model_tokens"] > 0
    assert len([r for r in rows if "eval/env/turns_per_episode" in r]) == 2


def test_the_dry_run_shows_why_an_agent_failed(long_model, tmp_path, capsys):
    from grpo_core.cli.dryrun import dry_run

    def broken(episode):
        raise KeyError("prompt")

    spec = _spec(long_model, tmp_path / "o", name="scripted", group_size=2)
    trainer = Trainer(spec, agent=broken, plugins=[ScriptedPlugin()])
    assert dry_run(trainer.loaded) == 0
    assert "agent failed: raised KeyError: 'prompt'" in capsys.readouterr().out
