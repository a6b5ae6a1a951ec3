"""``opd`` (on-policy distillation): the formula against a plain loop, its invariants (a teacher equal
to the policy gives grpo's advantage or nothing, linearity in its weights, zero on padding), the
reverse KL's gradient it estimates, and end to end: a tiny student trained against a tiny teacher
moves its per-token distributions toward the teacher's."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from grpo_plugins.advantages.distillation import (
    DistillationOptions,
    OnPolicyDistillation,
    TeacherOptions,
    distillation_advantages,
    load_teacher,
)
from grpo_plugins.advantages.grpo import GRPOAdvantage, GRPOOptions
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_core.cli import main
from grpo_core.contracts import AdvantageInputs, Teacher
from grpo_core.errors import RunError
from grpo_core.testing import build_model, build_tokenizer, save_tiny_model

from .conftest import F64, FAST, grouped_batches


@st.composite
def distillation_batches(draw):
    """(logp, teacher_logp, scores, group_ids, mask): a grouped batch with log-probs of both models."""
    scores, group_ids, mask = draw(grouped_batches())
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logp = -torch.rand(mask.shape, generator=gen, dtype=F64) * 4
    teacher = -torch.rand(mask.shape, generator=gen, dtype=F64) * 4
    return logp, teacher, scores, group_ids, mask


def loop_distillation(logp, teacher, scores, group_ids, mask, kl_coef=1.0, discount=0.0, kl_clamp=None,
                      task_weight=0.0):
    """Token by token: r_t = -kl_coef * clamp(logp_t - teacher_t) on completion tokens, A_t the
    discounted sum of r over positions s >= t, plus task_weight times grpo's row advantage."""
    rows, width = mask.shape
    task = GRPOAdvantage(GRPOOptions())(AdvantageInputs(scores, group_ids, torch.ones_like(mask)))[:, 0]
    out = torch.zeros(rows, width, dtype=F64)
    for i in range(rows):
        rewards = []
        for t in range(width):
            k = float(logp[i, t] - teacher[i, t]) if mask[i, t] else 0.0
            if kl_clamp is not None:
                k = max(-kl_clamp, min(kl_clamp, k))
            rewards.append(-kl_coef * k)
        for t in range(width):
            if mask[i, t]:
                future = sum(discount ** (s - t) * rewards[s] for s in range(t, width))
                out[i, t] = future + task_weight * float(task[i])
    return out


@FAST
@given(distillation_batches(), st.sampled_from([0.0, 0.5, 1.0]), st.sampled_from([None, 0.5]),
       st.sampled_from([0.0, 1.0, 0.3]), st.sampled_from([1.0, 0.1]))
def test_opd_matches_the_plain_loop(batch, discount, kl_clamp, task_weight, kl_coef):
    logp, teacher, scores, group_ids, mask = batch
    options = dict(kl_coef=kl_coef, discount=discount, kl_clamp=kl_clamp, task_weight=task_weight)
    got = distillation_advantages(logp, teacher, scores, group_ids, mask, **options)
    torch.testing.assert_close(got, loop_distillation(logp, teacher, scores, group_ids, mask, **options),
                               rtol=1e-10, atol=1e-10)


@FAST
@given(distillation_batches())
def test_a_teacher_equal_to_the_policy_leaves_the_task_advantage(batch):
    logp, _, scores, group_ids, mask = batch
    alone = distillation_advantages(logp, logp, scores, group_ids, mask)
    assert (alone == 0).all()
    mixed = distillation_advantages(logp, logp, scores, group_ids, mask, task_weight=1.0, discount=0.5)
    torch.testing.assert_close(mixed, GRPOAdvantage(GRPOOptions())(AdvantageInputs(scores, group_ids, mask)))


@FAST
@given(distillation_batches(), st.sampled_from([0.0, 0.7]))
def test_linear_in_the_two_weights_and_zero_on_padding(batch, discount):
    logp, teacher, scores, group_ids, mask = batch
    kl_only = distillation_advantages(logp, teacher, scores, group_ids, mask, discount=discount)
    task_only = distillation_advantages(logp, logp, scores, group_ids, mask, task_weight=1.0)
    both = distillation_advantages(logp, teacher, scores, group_ids, mask, kl_coef=0.25, task_weight=3.0,
                                   discount=discount)
    torch.testing.assert_close(both, 0.25 * kl_only + 3.0 * task_only, rtol=1e-10, atol=1e-10)
    assert (both[~mask] == 0).all()
    # an unscorable row still learns from the teacher: the task part is 0 there, the KL part is not
    unscorable = torch.isnan(scores)
    torch.testing.assert_close(both[unscorable], 0.25 * kl_only[unscorable])


@FAST
@given(st.lists(st.floats(-3, 3), min_size=5, max_size=5), st.lists(st.floats(-3, 3), min_size=5, max_size=5))
def test_its_policy_gradient_is_the_reverse_kl_gradient(student_logits, teacher_logits):
    """One token from a 5-way categorical: E_{x~pi}[A(x) grad log pi(x)] with A = -(log pi(x) - log q(x))
    is -grad KL(pi || q), exactly (the reverse KL's policy gradient; the score's own term has mean 0)."""
    theta = torch.tensor(student_logits, dtype=F64, requires_grad=True)
    log_q = torch.log_softmax(torch.tensor(teacher_logits, dtype=F64), dim=0)
    log_pi = torch.log_softmax(theta, dim=0)
    tokens = torch.arange(5)
    advantages = distillation_advantages(log_pi.detach()[:, None], log_q[:, None], torch.zeros(5),
                                         torch.zeros(5, dtype=torch.long), torch.ones(5, 1, dtype=torch.bool))[:, 0]
    surrogate = (log_pi.detach().exp() * advantages * log_pi[tokens]).sum()  # the expectation, summed exactly
    (policy_gradient,) = torch.autograd.grad(surrogate, theta)
    log_pi = torch.log_softmax(theta, dim=0)
    kl = (log_pi.exp() * (log_pi - log_q)).sum()
    (kl_gradient,) = torch.autograd.grad(kl, theta)
    torch.testing.assert_close(policy_gradient, -kl_gradient, rtol=1e-10, atol=1e-12)


def test_hand_values_with_a_discount():
    logp = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], dtype=F64)
    teacher = torch.tensor([[-0.5, -1.0, -1.0, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, True, False]])
    got = distillation_advantages(logp, teacher, torch.zeros(1), torch.zeros(1, dtype=torch.long), mask, discount=0.5)
    # rewards: -(logp - q) = 0.5, 1.0, -0.5 (the last position is padding)
    assert got[0].tolist() == pytest.approx([0.5 + 0.5 * 1.0 + 0.25 * -0.5, 1.0 + 0.5 * -0.5, -0.5, 0.0])


# --------------------------------------------------------------------------- the component
@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny teacher and its student: the teacher's weights with the output layer scaled by 8, so
    the student is sure where the teacher hesitates (its samples are its modes: the reverse KL's
    gradient is well measured from a few hundred tokens). Both share the tokenizer."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("opd")
    teacher = save_tiny_model(root / "teacher")
    student = AutoModelForCausalLM.from_pretrained(teacher)
    with torch.no_grad():
        student.lm_head.weight.mul_(8.0)
    student.save_pretrained(root / "student")
    build_tokenizer().save_pretrained(root / "student")
    return root / "student", teacher


def test_the_estimator_loads_its_teacher_and_needs_the_engine_s_logprobs(models):
    _, teacher_path = models
    estimator = OnPolicyDistillation(DistillationOptions(teacher=TeacherOptions(path=str(teacher_path), device="cpu")))
    assert isinstance(estimator.teacher, Teacher)
    assert not estimator.teacher.model.training
    assert not any(p.requires_grad for p in estimator.teacher.model.parameters())
    assert estimator.teacher.vocab == build_tokenizer().get_vocab()
    with pytest.raises(ValueError, match="needs inputs.logp and inputs.teacher_logp"):
        estimator(AdvantageInputs(torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.ones(2, 3, dtype=bool)))
    with pytest.raises(RunError, match=r"could not load its teacher from '.*nowhere'"):
        load_teacher(TeacherOptions(path=str(teacher_path.parent / "nowhere"), device="cpu"))
    with pytest.raises(ValidationError, match="discount"):
        DistillationOptions(teacher={"path": "x"}, discount=1.5)
    with pytest.raises(ValidationError, match="teacher"):
        DistillationOptions()


def _full_kl(student, teacher, sequences: torch.Tensor) -> float:
    """Mean over positions of KL(student(.|prefix) || teacher(.|prefix)), summed over the vocabulary."""
    with torch.no_grad():
        log_s = torch.log_softmax(student(sequences).logits.double(), dim=-1)
        log_t = torch.log_softmax(teacher(sequences).logits.double(), dim=-1)
    return float((log_s.exp() * (log_s - log_t)).sum(-1).mean())


def test_a_tiny_student_moves_toward_its_teacher(models, tmp_path):
    """Ten steps of distillation alone (no task reward, no reference model) on the tiny spec's
    task: the student's per-token reverse KL to the teacher, measured exactly over the whole
    vocabulary at every position of fixed sequences, falls by a quarter at least (0.32 to 0.17
    when written); the sampled-token estimate the run logs (teacher/kl) falls too."""
    from transformers import AutoModelForCausalLM

    student_path, teacher_path = models
    out = tmp_path / "out"
    spec = tmp_path / "spec.yaml"
    spec.write_text(textwrap.dedent(f"""
        model: {{path: {student_path}}}
        data: {{name: arithmetic, train_size: 80, eval_size: 0}}
        rollout: {{group_size: 4, max_new_tokens: 8, sampler: multinomial}}
        rewards: [{{name: accuracy}}]
        algorithm:
          advantage: {{name: opd, teacher: {{path: {teacher_path}, device: cpu}}}}
          kl: {{beta: 0.0}}
          aggregation: {{name: token-mean}}
        train: {{steps: 10, prompts_per_step: 4, lr: 1.0e-2, warmup_steps: 0, progress: false, seed: 1,
                 output_dir: {out}}}
        eval: {{at_start: false, at_end: false}}
        tracking: []
    """))
    assert main([str(spec)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 10 and all(math.isfinite(r["teacher/kl"]) for r in steps)
    assert all(r["time/teacher"] > 0 for r in steps)
    first, last = sum(r["teacher/kl"] for r in steps[:3]) / 3, sum(r["teacher/kl"] for r in steps[-3:]) / 3
    assert last < 0.75 * first, (first, last)

    tokenizer = build_tokenizer()
    texts = ["What is 12 + 7? Answer: 19", "What is 40 + 33? Answer: 73", "Think step by step. 5 * 6 = 30"]
    sequences = torch.tensor([tokenizer(t)["input_ids"][:6] for t in texts])
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path)
    before = _full_kl(AutoModelForCausalLM.from_pretrained(student_path), teacher, sequences)
    after = _full_kl(AutoModelForCausalLM.from_pretrained(out / "final"), teacher, sequences)
    assert after < 0.75 * before, (before, after)


def test_a_teacher_with_another_tokenizer_stops_the_run_before_the_first_step(models, tmp_path):
    student_path, _ = models
    other = build_tokenizer(vocab_size=300)
    teacher = build_model(other, seed=3)
    teacher.save_pretrained(tmp_path / "other")
    other.save_pretrained(tmp_path / "other")
    spec = tmp_path / "spec.yaml"
    spec.write_text(textwrap.dedent(f"""
        model: {{path: {student_path}}}
        data: {{name: arithmetic, train_size: 8, eval_size: 2}}
        rollout: {{group_size: 2, max_new_tokens: 4}}
        rewards: [{{name: accuracy}}]
        algorithm:
          advantage: {{name: opd, teacher: {{path: {tmp_path / "other"}, device: cpu}}}}
        train: {{steps: 1, prompts_per_step: 2, progress: false, output_dir: {tmp_path / "out"}}}
        eval: {{at_start: true, at_end: false}}
        tracking: []
    """))
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([str(spec)])
    assert code != 0
    assert "its tokenizer is not the policy's" in err.getvalue() and "Traceback" not in err.getvalue()
    assert not (tmp_path / "out" / "final").exists()  # nothing trained
    # refused when the learner is built: not even the evaluation at the start ran
    metrics = tmp_path / "out" / "metrics.jsonl"
    assert not metrics.exists() or "eval/" not in metrics.read_text()
