"""``SFTConfig``: the common arguments of TRL's ``SFTConfig`` for the SFT stage before GRPO.

``GRPOTrainer(..., sft_args=SFTConfig(...), sft_dataset=demos)`` runs a cold-start SFT stage
(the spec's ``sft`` section) before the GRPO steps. Each argument below maps onto one ``sft.*``
key (:data:`SFT_FIELDS`); the ones that change nothing the run computes are accepted and
ignored (:data:`SFT_IGNORED`); any other argument of TRL's ``SFTConfig`` (or a value of a
mapped one that grpo-core cannot honour) is refused by name, saying what to set instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpo_core.trl.config import TRLConfigError, world_size


def _schedule(value: Any) -> dict[str, Any]:
    name = getattr(value, "value", value)
    if name not in ("constant", "cosine", "linear", "constant_with_warmup"):
        raise ValueError(f"lr_scheduler_type={name!r}: grpo-core's SFT schedules are constant, cosine and linear "
                         "(each after warmup_steps); instead: one of those")
    return {"schedule": "constant" if name == "constant_with_warmup" else name}


def _steps(value: Any) -> dict[str, Any]:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"max_steps={value!r}: the SFT stage counts optimizer steps; instead: max_steps >= 1 "
                         "(num_train_epochs is not read)")
    return {"steps": value}


def _completion_only(value: Any) -> dict[str, Any]:
    if value is False:
        raise ValueError("completion_only_loss=False: the SFT stage trains the completion tokens only (the prompt "
                         "is context); instead: None or True")
    return {}


def _assistant_only(value: Any) -> dict[str, Any]:
    return {"completion_column": None, "messages_column": "messages"} if value else {}


def _packing(value: Any) -> dict[str, Any]:
    if value:
        raise ValueError("packing=True: the SFT stage packs as the GRPO learner does, one padding-free sequence per "
                         "micro-batch with attention that never crosses rows; instead: train.packing (shared with "
                         "GRPO) in overrides")
    return {}


def _eval_steps(value: Any) -> dict[str, Any]:
    return {} if value is None else {"eval_every": int(value)}


def _key(name: str) -> Callable[[Any], dict[str, Any]]:
    return lambda value: {name: value}


#: TRL ``SFTConfig`` argument -> (the ``sft`` keys it sets, its converter).
SFT_FIELDS: dict[str, tuple[str, Callable[[Any], dict[str, Any]]]] = {
    "learning_rate": ("sft.lr", _key("lr")),
    "max_steps": ("sft.steps", _steps),
    "weight_decay": ("sft.weight_decay", _key("weight_decay")),
    "warmup_steps": ("sft.warmup_steps", _key("warmup_steps")),
    "lr_scheduler_type": ("sft.schedule", _schedule),
    "max_length": ("sft.max_length", _key("max_length")),
    "eval_steps": ("sft.eval_every", _eval_steps),
    "completion_only_loss": ("(always)", _completion_only),
    "assistant_only_loss": ("sft.messages_column: messages", _assistant_only),
    "packing": ("train.packing", _packing),
    # per_device_train_batch_size and gradient_accumulation_steps: see SFTConfig.sft_data
    "per_device_train_batch_size": ("sft.micro_batch_size, sft.batch_size", _key("micro_batch_size")),
    "gradient_accumulation_steps": ("sft.batch_size", lambda value: {}),
}

#: Arguments accepted whatever their value: where the run writes and logs is GRPOTrainer's
#: (its GRPOConfig), and these change nothing the SFT stage computes.
SFT_IGNORED = frozenset({"output_dir", "logging_steps", "report_to", "run_name", "save_steps", "save_total_limit",
                         "logging_dir", "disable_tqdm", "dataset_num_proc", "eval_strategy", "save_strategy",
                         "logging_strategy", "per_device_eval_batch_size"})

#: TRL SFTConfig arguments with a different meaning here, and what to use instead.
SFT_REFUSED = {
    "num_train_epochs": "max_steps",
    "dataset_text_field": "prompt + completion rows (a language-modelling loss on raw text is not trained)",
    "seed": "train.seed (GRPOConfig's seed), which seeds both stages",
    "bf16": "GRPOConfig's bf16 (train.mixed_precision, shared by both stages)",
    "fp16": "GRPOConfig's fp16 (train.mixed_precision, shared by both stages)",
    "gradient_checkpointing": "GRPOConfig's gradient_checkpointing (model.gradient_checkpointing)",
    "max_grad_norm": "GRPOConfig's max_grad_norm (train.max_grad_norm, shared by both stages)",
    "neftune_noise_alpha": "nothing: NEFTune is not implemented",
    "padding_free": "train.packing in overrides",
    "model_init_kwargs": "GRPOTrainer's model (one model for both stages)",
}


class SFTConfig:
    """The arguments of TRL's ``SFTConfig`` for the SFT stage (see the module doc); TRL's defaults
    for those left out. Raises :class:`TRLConfigError` naming every argument it cannot honour."""

    def __init__(self, output_dir: str | None = None, **fields: Any):
        problems = []
        for name, value in fields.items():
            if name in SFT_FIELDS or name in SFT_IGNORED:
                continue
            if name in SFT_REFUSED:
                problems.append(f"{name}={value!r}: not read by the SFT stage; instead: {SFT_REFUSED[name]}")
            else:
                known = ", ".join(sorted(SFT_FIELDS))
                problems.append(f"{name}: not an SFTConfig argument the SFT stage maps (it maps {known}); set the "
                                "sft.* key it stands for in GRPOTrainer(overrides=...)")
        self.values = dict(fields)
        self.output_dir = output_dir
        try:
            self._converted = self._convert()
        except TRLConfigError as exc:
            problems += exc.problems
        if problems:
            raise TRLConfigError(problems, "SFTConfig")

    def _convert(self) -> dict[str, Any]:
        out: dict[str, Any] = {"lr": 2e-5, "schedule": "linear", "max_length": 1024}  # TRL's defaults
        problems = []
        for name, value in self.values.items():
            if name in SFT_FIELDS:
                try:
                    out.update(SFT_FIELDS[name][1](value))
                except ValueError as exc:
                    problems.append(str(exc))
        if "max_steps" not in self.values:
            problems.append("max_steps: required (TRL's default, -1, runs num_train_epochs, which the SFT stage does "
                            "not read); instead: max_steps >= 1")
        per_device = int(self.values.get("per_device_train_batch_size", 8))
        accumulation = int(self.values.get("gradient_accumulation_steps", 1))
        out["batch_size"] = per_device * accumulation * world_size()
        out["micro_batch_size"] = per_device
        if problems:
            raise TRLConfigError(problems, "SFTConfig")
        return out

    def sft_data(self) -> dict[str, Any]:
        """The spec's ``sft`` section (without its ``data``, which the demonstrations give)."""
        return dict(self._converted)
