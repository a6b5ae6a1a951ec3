"""Tiny models and tokenizers built offline, for tests and for trying a plugin quickly.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained in memory on
a small corpus of arithmetic and chat text, and the model is a randomly initialised
Llama of a few thousand parameters.

    python -m grpo_core.testing DIR     # writes a tiny model and tokenizer to DIR
    python -m grpo_core.testing --vision DIR   # a tiny SmolVLM-shaped model and its processor
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


#: The mixture-of-experts families :func:`build_moe_model` builds: transformers' config and model
#: class names, and the config's name for the number of experts.
MOE_KINDS = {
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "num_experts"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "num_local_experts"),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", "num_local_experts"),
}


def build_moe_model(tokenizer, *, kind: str = "qwen3-moe", hidden_size: int = 32, layers: int = 2, experts: int = 8,
                    top_k: int = 2, seed: int = 0, **config_kwargs):
    """A tiny randomly initialised mixture-of-experts causal LM of the family ``kind`` (one
    of :data:`MOE_KINDS`): every layer a sparse block of ``experts`` experts, ``top_k`` per token;
    its routers' weights drawn at random too (transformers starts some at zero), so that tokens
    are routed differently. ``config_kwargs`` override the config."""
    import torch
    import transformers

    config_name, model_name, experts_key = MOE_KINDS[kind]
    settings = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
        max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, num_experts_per_tok=top_k, tie_word_embeddings=False, **{experts_key: experts},
    )
    if kind == "qwen3-moe":
        settings.update(moe_intermediate_size=hidden_size, decoder_sparse_step=1, norm_topk_prob=True)
    settings.update(config_kwargs)
    config = getattr(transformers, config_name)(**settings)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "router" in name or name.endswith("gate.weight"):
                param.normal_(0.0, 0.5)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_tiny_model(path: str | Path, *, kind: str = "causal-lm", seed: int = 0, **model_kwargs) -> Path:
    """Write a tiny model and its tokenizer to ``path`` (``save_pretrained`` format); ``kind``
    one of :func:`build_model`'s, or of :data:`MOE_KINDS` for a mixture-of-experts model."""
    path = Path(path)
    tokenizer = build_tokenizer()
    if kind in MOE_KINDS:
        model = build_moe_model(tokenizer, kind=kind, seed=seed, **model_kwargs)
    else:
        model = build_model(tokenizer, kind=kind, seed=seed, **model_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# --------------------------------------------------------------------------- vision-language
#: What each tiny vision-language kind's chat template writes for an image part, and the
#: special tokens its processor needs.
VISION_KINDS = {
    "qwen2-vl": ("<|vision_start|><|image_pad|><|vision_end|>",
                 ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]),
    "qwen2.5-vl": ("<|vision_start|><|image_pad|><|vision_end|>",
                   ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]),
    "smolvlm": ("<image>", ["<fake_token_around_image>", "<image>", "<global-img>"]),
    "gemma3": ("<start_of_image>", ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]),
}


def _vision_template(image_text: str) -> str:
    return (
        "{% for message in messages %}<|{{ message['role'] }}|>"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] == 'image' %}" + image_text +
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
        "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


def build_vision_processor(kind: str = "qwen2-vl", image_size: int = 56):
    """A processor for a tiny vision-language model: :func:`build_tokenizer` with the kind's
    image tokens and an image-aware chat template, plus the kind's PIL image processor.

    ``qwen2-vl`` / ``qwen2.5-vl``: Qwen2-VL's (Qwen2.5-VL's) processor, images resized to at
    most ``image_size`` pixels a side
    (14-pixel patches merged 2x2: a 56x56 image is 4 image tokens). transformers checks a
    Qwen2-VL processor's video processor against a class that needs torchvision; the processor
    is therefore assembled here without a video processor (it renders images, not videos); it
    saves as a Qwen2-VL processor, which ``AutoProcessor`` loads where torchvision is installed.
    ``gemma3``: Gemma 3's processor, each image resized to ``image_size`` square, 4 tokens.
    ``smolvlm``: Idefics3's (SmolVLM's) processor, each image resized to one ``image_size``
    tile of one token (no splitting); it saves and loads with ``AutoProcessor``.
    """
    image_text, tokens = VISION_KINDS[kind]
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[2:] + tokens})
    tokenizer.chat_template = _vision_template(image_text)
    if kind == "gemma3":
        from transformers import Gemma3Processor
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        for attribute, token in zip(("boi_token", "eoi_token", "image_token"), tokens, strict=True):
            setattr(tokenizer, attribute, token)
            setattr(tokenizer, attribute + "_id", tokenizer.convert_tokens_to_ids(token))
        images = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}, do_pan_and_scan=False)
        return Gemma3Processor(image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template,
                               image_seq_length=4)
    if kind == "smolvlm":
        from transformers import Idefics3Processor
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": image_size},
                                           max_image_size={"longest_edge": image_size})
        return Idefics3Processor(image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template,
                                 image_seq_len=1)
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

    base = Qwen2_5_VLProcessor if kind == "qwen2.5-vl" else Qwen2VLProcessor

    class ImagesOnly(base):  # saved as (and loaded back by) the kind's processor class
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = base.__name__
    processor = ImagesOnly.__new__(ImagesOnly)
    processor.image_processor = Qwen2VLImageProcessorPil(
        min_pixels=28 * 28, max_pixels=image_size * image_size, patch_size=14, merge_size=2, temporal_patch_size=2)
    processor.tokenizer, processor.video_processor = tokenizer, None
    processor.chat_template = tokenizer.chat_template
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    processor.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    return processor


def build_vision_model(processor, *, kind: str = "qwen2-vl", hidden_size: int = 64, layers: int = 2, seed: int = 0):
    """A tiny randomly initialised vision-language model for ``processor``
    (:func:`build_vision_processor` of the same ``kind``): ``Qwen2VLForConditionalGeneration``
    (a one-block vision tower, 3-D rotary positions), ``Qwen2_5_VLForConditionalGeneration``
    (a two-block tower, windowed then full attention), ``Gemma3ForConditionalGeneration`` (a
    one-layer SigLIP tower pooled to 4 tokens, sliding-window layers) or
    ``Idefics3ForConditionalGeneration``
    (SmolVLM's architecture: a one-layer SigLIP tower, a Llama language model). Head size 32."""
    import torch

    tokenizer = processor.tokenizer
    ids = dict(zip(VISION_KINDS[kind][1], tokenizer.convert_tokens_to_ids(VISION_KINDS[kind][1]), strict=True))
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                num_hidden_layers=layers, num_attention_heads=hidden_size // 32, num_key_value_heads=1,
                max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    if kind == "gemma3":
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration

        size = processor.image_processor.size["height"]
        config = Gemma3Config(
            text_config={**text, "head_dim": 32, "sliding_window": 16},
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=size, patch_size=size // 4),
            mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
            image_token_index=ids["<image_soft_token>"])
        cls = Gemma3ForConditionalGeneration
    elif kind == "smolvlm":
        from transformers import Idefics3Config, Idefics3ForConditionalGeneration

        size = processor.image_processor.max_image_size["longest_edge"]
        config = Idefics3Config(
            text_config={"model_type": "llama", **text},
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=size, patch_size=size // 2),
            scale_factor=2, image_token_id=ids["<image>"], pad_token_id=tokenizer.pad_token_id)
        cls = Idefics3ForConditionalGeneration
    else:
        from transformers import (
            Qwen2_5_VLConfig,
            Qwen2_5_VLForConditionalGeneration,
            Qwen2VLConfig,
            Qwen2VLForConditionalGeneration,
        )

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
        patches = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_heads=2)
        if kind == "qwen2.5-vl":  # windowed attention in the tower, one full-attention block
            vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=hidden_size, window_size=56,
                          fullatt_block_indexes=[1], **patches)
            config_cls, cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        else:
            vision = dict(depth=1, embed_dim=32, hidden_size=hidden_size, mlp_ratio=2, **patches)
            config_cls, cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        config = config_cls(
            text_config=text, vision_config=vision,
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    model = cls(config)
    projection = getattr(getattr(model.model, "multi_modal_projector", None), "mm_input_projection_weight", None)
    if projection is not None:  # Gemma 3 starts it at zero: random images would all look alike
        torch.nn.init.normal_(projection.data, std=0.5)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model


def save_tiny_vision_model(path: str | Path, *, seed: int = 0, **model_kwargs) -> Path:
    """Write a tiny SmolVLM-shaped model and its processor to ``path`` (what ``model.path``
    loads with transformers' auto classes; the Qwen2-VL kind's processor needs torchvision to load)."""
    path = Path(path)
    processor = build_vision_processor("smolvlm")
    build_vision_model(processor, kind="smolvlm", seed=seed, **model_kwargs).save_pretrained(path)
    processor.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m grpo_core.testing [--vision] DIR``: write a tiny model and its tokenizer (or
    processor) to DIR and print its path. A DIR that starts with ``-`` is refused (it is an
    option mistyped, or one put after ``--``): ``./-name`` says a folder of that name plainly."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m grpo_core.testing",
        description="Write a tiny random model and its tokenizer to DIR, built offline (nothing is downloaded).")
    parser.add_argument("--vision", action="store_true",
                        help="a tiny SmolVLM-shaped model and its processor instead of a text model")
    parser.add_argument("dir", metavar="DIR", help="the folder to write (created; files in it are replaced)")
    args = parser.parse_args(argv)
    if args.dir.startswith("-"):
        parser.error(f"DIR {args.dir!r} looks like an option, not a folder (write ./{args.dir} for a folder of "
                     "that name)")
    print(save_tiny_vision_model(args.dir) if args.vision else save_tiny_model(args.dir))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
