"""Partial rollouts (``rollout.partial_rollouts``) on the CPU: per-token policy versions, the
staleness bound counted from a completion's oldest token, the rollout correction per token,
the spec's refusals, and the asynchronous pipeline handing newer weights to an interruptible
backend mid-batch (a plugin defined here that samples token by token with a real tiny model
and takes new weights at a fixed token, so its runs are exact), resumes included. The real
vLLM engines' side is in ``tests/vllm/test_partial.py``."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import torch

from grpo_core.cli import main
from grpo_core.contracts import RolloutBatch, oldest_versions, token_staleness
from grpo_core.errors import SpecError
from grpo_core.spec import load_spec
from grpo_core.train.actor.rollout import concat_rollouts, select_rollout
from grpo_core.train.experience import Experience, Scored, Scores
from grpo_core.train.learner.correction import rollout_correction
from grpo_core.train.loop.assemble import build_run
from grpo_core.train.pipeline import batch_staleness

torch.set_num_threads(1)
SPECS = Path(__file__).resolve().parents[2] / "specs"

T, F = True, False
VERSIONS = torch.tensor([[3, 3, 4, 0], [4, 4, 4, 4], [0, 0, 0, 0]])
MASK = torch.tensor([[T, T, T, F], [T, T, T, T], [F, F, F, F]])


# ----------------------------------------------------------------------------- per-token versions
def test_the_oldest_token_of_each_completion_and_each_tokens_staleness():
    assert oldest_versions(VERSIONS, MASK, default=7).tolist() == [3, 4, 7]  # padding's 0 is not a token
    assert token_staleness(VERSIONS, MASK, 5).tolist() == [[2, 2, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]


def _experience(step: int, version: int, versions: torch.Tensor | None) -> Experience:
    rows = MASK.shape[0]
    rollout = RolloutBatch(torch.ones(rows, 2, dtype=torch.long), torch.ones(rows, 2, dtype=torch.bool),
                           torch.ones(rows, 4, dtype=torch.long), MASK, torch.zeros(rows, dtype=torch.bool),
                           [""] * rows, token_versions=versions)
    scores = Scores(torch.zeros(rows), torch.zeros(rows, 1), ["r"])
    return Experience(step, Scored([], rollout, scores), version)


def test_a_batchs_staleness_counts_its_oldest_token():
    """Trained at step 5, tokens of versions 3 and 4: staleness 2 (the oldest), token
    staleness mean (2 + 2 + 1 + 1 + 1 + 1 + 1) / 7 and max 2."""
    staleness, metrics = batch_staleness(_experience(5, 3, VERSIONS), 5)
    assert staleness == 2
    assert metrics["async/token_staleness"] == pytest.approx(9 / 7)
    assert metrics["async/token_staleness/max"] == 2.0
    # an older token than the batch's start version still counts (a bound that never undercounts)
    staleness, _ = batch_staleness(_experience(5, 4, VERSIONS), 5)
    assert staleness == 2
    # without per-token versions: every token has the batch's version
    staleness, metrics = batch_staleness(_experience(5, 4, None), 5)
    assert staleness == 1 and metrics["async/token_staleness"] == 1.0


def test_the_correction_weights_each_token_by_the_sampler_log_prob_of_its_own_version():
    """Row 0: two tokens sampled with version 0 (sampler log-probs -1.5 and -0.5), then two
    with version 1, the trainer's current one (log-probs equal the trainer's). Token-level
    TIS (cap 2): exp(-1.0 + 1.5) = exp(0.5), exp(-1.0 + 0.5) = exp(-0.5), then exactly 1."""
    trainer = torch.tensor([[-1.0, -1.0, -2.0, -0.25]])
    sampler = torch.tensor([[-1.5, -0.5, -2.0, -0.25]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    weight, _ = rollout_correction(trainer, sampler, mask, level="token", mode="truncate", cap=2.0)
    assert weight[0].tolist() == pytest.approx([math.exp(0.5), math.exp(-0.5), 1.0, 1.0])
    # sequence level: one weight for the row, exp of the summed differences (0.5 - 0.5 + 0 + 0)
    weight, _ = rollout_correction(trainer, sampler, mask, level="sequence", mode="truncate", cap=2.0)
    assert weight[0].tolist() == pytest.approx([1.0] * 4)


def test_selected_and_concatenated_rollouts_keep_their_token_versions():
    one = _experience(0, 0, VERSIONS).scored.rollout
    one = RolloutBatch(one.prompt_ids[:1].repeat(1, 1), one.prompt_mask[:1], one.completion_ids[:2],
                       one.completion_mask[:2], one.truncated[:2], ["a", "b"], token_versions=VERSIONS[:2])
    assert one.group_size == 2
    assert torch.equal(select_rollout(one, [0]).token_versions, VERSIONS[:2])
    narrow = RolloutBatch(one.prompt_ids, one.prompt_mask, one.completion_ids[:, :2], one.completion_mask[:, :2],
                          one.truncated, ["c", "d"], token_versions=torch.tensor([[5, 6], [5, 5]]))
    both = concat_rollouts([one, narrow])
    assert both.token_versions.tolist() == [[3, 3, 4, 0], [4, 4, 4, 4], [5, 6, 0, 0], [5, 5, 0, 0]]
    assert concat_rollouts([one, RolloutBatch(*[getattr(narrow, f) for f in (
        "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated", "completions")])
    ]).token_versions is None


# ----------------------------------------------------------------------------- the spec
def _spec(*overrides: str):
    return load_spec(SPECS / "tiny.yaml", ["tracking=[]", *overrides])


def test_partial_rollouts_without_asynchronous_training_is_refused_naming_max_staleness():
    with pytest.raises(Exception, match=r"partial_rollouts.*max_staleness >= 1"):
        _spec("rollout.partial_rollouts=true")


def test_partial_rollouts_with_multi_turn_episodes_is_refused_naming_both_keys():
    with pytest.raises(Exception, match=r"partial_rollouts.*rollout.environment"):
        _spec("rollout.partial_rollouts=true", "rollout.max_staleness=1",
              "rollout.environment={name: calculator}")


def test_a_backend_that_cannot_stop_mid_generation_is_refused_at_validation(tmp_path, capsys):
    """A spec error (``grpo-run validate`` exits 2) at rollout.partial_rollouts, naming the backends that can."""
    with pytest.raises(SpecError, match=r"spec.rollout.partial_rollouts \(--set\): rollout backend 'hf' cannot stop "
                                        r"mid-generation; use rollout.name: vllm"):
        _spec("rollout.partial_rollouts=true", "rollout.max_staleness=1")
    args = ["validate", str(SPECS / "tiny.yaml"), "--set", "rollout.partial_rollouts=true", "--set",
            "rollout.max_staleness=1"]
    assert main(args) == 2
    assert "rollout backend 'hf' cannot stop mid-generation" in capsys.readouterr().err


def test_partial_rollouts_on_several_processes_are_a_spec_error_before_any_starts(stepwise, tmp_path, capsys):
    """``--nproc 2`` is known before the launcher starts a process: exit 2, naming the key."""
    plugin, model = stepwise
    args = [str(SPECS / "tiny.yaml"), "--nproc", "2"] + [a for o in (
        f"model.path={model}", "tracking=[]", f"train.output_dir={tmp_path / 'out'}", f"plugins=[{plugin}]",
        "rollout.name=stepwise", "rollout.max_staleness=1", "rollout.partial_rollouts=true") for a in ("--set", o)]
    assert main(["validate", *[a for a in args if a not in ("--nproc", "2")]]) == 0  # one process: valid
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "spec.rollout.partial_rollouts: runs in one process only (2 were asked for)" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- the pipeline
#: A rollout backend that samples token by token with its own copy of the policy (a full
#: forward per token, seeded), and, with partial rollouts, waits at token CUT of every batch
#: for the newer weights that are coming (the switch's ``coming``: up to WAIT seconds) and
#: takes them there: the cut is at a fixed token, so runs with it repeat exactly.
BACKEND = textwrap.dedent('''
    import copy, time
    import torch
    from grpo_core import hookimpl
    from grpo_core.contracts import RolloutBatch, RolloutCapabilities, left_pad, special_ids

    CUT, WAIT = 3, 60.0

    class Stepwise:
        """Token-by-token sampling, interruptible at token CUT."""

        capabilities = RolloutCapabilities(interruptible=True)

        def __init__(self):
            self.switch = None
            self.model = None
            self.log = []  # per batch: (start version, versions of its tokens)

        def setup(self, run):
            self.model = copy.deepcopy(run.model).float().eval()
            self.tokenizer, self.switch = run.tokenizer, run.switch
            self.eos, self.pad = special_ids(run.model, run.tokenizer, "stepwise")

        def sync_weights(self, model):
            with torch.no_grad():
                for mine, theirs in zip(self.model.parameters(), model.parameters(), strict=True):
                    mine.copy_(theirs)

        def generate(self, prompt_ids, group_size, sampling):
            generator = torch.Generator().manual_seed(sampling.seed or 0)
            rows = [list(p) for p in prompt_ids for _ in range(group_size)]
            new = [[] for _ in rows]
            logps = [[] for _ in rows]
            versions = [[] for _ in rows]
            version = self.switch.version if self.switch is not None else 0
            for t in range(sampling.max_new_tokens):
                if self.switch is not None and t == CUT:
                    deadline = time.monotonic() + WAIT
                    while self.switch.coming and not self.switch.pending() and time.monotonic() < deadline:
                        time.sleep(0.005)
                    if self.switch.pending():
                        version = self.switch.take()
                live = [b for b in range(len(rows)) if not new[b] or new[b][-1] not in self.eos]
                if not live:
                    break
                with torch.no_grad():
                    for b in live:
                        logits = self.model(torch.tensor([rows[b] + new[b]])).logits[0, -1].float()
                        logp = torch.log_softmax(logits / sampling.temperature, -1)
                        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
                        new[b].append(token)
                        logps[b].append(float(logp[token]))
                        versions[b].append(version)
            width = max(len(r) for r in new)
            ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.bool)
            lp = torch.zeros((len(rows), width))
            vs = torch.zeros((len(rows), width), dtype=torch.long)
            for b, r in enumerate(new):
                ids[b, :len(r)] = torch.tensor(r)
                mask[b, :len(r)] = True
                lp[b, :len(r)] = torch.tensor(logps[b])
                vs[b, :len(r)] = torch.tensor(versions[b])
            prompts, prompt_mask = left_pad(prompt_ids, self.pad)
            truncated = torch.tensor([not r or r[-1] not in self.eos for r in new])
            return RolloutBatch(prompts, prompt_mask, ids, mask, truncated,
                                self.tokenizer.batch_decode(ids, skip_special_tokens=True), sampling_logp=lp,
                                token_versions=vs if self.switch is not None else None)

    @hookimpl
    def register_rollout_backends(register):
        register.add("stepwise", Stepwise(), description="token-by-token sampling, interruptible")
''')


@pytest.fixture
def stepwise(tmp_path, tiny_model_dir) -> tuple[Path, Path]:
    path = tmp_path / "stepwise.py"
    path.write_text(BACKEND, encoding="utf-8")
    return path, tiny_model_dir


def _run(stepwise, tmp_path, *overrides):
    stepwise, model = stepwise
    base = [f"model.path={model}", "tracking=[]", f"train.output_dir={tmp_path}",
            "train.progress=false", "train.threads=1", "eval.every=0", "eval.at_start=false", "eval.at_end=false",
            f"plugins=[{stepwise}]", "rollout.name=stepwise", "rollout.max_staleness=1"]
    return build_run(load_spec(SPECS / "tiny.yaml", [*base, *overrides]))


def test_newer_weights_reach_a_batch_mid_generation_and_each_token_keeps_its_version(stepwise, tmp_path):
    """With max_staleness 1: batch 0 waits in vain (the learner waits for it) and is all
    version 0; each later batch t starts with version t - 1 and takes version t at token 3,
    the moment the learner publishes it: its oldest tokens are 1 version old when trained,
    the rest 0. Without partial rollouts the same backend samples each batch with one version."""
    from grpo_core.train.loop.step import train_step

    run = _run(stepwise, tmp_path / "a", "rollout.partial_rollouts=true", "train.steps=4")
    backend, pipeline = run.actor.backend, run.feed
    assert backend.switch is not None and pipeline.interruptible is True
    taken = []
    original = pipeline.actor.collect

    def collect(step):
        experience = original(step)
        taken.append(experience)
        return experience

    pipeline.actor.collect = collect
    pipeline.start(run.model, 0)
    try:
        metrics = [train_step(pipeline, run.learner, t).metrics for t in range(4)]
    finally:
        pipeline.close()
    for t, experience in enumerate(taken[:4]):
        rollout = experience.scored.rollout
        mask, versions = rollout.completion_mask, rollout.token_versions
        cut = min(3, mask.shape[1])
        if t == 0:
            assert int(versions[mask].max()) == 0
        else:
            assert experience.version == t - 1
            assert bool((versions[:, :cut][mask[:, :cut]] == t - 1).all())
            assert bool((versions[:, cut:][mask[:, cut:]] == t).all())
    assert [m["async/staleness"] for m in metrics] == [0, 1, 1, 1]
    assert [m["async/switches"] for m in metrics][1:] == [1.0, 1.0, 1.0]
    assert all(m["async/token_staleness/max"] <= 1 for m in metrics)
    assert 0 < metrics[2]["async/token_staleness"] < 1

    # the option off: the backend gets no switch, and the pipeline logs what it always did
    off = _run(stepwise, tmp_path / "b", "train.steps=2")
    assert off.actor.backend.switch is None and off.feed.interruptible is False


def test_a_resumed_run_with_partial_rollouts_trains_on_exactly_what_the_uninterrupted_run_did(
        stepwise, tmp_path, kit):
    """A checkpoint is a rest point (the batch generated ahead dropped, the in-flight
    generation with it): the resumed run samples and trains on what the uninterrupted one did,
    per-token versions included."""
    plugin, model = stepwise
    sets = [f"model.path={model}", "tracking=[]", "train.progress=false", "train.threads=1",
            "eval.every=0", "eval.at_start=false", "eval.at_end=false", f"plugins=[{plugin}]",
            "rollout.name=stepwise", "rollout.max_staleness=1", "rollout.partial_rollouts=true",
            "train.steps=5", "checkpoint.every=2", "checkpoint.keep=5"]

    def grpo(out, *more, resume=False):
        args = [str(SPECS / "tiny.yaml"), *[x for s in [*sets, f"train.output_dir={out}", *more]
                                            for x in ("--set", s)]]
        return main([*args, "--resume", "latest"] if resume else args)

    assert grpo(tmp_path / "whole") == 0
    assert grpo(tmp_path / "cut", "train.steps=2") == 0
    assert grpo(tmp_path / "cut", resume=True) == 0
    whole, cut = kit.load_weights(tmp_path / "whole" / "final"), kit.load_weights(tmp_path / "cut" / "final")
    for name in whole:
        assert torch.equal(whole[name], cut[name]), name
    rows = {r["step"]: r for r in kit.read_metrics(tmp_path / "whole" / "metrics.jsonl") if "loss" in r}
    resumed = {r["step"]: r for r in kit.read_metrics(tmp_path / "cut" / "metrics.jsonl") if "loss" in r}
    assert [rows[s]["async/switches"] for s in range(1, 6)] == [0, 1, 0, 1, 0]  # restarts at steps 2 and 4
    for s in (3, 4, 5):
        for key in ("loss", "reward", "async/token_staleness", "async/staleness"):
            assert rows[s][key] == resumed[s][key], (s, key)


def test_a_crash_mid_generation_loses_nothing_already_checkpointed(stepwise, tmp_path, kit):
    """The engine dies in the middle of batch 3, right after taking version 3 there: the run
    stops with exit 1, the checkpoint of the last completed step (3) is written, and the
    resumed run (the engine healthy again) regenerates batch 3 from it and finishes."""
    plugin, model = stepwise
    failing = tmp_path / "failing" / "stepwise.py"
    failing.parent.mkdir()
    taking = "                    version = self.switch.take()\n"
    assert taking in BACKEND
    dies = "                    if version == 3:\n                        raise RuntimeError('the engine died')\n"
    failing.write_text(BACKEND.replace(taking, taking + dies), encoding="utf-8")
    sets = [f"model.path={model}", "tracking=[]", "train.progress=false", "train.threads=1", "eval.every=0",
            "eval.at_start=false", "eval.at_end=false", "rollout.name=stepwise", "rollout.max_staleness=1",
            "rollout.partial_rollouts=true", "train.steps=5", f"train.output_dir={tmp_path / 'out'}"]

    def grpo(plugin_file, resume=False):
        args = [str(SPECS / "tiny.yaml"), *[x for s in [*sets, f"plugins=[{plugin_file}]"] for x in ("--set", s)]]
        return main([*args, "--resume", "latest"] if resume else args)

    assert grpo(failing) == 1
    saved = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert saved and saved[-1].endswith("000003"), saved
    trained = [r["step"] for r in kit.read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert trained == [1, 2, 3]
    assert grpo(plugin, resume=True) == 0
    rows = [r for r in kit.read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[3]["async/switches"] == 0 and rows[3]["async/token_staleness"] == 0  # batch 3 anew, from step 3


def test_with_partial_rollouts_the_actor_scores_no_batch_that_no_step_trains(stepwise, tmp_path, kit):
    """Issue 60, item 4: 6 steps, max_staleness 1, a checkpoint every 3: the reward runs once
    per trained batch, 6 times. Before: 9 in the run measured, since at each rest (the
    checkpoint of step 3, the end) the batch generated ahead and the one in flight were
    dropped, then generated again after the checkpoint."""
    from .test_async import COUNTING_REWARD, reward_calls

    plugin, model = stepwise
    (tmp_path / "counting.py").write_text(COUNTING_REWARD, encoding="utf-8")
    sets = [f"model.path={model}", "tracking=[]", "train.progress=false", "train.threads=1",
            "eval.every=0", "eval.at_start=false", "eval.at_end=false",
            f"plugins=[{plugin}, {tmp_path / 'counting.py'}]", "rewards=[{name: counted}]",
            "rollout.name=stepwise", "rollout.max_staleness=1",
            "rollout.partial_rollouts=true", "train.steps=6", "checkpoint.every=3", "checkpoint.keep=5",
            f"train.output_dir={tmp_path / 'out'}"]
    assert main([str(SPECS / "tiny.yaml"), *[x for s in sets for x in ("--set", s)]]) == 0
    assert reward_calls(tmp_path) == (6, 0)
    rows = [r for r in kit.read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["async/switches"] for r in rows] == [0, 1, 1, 0, 1, 1]  # restarted at step 3 as before
    assert sum(r["async/dropped_batches"] for r in rows) == 0
