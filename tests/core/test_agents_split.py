"""Agent histories that are not append-only (issue 48): with ``rollout.agent.history: split``
(the default) a request whose prompt does not extend the episode starts a new training sample of
it, prompted as the chat template renders its messages; with ``refuse`` the episode fails as
before. The samples are checked against an in-process run of the same turns (the rollout
backend called directly on the template's rendering, with the endpoint's seeds), their
advantages against the episode's by hand, and two training steps run with no failed episode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
import torch
from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions

from grpo_core import Trainer, hookimpl
from grpo_core.train.experience import Timer

from .test_agents import ScriptedPlugin, _spec, long_model  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")

#: The tiny model's template, but as Qwen3's treats past turns: the generation prompt opens a
#: thought, and an assistant message followed by others keeps only what comes after its
#: ``</think>`` (an unclosed thought is all thinking, dropped).
THINK_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['role'] == 'assistant' and not loop.last %}"
    "{{ message['content'].split('</think>')[-1] if '</think>' in message['content'] else '' }}"
    "{% else %}{{ message['content'] }}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>{% endif %}"
)


class Recorded(HFRollout):
    """The hf backend, each generate call recorded: its prompts, group size, sampling settings
    and what it returned."""

    def __init__(self, options: HFRolloutOptions | None = None):
        super().__init__(options)
        self.calls: list[tuple] = []

    def generate(self, prompt_ids, group_size, sampling, images=None):
        out = super().generate(prompt_ids, group_size, sampling)
        self.calls.append(([list(p) for p in prompt_ids], group_size, sampling, out))
        return out


class RecordedPlugin:
    __name__ = "recorded"

    @hookimpl
    def register_rollout_backends(self, register):
        register.add("recorded", Recorded, options=HFRolloutOptions)


@pytest.fixture(scope="module")
def think_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with room for long prompts and a template that drops past thinking."""
    model = tmp_path_factory.mktemp("think") / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (model / "config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja",):
        (model / name).unlink(missing_ok=True)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = THINK_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return model


def thinker(record: dict | None = None):
    """Three calls, each answer sent back and a user turn added (the template then drops the
    answer's thinking, so each call is a new sample); the reward is the episode's index."""

    def agent(episode):
        with openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, timeout=60) as client:
            messages = list(episode.row["prompt"])
            for _ in range(3):
                if record is not None:
                    record.setdefault((json.dumps(episode.row["prompt"]), episode.index), []).append(list(messages))
                reply = client.chat.completions.create(model=episode.model, messages=messages, max_tokens=5)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "go on"}]
        return float(episode.index)

    return agent


def _think_spec(model: Path, out: Path, **agent) -> dict:
    spec = _spec(model, out, name="recorded", dtype="bfloat16", group_size=2, max_new_tokens=5,
                 agent={"concurrency": 1, **agent})
    spec["rewards"] = [{"name": "env_reward"}]
    spec["train"]["steps"] = 2
    return spec


def test_a_split_episode_is_the_in_process_run_of_its_turns(think_model, tmp_path):
    """Every call of every episode is a sample of its own: its prompt is the chat template's
    rendering of the call's messages (past thinking dropped), its mask covers exactly the tokens
    the policy sampled for that call, and tokens and sampler log-probs equal a direct generate
    on that rendering with the endpoint's seed; every sample of an episode carries its
    advantage, computed over the group's episodes (here by hand)."""
    record: dict = {}
    run = Trainer(_think_spec(think_model, tmp_path / "o"), agent=thinker(record), plugins=[RecordedPlugin()])._build()
    backend, tokenizer = run.actor.backend, run.tokenizer
    experience = run.actor.collect(0)
    scored = experience.scored
    rollout = scored.rollout
    assert not rollout.episodes.failed.any()
    assert rollout.episodes.samples.tolist() == [3, 3, 3, 3]
    assert len(backend.calls) == 12 and all(len(p) == 1 and n == 1 for p, n, _, _ in backend.calls)
    batch, _ = run.learner.prepare(experience, Timer())
    assert batch.completion_ids.shape[0] == 12 and batch.group_size == 6
    g = rollout.group_size
    rewards = scored.scores.total.view(-1, g).double()
    by_hand = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, unbiased=False, keepdim=True) + 1e-6))
    replayed, used = 0, set()
    for row in range(12):
        episode = int(batch.samples.episode[row])
        k = row % 6 - 3 * (episode % g)  # which of its episode's three samples
        messages = record[(json.dumps(scored.prompts[episode // g].row["prompt"]), episode % g)][k]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt = batch.prompt_ids[row // 6][batch.prompt_mask[row // 6]].tolist()
        length = int(batch.samples.length[row])
        seq, mask = batch.completion_ids[row, :length].tolist(), batch.mask[row, :length]
        context = int((~mask).sum())
        assert prompt + seq[:context] == expected  # the prompt the template renders, no past thinking
        assert mask[context:].all() and not mask[:context].any()
        # the generate call that answered this turn: its prompt is the rendering, its tokens are the trained ones
        call = next(i for i, (prompts, _, _, out) in enumerate(backend.calls)
                    if i not in used and prompts[0] == expected
                    and out.completion_ids[0][out.completion_mask[0]].tolist() == seq[context:])
        used.add(call)
        prompts, _, sampling, out = backend.calls[call]
        again = Recorded.generate(backend, prompts, 1, sampling)  # the same turn, in process
        n = int(again.completion_mask[0].sum())
        assert seq[context:] == again.completion_ids[0, :n].tolist()
        assert torch.equal(batch.sampling_logp[row, context:length], again.sampling_logp[0, :n])
        assert torch.allclose(batch.advantages[row][batch.mask[row]].double(),
                              by_hand.flatten()[episode].expand(int(batch.mask[row].sum())), atol=1e-6)
        replayed += 1
    assert replayed == 12 and len(used) == 12
    assert not batch.advantages[batch.samples.episode < 0].any()


def test_refuse_keeps_the_episode_failing_as_before(think_model, tmp_path):
    """``history: refuse``: the second call is refused with today's 400 (the template renders
    the earlier turn again), the agent's client raises, and its episode fails."""
    run = Trainer(_think_spec(think_model, tmp_path / "o", history="refuse"), agent=thinker(),
                  plugins=[RecordedPlugin()])._build()
    rollout = run.actor.collect(0).scored.rollout
    assert rollout.episodes.failed.all() and not rollout.completion_mask.any()
    text = rollout.episodes.messages[0][-1]["content"]
    assert "400" in text and "the chat template cannot render these messages" in text, text
    assert "re-renders earlier turns" in text, text


def editor(episode):
    """An agent that rewrites its first answer before going on (a compacted history)."""
    with openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, timeout=20) as client:
        messages = list(episode.row["prompt"])
        client.chat.completions.create(model="policy", messages=messages)
        edited = [*messages, {"role": "assistant", "content": "something else"}, {"role": "user", "content": "?"}]
        client.chat.completions.create(model="policy", messages=edited)


def test_an_edited_history_is_a_new_sample_or_refused(long_model, tmp_path):  # noqa: F811 - a fixture
    """An agent that edits a past answer: split, its episode goes on as two samples, the second
    prompted with the edited messages; refuse, it fails with today's wording."""
    for history, failed in (("split", False), ("refuse", True)):
        spec = _spec(long_model, tmp_path / history, name="scripted", group_size=2,
                     agent={"timeout_s": 20, "history": history})
        run = Trainer(spec, agent=editor, plugins=[ScriptedPlugin()])._build()
        rollout = run.actor.collect(0).scored.rollout
        assert rollout.episodes.failed.tolist() == [failed] * 4
        if failed:
            assert "message 1 differs from the episode's history" in rollout.episodes.messages[0][-1]["content"]
            continue
        assert rollout.episodes.samples.tolist() == [2] * 4
        row = rollout.completion_ids[0][: int(rollout.episodes.lengths[0])]
        first, second = (run.tokenizer.decode(part) for part in row.tensor_split(rollout.episodes.splits[0]))
        assert "something else" in second and "something else" not in first


def compactor(episode):
    """Two calls that extend, then a compacted history and two calls that extend it: two samples
    of two model turns each (merged while each prompt extends the last)."""
    with openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, timeout=20) as client:
        for messages in (list(episode.row["prompt"]), [*episode.row["prompt"], {"role": "user", "content": "so: 5"}]):
            reply = client.chat.completions.create(model="policy", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
            client.chat.completions.create(model="policy", messages=messages)


def texter(episode):
    """The completions API: a prompt that extends the text so far, then one that does not."""
    with openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, timeout=20) as client:
        first = client.completions.create(model="policy", prompt="What is 2 + 3?", max_tokens=4)
        client.completions.create(model="policy", prompt="What is 2 + 3?" + first.choices[0].text + " more",
                                  max_tokens=4)
        client.completions.create(model="policy", prompt="What is the answer?", max_tokens=4)


def test_samples_merge_while_prompts_extend(long_model, tmp_path):  # noqa: F811 - a fixture
    """A compacted history after two turns: two samples of two turns each; the completions API:
    a prompt that does not extend the text so far starts the second sample, prompted by its text."""
    spec = _spec(long_model, tmp_path / "chat", name="scripted", group_size=2, agent={"timeout_s": 20})
    run = Trainer(spec, agent=compactor, plugins=[ScriptedPlugin()])._build()
    rollout = run.actor.collect(0).scored.rollout
    assert not rollout.episodes.failed.any() and rollout.episodes.samples.tolist() == [2] * 4
    assert rollout.episodes.turns.tolist() == [4] * 4
    for row in range(4):
        size = int(rollout.episodes.lengths[row])
        parts = torch.arange(size).tensor_split(rollout.episodes.splits[row])
        texts = [run.tokenizer.decode(rollout.completion_ids[row][part]) for part in parts]
        assert "more" in texts[0] and "so: 5" not in texts[0] and "so: 5" in texts[1] and "more" in texts[1]
        for part in parts:  # two sampled runs in each sample: two model turns merged
            trained = rollout.completion_mask[row][part].int()
            assert int((trained[1:] > trained[:-1]).sum()) + int(trained[0]) == 2
    spec = _spec(long_model, tmp_path / "text", name="scripted", group_size=2, agent={"timeout_s": 20})
    run = Trainer(spec, agent=texter, plugins=[ScriptedPlugin()])._build()
    experience = run.actor.collect(0)
    rollout = experience.scored.rollout
    assert not rollout.episodes.failed.any() and rollout.episodes.samples.tolist() == [2] * 4
    batch, _ = run.learner.prepare(experience, Timer())
    prompt = batch.prompt_ids[0][batch.prompt_mask[0]].tolist()
    context = batch.completion_ids[1][: int(batch.samples.length[1])][~batch.mask[1][: int(batch.samples.length[1])]]
    assert prompt + context.tolist() == run.tokenizer("What is the answer?")["input_ids"]


@pytest.mark.parametrize("rollout", [{}, {"dtype": None, "max_staleness": 1}], ids=["sync", "async"])
def test_two_training_steps_with_split_episodes(think_model, tmp_path, rollout):
    """Two steps train with no failed episode; asynchronously too, where the behaviour policy's
    log-probs are computed on the samples and put back at their episodes' places."""
    spec = _think_spec(think_model, tmp_path / "o")
    spec["rollout"].update(rollout)
    result = Trainer(spec, agent=thinker(), plugins=[RecordedPlugin()]).train()
    assert result.status == "finished" and result.step == 2
    for row in result.history:
        assert row["env/failed_episodes"] == 0.0 and row["env/samples_per_episode"] == 3.0, row
        assert row["train/updates"] == 1.0 and row["reward_std"] > 0, row


SPLITTER = '''
import os

import openai

from grpo_core import hookimpl


def splitter(episode):  # rank 1's episodes drop their first answer: two samples each; rank 0's extend theirs
    with openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, timeout=60) as client:
        messages = list(episode.row["prompt"])
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        if os.environ.get("RANK", "0") != "1":
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        client.chat.completions.create(model="policy", messages=[*messages, {"role": "user", "content": "again"}],
                                       max_tokens=4)
    return float(episode.index)


@hookimpl
def register_agents(register):
    register.add("splitter", splitter)
'''


@pytest.mark.slow
def test_split_episodes_on_one_process_only_train_sharded(tmp_path, write_spec):
    """FSDP2 on two processes, rank 1's episodes split and rank 0's not: their batches have
    different numbers of rows per prompt (8 and 4) and of micro-batches; the step is taken."""
    from .conftest import read_metrics
    from .test_fsdp2 import FSDP_SPEC, _run

    (tmp_path / "splitter.py").write_text(SPLITTER, encoding="utf-8")
    rollout = {**FSDP_SPEC["rollout"], "agent": {"name": "splitter", "concurrency": 8, "max_total_tokens": 24}}
    spec = write_spec(tmp_path, **{**FSDP_SPEC, "plugins": ["splitter.py"], "rewards": [{"name": "env_reward"}],
                                   "checkpoint": {"every": 0}, "rollout": rollout})
    _run([spec, "--nproc", "2", "--set", "train.steps=1"], tmp_path, timeout=180)
    (row,) = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert row["env/samples_per_episode"] == 1.5 and row["env/failed_episodes"] == 0.0, row
    assert row["train/updates"] == 1 and row["train/nonfinite_updates"] == 0, row
