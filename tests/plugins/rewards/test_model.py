"""The ``reward_model`` reward against a direct forward of a tiny sequence-classification model:
chat templates, truncation that keeps the end, a missing path, the options."""

from __future__ import annotations

import re

import pytest
import torch
from grpo_plugins.rewards.model import RewardModelOptions, RewardModelReward
from pydantic import ValidationError

from grpo_core.errors import RunError

from .conftest import chat


def _tiny_reward_model(tokenizer):
    from grpo_core.testing import build_model

    try:
        return build_model(tokenizer, kind="sequence-classification")
    except AttributeError:
        # grpo_core.testing sets generation_config, which a transformers 5
        # sequence-classification model lacks; build the same tiny Llama here.
        from transformers import LlamaConfig, LlamaForSequenceClassification

        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id, num_labels=1,
        )
        torch.manual_seed(0)
        return LlamaForSequenceClassification(config)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from grpo_core.testing import build_tokenizer

    path = tmp_path_factory.mktemp("reward-model")
    tokenizer = build_tokenizer()
    model = _tiny_reward_model(tokenizer).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def _direct_score(model, tokenizer, text: str, add_special_tokens: bool = True) -> float:
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens)
    with torch.no_grad():
        return float(model(**ids).logits[0, 0])


def test_reward_model_scores_equal_a_direct_forward(reward_model_dir):
    path, model, tokenizer = reward_model_dir
    reward = RewardModelReward(RewardModelOptions(path=str(path), batch_size=2))
    assert reward._model is None  # loads lazily, on the first call
    prompts = ["What is 1 + 2? ", "What is 1 + 2? ", "What is 30 + 4? "]
    completions = ["3", "It is 4, I think.", "34"]
    scores = reward(prompts, completions, answer=["3", "3", "34"], completion_ids=[[1]] * 3)
    expected = [_direct_score(model, tokenizer, p + c) for p, c in zip(prompts, completions)]
    assert all(isinstance(s, float) for s in scores)
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 6) for s in scores)) == 3  # really per completion


def test_reward_model_applies_the_chat_template_to_conversations(reward_model_dir):
    path, model, tokenizer = reward_model_dir
    reward = RewardModelReward(RewardModelOptions(path=str(path), batch_size=8))
    prompts = [[{"role": "user", "content": "What is 1 + 2?"}]] * 2
    completions = [chat("3"), chat("The answer is 4.")]
    scores = reward(prompts, completions)
    expected = [
        _direct_score(model, tokenizer, "<|user|>What is 1 + 2?<|end|>\n<|assistant|>" + text
                      + "<|end|>\n", add_special_tokens=False)
        for text in ("3", "The answer is 4.")
    ]
    assert scores == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize(("option", "plain", "templated"), [(None, True, False), (False, False, False),
                                                          (True, True, True)])
def test_reward_model_special_tokens_follow_the_option(reward_model_dir, option, plain, templated):
    """null: special tokens on plain text only (the chat template writes its own); false: never
    (TRL's GRPOTrainer); true: always. The test tokenizer adds none, so the call is watched."""
    path, _, _ = reward_model_dir
    reward = RewardModelReward(RewardModelOptions(path=str(path), add_special_tokens=option))
    reward(["1 + 2 = "], ["3"])  # loads the model
    seen = []
    tokenizer = reward._tokenizer

    class Spy:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, texts, **kwargs):
            seen.append(kwargs["add_special_tokens"])
            return tokenizer(texts, **kwargs)

    reward._tokenizer = Spy()
    reward(["1 + 2 = "], ["3"])
    reward([[{"role": "user", "content": "1 + 2?"}]], [chat("3")])
    assert seen == [plain, templated]


def test_reward_model_truncation_keeps_the_end(reward_model_dir):
    path, model, tokenizer = reward_model_dir
    text = "What is 12 + 7? Think step by step. 12 + 7 = 19"
    ids = tokenizer(text).input_ids
    reward = RewardModelReward(RewardModelOptions(path=str(path), max_length=5))
    with torch.no_grad():
        tail = float(model(input_ids=torch.tensor([ids[-5:]])).logits[0, 0])
    assert reward([text[:10]], [text[10:]]) == [pytest.approx(tail, abs=1e-5)]


def test_reward_model_missing_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    reward = RewardModelReward(RewardModelOptions(path=str(missing)))
    with pytest.raises(RunError, match=re.escape(repr(str(missing)))):
        reward(["q"], ["a"])


def test_reward_model_options_say_what_is_valid():
    with pytest.raises(ValidationError, match="'auto', 'bfloat16', 'float16' or 'float32'"):
        RewardModelOptions(path="m", dtype="fp8")
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        RewardModelOptions(path="m", batch_size=0)
    assert RewardModelOptions(path="m").trust_remote_code is False
