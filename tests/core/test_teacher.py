"""The teacher's forward, engine side (grpo_core.train.learner.teacher): its log-probs are the ones the
learner would compute for the same model (the reference-model path, in micro-batches, at the
batch's temperature), in its own dtype and wherever it sits; a teacher with another tokenizer is
refused naming it and the tokens that differ."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_core.contracts import Teacher
from grpo_core.errors import RunError
from grpo_core.testing import build_model, build_tokenizer
from grpo_core.train.learner.batch import TrainBatch, batch_logprobs
from grpo_core.train.learner.parallel import forward_of
from grpo_core.train.learner.teacher import check_vocabulary, teacher_logprobs


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def batch_of(tokenizer, temperature: float = 1.0) -> TrainBatch:
    prompts = [tokenizer(t)["input_ids"] for t in ("What is 3 + 4?", "Hi there")]
    width = max(map(len, prompts))
    prompt_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    prompt_mask = prompt_ids != tokenizer.pad_token_id
    gen = torch.Generator().manual_seed(0)
    completion_ids = torch.randint(10, 300, (4, 5), generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    return TrainBatch(prompt_ids, prompt_mask, completion_ids, mask, torch.zeros(4, 5), temperature=temperature)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_teacher_logprobs_are_the_learner_s_logprobs_of_that_model(tokenizer, temperature):
    model = build_model(tokenizer, seed=5).eval()
    batch = batch_of(tokenizer, temperature)
    got = teacher_logprobs(Teacher(model), batch, 2)
    expected = batch_logprobs(forward_of(model), batch, 2, temperature, lambda: torch.autocast("cpu", enabled=False))
    torch.testing.assert_close(got, expected * batch.mask)
    assert (got[~batch.mask] == 0).all() and (got[batch.mask] < 0).all()


def test_a_teacher_in_another_dtype_runs_in_its_own_and_answers_in_float32(tokenizer):
    model = build_model(tokenizer, seed=5).eval()
    half = copy.deepcopy(model).to(torch.bfloat16)
    batch = batch_of(tokenizer)
    got = teacher_logprobs(Teacher(half), batch, 4)
    assert got.dtype == torch.float32
    full = teacher_logprobs(Teacher(model), batch, 4)
    assert 0 < float((got - full).abs().max()) < 0.1  # bf16 rounding, not another model


def test_a_teacher_on_another_device_gets_the_batch_and_gives_back_logprobs(tokenizer):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU: the teacher on cuda, the batch on cpu")
    model = build_model(tokenizer, seed=5).eval()
    batch = batch_of(tokenizer)
    on_gpu = teacher_logprobs(Teacher(copy.deepcopy(model).cuda()), batch, 4)
    assert on_gpu.device == batch.mask.device
    torch.testing.assert_close(on_gpu, teacher_logprobs(Teacher(model), batch, 4), atol=1e-4, rtol=1e-4)


def test_a_teacher_with_another_vocabulary_is_refused_naming_it(tokenizer):
    check_vocabulary(Teacher(torch.nn.Linear(1, 1), "'same'", tokenizer.get_vocab()), tokenizer)  # equal: fine
    check_vocabulary(Teacher(torch.nn.Linear(1, 1), "'unknown'", None), tokenizer)  # not known: nothing to check
    other = dict(tokenizer.get_vocab())
    swapped = sorted(other)[:2]
    other[swapped[0]], other[swapped[1]] = other[swapped[1]], other[swapped[0]]
    with pytest.raises(RunError, match=r"teacher '/models/t': its tokenizer is not the policy's \(2 tokens differ"):
        check_vocabulary(Teacher(torch.nn.Linear(1, 1), "'/models/t'", other), tokenizer)
