"""Agent episodes under a slow engine (issue 60, item 6): ``rollout.agent.timeout_s`` bounds an
agent's own time, not the time its requests wait at the endpoint for the shared policy, in
training rollouts and in the held-out evaluation alike; an agent that hangs still times out,
and an engine that does not answer stops the run naming ``rollout.agent.wait_timeout_s``.

The engine is the real ``hf`` backend on the tiny model, each ``generate`` call slowed by a
sleep (a loaded machine), and each episode asks with a stop string of its own, so no two
episodes share a ``generate`` call: their requests queue behind each other's."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions

from grpo_core import Trainer, hookimpl
from grpo_core.errors import RunError

from .conftest import BASE_SPEC, merge
from .test_agents import long_model  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("one_thread")

DELAY, TIMEOUT = 0.75, 3.0  # seconds each generate call sleeps; the episodes' own-time bound


class SlowEngine:
    """Registers ``slow-hf``: the hf backend, each ``generate`` call ``delay`` seconds slower."""

    __name__ = "slow_engine"

    def __init__(self, delay: float):
        self.delay = delay

    @hookimpl
    def register_rollout_backends(self, register):
        delay = self.delay

        class SlowHF(HFRollout):
            def generate(self, prompt_ids, group_size, sampling, *args, **kwargs):
                time.sleep(delay)
                return super().generate(prompt_ids, group_size, sampling, *args, **kwargs)

        register.add("slow-hf", SlowHF, options=HFRolloutOptions)


#: One HTTP client for every episode's openai client: the agents' own time stays small even on a
#: loaded machine (an openai client of its own builds an SSL context).
HTTP = httpx.Client(timeout=120)
#: The chat resources imported before the first episode (openai imports them on first use).
WARM = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="-", http_client=HTTP).chat.completions


def two_turns(episode):
    """A synchronous two-turn openai-client agent (the issue's), asking with a stop string of
    its own episode, so that its requests share no generate call with another episode's."""
    stop = [f"#{episode.api_key[:10]}"]
    client = openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, http_client=HTTP)
    messages = list(episode.row["prompt"])
    for _ in range(2):
        reply = client.chat.completions.create(model=episode.model, messages=messages, max_tokens=3, stop=stop)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
    return float(episode.index)


def _spec(model, out, **agent) -> dict:
    return merge({"model": {"path": str(model)}, **BASE_SPEC}, {
        "rollout": {"name": "slow-hf", "group_size": 2, "max_new_tokens": 3,
                    "agent": {"concurrency": 4, "timeout_s": TIMEOUT, "batch_window_ms": 0, **agent}},
        "rewards": [{"name": "env_reward"}],
        "data": {"eval_size": 4},
        "train": {"steps": 1, "output_dir": str(out)},
        "eval": {"at_end": True, "batch_size": 4},
    })


def test_episodes_that_wait_for_a_slow_engine_past_their_timeout_complete(long_model, tmp_path):  # noqa: F811
    """4 training episodes and 4 held-out ones, two turns each, queued behind each other's
    slowed generate calls (8 a rollout): they wait longer than timeout_s in all, and none of
    them spends timeout_s of its own. Every episode completes, in training and in the
    evaluation, and the wait is logged."""
    result = Trainer(_spec(long_model, tmp_path / "o"), agent=two_turns, plugins=[SlowEngine(DELAY)]).train()
    assert result.status == "finished"
    step, evaluation = result.history[-1], result.evaluations[-1]
    for prefix, row in (("", step), ("eval/", evaluation)):
        assert row[f"{prefix}env/failed_episodes"] == 0.0, row
        assert row[f"{prefix}env/turns_per_episode"] == 2.0, row
        assert row[f"{prefix}env/agent_seconds"] < TIMEOUT < row[f"{prefix}env/queue_wait_seconds"], row


def test_an_agent_that_hangs_still_times_out_on_its_own_time(long_model, tmp_path):  # noqa: F811
    """Behind the same slow engine, an episode whose agent hangs after its first answer fails
    with the named timeout, at about timeout_s of its own time; its sibling completes."""

    def hangs(episode):
        if episode.index == 1:
            client = openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, http_client=HTTP)
            client.chat.completions.create(model=episode.model, messages=episode.row["prompt"], max_tokens=3)
            time.sleep(30)
        return two_turns(episode)

    spec = merge(_spec(long_model, tmp_path / "o"), {"train": {"prompts_per_step": 1}})
    run = Trainer(spec, agent=hangs, plugins=[SlowEngine(DELAY)])._build()
    t0 = time.monotonic()
    episodes = run.actor.collect(0).scored.rollout.episodes
    assert time.monotonic() - t0 < 15
    assert episodes.failed.tolist() == [False, True]
    reason = episodes.messages[1][-1]["content"]
    assert f"timed out after {TIMEOUT:g} s of its own time (rollout.agent.timeout_s" in reason, reason


def test_an_engine_that_does_not_answer_stops_the_run_naming_the_setting(long_model, tmp_path):  # noqa: F811
    """A generate call that takes longer than rollout.agent.wait_timeout_s: the run stops with
    an error naming the setting, rather than waiting for ever."""
    spec = merge(_spec(long_model, tmp_path / "o", wait_timeout_s=0.5), {"train": {"prompts_per_step": 1}})
    run = Trainer(spec, agent=two_turns, plugins=[SlowEngine(2.0)])._build()
    with pytest.raises(RunError, match=r"waited more than 0.5 s for the policy's answer \(rollout.agent.wait_timeout"):
        run.actor.collect(0)
