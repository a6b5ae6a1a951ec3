"""DAPO's dynamic sampling (which groups a step trains on), the adaptive KL coefficient and
the reference that follows the policy: the selection against a brute-force expectation, the
formulas by hand, and real runs of the tiny model that resume exactly."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core import checkpoint as ckpt
from grpo_core.cli import main
from grpo_core.contracts import RolloutBatch, SamplingParams
from grpo_core.errors import SpecError
from grpo_core.spec import load_spec
from grpo_core.spec.algorithm import DynamicSamplingSection
from grpo_core.testing import build_model, build_tokenizer
from grpo_core.train.actor.actor import Actor, RolloutSettings
from grpo_core.train.actor.data import Prompt
from grpo_core.train.actor.rollout import Scorer
from grpo_core.train.actor.scoring import RewardFn
from grpo_core.train.learner.kl import KLTerm, Reference, adapted_beta

G = 3


class ScriptedBackend:
    """A rollout backend whose completion ``j`` of prompt ``k`` reads ``"k:j"``; the reward
    ``table`` maps it to a score, so each group's spread is known in advance."""

    def __init__(self):
        self.calls = 0

    def generate(self, prompt_ids, group_size, sampling):
        self.calls += 1
        texts = [f"{ids[0]}:{j}" for ids in prompt_ids for j in range(group_size)]
        b = len(texts)
        return RolloutBatch(
            torch.tensor(prompt_ids), torch.ones(len(prompt_ids), 1, dtype=torch.bool),
            torch.arange(b)[:, None] + 10, torch.ones(b, 1, dtype=torch.bool), torch.zeros(b, dtype=torch.bool), texts,
        )

    def sync_weights(self, model):
        pass


class Source:
    """Prompts ``0, 1, 2, ...`` in order, as a prompt source hands them out."""

    def __init__(self):
        self.position = 0

    def next(self, n):
        out = [Prompt({"prompt": f"p{k}"}, f"p{k}", f"p{k}", [k]) for k in range(self.position, self.position + n)]
        self.position += n
        return out


def actor_for(table: list[list[float]], prompts_per_step: int, max_rounds: int) -> Actor:
    def reward(completions, **_):
        return [table[int(c.split(":")[0])][int(c.split(":")[1])] for c in completions]

    settings_ = RolloutSettings(
        group_size=G, prompts_per_step=prompts_per_step, seed=0, sampling=SamplingParams(max_new_tokens=1),
        dynamic=DynamicSamplingSection(max_rounds=max_rounds),
    )
    return Actor(backend=ScriptedBackend(), scorer=Scorer([RewardFn.of("table", 1.0, reward)], "prompt"),
                 settings=settings_, source=Source())


@settings(max_examples=60, deadline=None)
@given(
    p=st.integers(1, 4), max_rounds=st.integers(1, 4), data=st.data(),
)
def test_dynamic_sampling_keeps_the_first_groups_with_spread_and_fills_only_when_rounds_run_out(p, max_rounds, data):
    groups = p * max_rounds
    table = data.draw(st.lists(st.lists(st.sampled_from([0.0, 1.0]), min_size=G, max_size=G),
                               min_size=groups, max_size=groups))
    actor = actor_for(table, p, max_rounds)
    experience = actor.collect(0)
    scored, metrics = experience.scored, experience.metrics

    spread = [k for k in range(groups) if len(set(table[k])) > 1]
    rounds = next((r for r in range(1, max_rounds + 1) if len([k for k in spread if k < r * p]) >= p), max_rounds)
    seen = rounds * p
    kept = [k for k in spread if k < seen][:p]
    fill = [k for k in range(seen) if k not in spread][: p - len(kept)]
    assert [q.ids[0] for q in scored.prompts] == kept + fill
    assert metrics["dynamic_sampling/rounds"] == rounds == actor.backend.calls
    assert metrics["dynamic_sampling/prompts_consumed"] == seen
    assert metrics["dynamic_sampling/groups_kept"] == len(kept)
    assert metrics["dynamic_sampling/groups_filled"] == len(fill)
    assert metrics["dynamic_sampling/groups_dropped"] == seen - p
    # A zero-spread group is trained on only when the rounds ran out.
    if fill:
        assert rounds == max_rounds
    # The rows follow their prompts: each group's G scores are its own.
    totals = scored.scores.total.view(-1, G).tolist()
    assert totals == [table[k] for k in kept + fill]
    assert scored.rollout.completions == [f"{k}:{j}" for k in kept + fill for j in range(G)]


def test_dynamic_sampling_on_one_reward_function_uses_that_functions_scores():
    table = [[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]]
    actor = actor_for(table, 1, 2)
    constant = RewardFn.of("constant", 1.0, lambda completions, **_: [0.5] * len(completions))
    actor.scorer.rewards.insert(0, constant)  # the total is table + 0.5: same spread as the table
    dynamic = DynamicSamplingSection(metric="constant", max_rounds=2)
    actor.settings = RolloutSettings(**{**actor.settings.__dict__, "dynamic": dynamic})
    experience = actor.collect(0)
    scored, metrics = experience.scored, experience.metrics
    # 'constant' never spreads: both rounds run, and the first group fills the batch.
    assert metrics["dynamic_sampling/rounds"] == 2 and metrics["dynamic_sampling/groups_filled"] == 1
    assert [q.ids[0] for q in scored.prompts] == [0]


# --------------------------------------------------------------------------- KL
def test_adaptive_beta_follows_the_controller_formula():
    # kl / target - 1 = 1.0, clipped to 0.2: beta * (1 + 0.2 * 64 / 1000)
    assert adapted_beta(0.1, 0.2, 64, target=0.1, horizon=1000) == pytest.approx(0.1 * (1 + 0.2 * 0.064))
    # below target by half: error -0.5 clipped to -0.2
    assert adapted_beta(0.1, 0.05, 64, target=0.1, horizon=1000) == pytest.approx(0.1 * (1 - 0.2 * 0.064))
    # inside the clip: error 0.1 exactly
    assert adapted_beta(0.1, 0.11, 10, target=0.1, horizon=100) == pytest.approx(0.1 * (1 + 0.1 * 0.1))
    assert adapted_beta(0.1, 0.1, 10, target=0.1, horizon=100) == pytest.approx(0.1)


def test_reference_sync_mixes_every_n_steps_and_its_state_round_trips():
    torch.manual_seed(0)
    policy = build_model(build_tokenizer())
    term = KLTerm(estimator=None, beta=0.1, reference=Reference(policy),
                  sync=type("Sync", (), {"every": 2, "alpha": 0.25})())
    initial = copy.deepcopy(term.reference.model.state_dict())
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    assert term.after_step(1, policy, None, 8) == {"kl/beta": 0.1, "kl/ref_syncs": 0.0}
    assert all(torch.equal(v, initial[k]) for k, v in term.reference.model.state_dict().items())
    assert term.after_step(2, policy, None, 8)["kl/ref_syncs"] == 1.0
    for (name, ref), new in zip(term.reference.model.named_parameters(), policy.parameters()):
        torch.testing.assert_close(ref, 0.25 * new + 0.75 * initial[name])
    state = term.state_dict()
    assert "reference" in state and state["syncs"] == 1
    fresh = KLTerm(estimator=None, beta=0.5, reference=Reference(build_model(build_tokenizer())))
    fresh.load_state_dict(state)
    assert fresh.beta == 0.5 and fresh.syncs == 1  # a fixed beta comes from the spec, not the checkpoint
    for a, b in zip(fresh.reference.model.parameters(), term.reference.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("override", "message"), [
    ("algorithm.kl={beta: 0, ref_sync: {every: 2}}",
     "ref_sync needs a reference copy to move, but algorithm.kl.beta is 0"),
    ("algorithm.kl={beta: 0, adaptive: {target: 0.1}}", "adaptive needs a starting algorithm.kl.beta above 0"),
    ("algorithm.dynamic_sampling={metric: nope}", "metric 'nope' must be 'reward' or the name of a reward function"),
])
def test_invalid_options_name_what_is_valid(tmp_path, override, message):
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {path: m}\nrewards: [{name: accuracy}, {name: format, pattern: '\\\\d'}]\n")
    load_spec(spec)  # valid as written
    with pytest.raises(SpecError, match=message) as info:
        load_spec(spec, [override])
    assert "1 problem" in str(info.value)


def test_reference_sync_is_refused_with_iterative_grpo(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "model: {path: m}\nrewards: [{name: accuracy}, {name: trainable_reward_model, path: rm}]\n"
        "iterative: {reward_model: trainable_reward_model, verifier: {name: accuracy}, iterations: 2,"
        " steps_per_iteration: 2}\n"
    )
    load_spec(spec, ["algorithm.kl={beta: 0.1}"])  # valid without the sync
    with pytest.raises(SpecError, match="ref_sync and iterative both move the reference") as info:
        load_spec(spec, ["algorithm.kl={beta: 0.1, ref_sync: {every: 2}}"])
    assert "1 problem" in str(info.value)


def test_reference_sync_is_refused_under_lora(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {path: m, lora: {r: 4}}\nrewards: [{name: accuracy}]\n")
    load_spec(spec)  # valid as written
    with pytest.raises(SpecError, match="under model.lora the reference is the base model"):
        load_spec(spec, ["algorithm.kl={beta: 0.1, ref_sync: {every: 2}}"])


# --------------------------------------------------------------------------- real runs
def test_a_run_with_all_three_logs_them_and_resumes_exactly(tmp_path, write_spec, kit, capsys):
    spec = write_spec(
        tmp_path,
        algorithm={
            "dynamic_sampling": {"max_rounds": 3},
            "kl": {"beta": 0.05, "ref_sync": {"every": 2, "alpha": 0.5}, "adaptive": {"target": 0.001, "horizon": 16}},
        },
        train={"steps": 4},
        checkpoint={"every": 1, "keep": 4},
    )
    out = tmp_path / "out"
    assert main([str(spec)]) == 0
    rows = kit.read_metrics(out / "metrics.jsonl")
    straight = {r["step"]: r for r in rows}
    assert sorted(straight) == [1, 2, 3, 4]
    for r in straight.values():
        assert r["dynamic_sampling/groups_kept"] + r["dynamic_sampling/groups_filled"] == 2
        assert 1 <= r["dynamic_sampling/rounds"] <= 3
        assert r["dynamic_sampling/prompts_consumed"] == 2 * r["dynamic_sampling/rounds"]
        if r["dynamic_sampling/groups_filled"]:
            assert r["dynamic_sampling/rounds"] == 3
    assert [straight[s]["kl/ref_syncs"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 2.0]
    # beta after each step: at step 1 the policy is the reference (KL 0, error clipped to
    # -0.2), later KLs are far above the 0.001 target (error clipped to +0.2); B = 8 rows.
    betas = [straight[s]["kl/beta"] for s in (1, 2, 3, 4)]
    assert straight[1]["kl"] == 0.0 and betas[0] == pytest.approx(0.05 * (1 - 0.2 * 8 / 16))
    for s in (2, 3, 4):
        assert straight[s]["kl"] > 0.0012
        assert betas[s - 1] == pytest.approx(betas[s - 2] * (1 + 0.2 * 8 / 16))
    final = kit.load_weights(out / "final")

    # Lose steps 3 and 4, resume from step 2: the same weights and metrics.
    for step in (3, 4):
        shutil.rmtree(out / "checkpoints" / f"step-{step:06d}")
    shutil.rmtree(out / "final")
    assert main([str(spec), "--resume"]) == 0
    assert "resuming from" in capsys.readouterr().err
    again = {r["step"]: r for r in kit.read_metrics(out / "metrics.jsonl")}  # the last row of each step
    volatile = ("time/", "perf/")
    for s in (3, 4):
        assert {k: v for k, v in again[s].items() if not k.startswith(volatile)} == {
            k: v for k, v in straight[s].items() if not k.startswith(volatile)}
    resumed = kit.load_weights(out / "final")
    assert all(torch.equal(final[k], resumed[k]) for k in final)
    state = torch.load(ckpt.list_checkpoints(out / "checkpoints")[-1] / ckpt.STATE, weights_only=False)
    assert state["components"]["kl"]["syncs"] == 2 and "reference" in state["components"]["kl"]
