"""Tiny models and tokenizers built offline, for tests and for trying a plugin quickly.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained in memory on
a small corpus of arithmetic and chat text, and the model is a randomly initialised
Llama of a few thousand parameters.

    python -m grpo_core.testing DIR     # writes a tiny model and tokenizer to DIR
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def _corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = [
        "What is the answer? The answer is 42.",
        "Think step by step. Answer with a number only.",
        "Solve: compute the sum, then give the final answer in \\boxed{}.",
        "You are a helpful assistant.",
    ]
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(f"What is {a} + {b}? {a} + {b} = {a + b}\n\\boxed{{{a + b}}}")
        lines.append(f"{a} * {b} = {a * b}\n{a} - {b} = {a - b}")
    return lines


def build_tokenizer(vocab_size: int = 320):
    """A ``PreTrainedTokenizerFast`` (byte-level BPE) with a chat template, pad and EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def build_model(
    tokenizer, *, hidden_size: int = 32, layers: int = 2, seed: int = 0, kind: str = "causal-lm", tied: bool = False
):
    """A tiny randomly initialised Llama sized to ``tokenizer``; ``tied``: the output layer
    shares the input embeddings' weight (as SmolLM2 and small Qwen models do).

    ``kind`` is ``causal-lm`` (``LlamaForCausalLM``) or ``sequence-classification``
    (``LlamaForSequenceClassification`` with one label, a scalar reward model) or
    ``token-classification`` (two labels per token, a process reward model).
    """
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
        LlamaForTokenClassification,
    )

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=tied,
    )
    classes = {
        "causal-lm": (LlamaForCausalLM, {}),
        "sequence-classification": (LlamaForSequenceClassification, {"num_labels": 1}),
        "token-classification": (LlamaForTokenClassification, {"num_labels": 2}),
    }
    cls, extra = classes[kind]
    for key, value in extra.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = cls(config)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_tiny_model(path: str | Path, *, kind: str = "causal-lm", seed: int = 0, **model_kwargs) -> Path:
    """Write a tiny model and its tokenizer to ``path`` (``save_pretrained`` format)."""
    path = Path(path)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, kind=kind, seed=seed, **model_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


if __name__ == "__main__":  # pragma: no cover
    if len(sys.argv) != 2:
        sys.exit("usage: python -m grpo_core.testing DIR")
    print(save_tiny_model(sys.argv[1]))
