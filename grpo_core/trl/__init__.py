"""A front door for TRL users: ``from grpo_core.trl import GRPOConfig, GRPOTrainer``.

A script written for TRL 1.16's ``GRPOTrainer`` runs on grpo-core with that one import
changed. :class:`GRPOConfig` takes TRL's fields with TRL's defaults and maps each onto the
spec key that computes the same thing (:data:`FIELDS`, the table ``docs/coming-from-trl.md``
is generated from), or refuses it naming what to use instead; :class:`GRPOTrainer` takes
TRL's arguments and runs the resulting spec with :class:`grpo_core.Trainer`.

Its modules: ``config`` (``GRPOConfig``), ``trainer`` (``GRPOTrainer``), ``table`` (what one
field entry is), ``grpo_fields`` (the fields TRL's ``GRPOConfig`` adds) and
``training_fields`` (those it inherits from ``transformers.TrainingArguments``), ``sft``
(``SFTConfig``: TRL's ``SFTConfig`` arguments for an SFT stage before GRPO,
``GRPOTrainer(sft_args=..., sft_dataset=...)``), and ``tool_loop`` (TRL's tool loop as an
agent, for ``GRPOTrainer(tools=..., environment_factory=...)``).
"""

from grpo_core.trl.config import FIELDS, GRPOConfig, TRLConfigError
from grpo_core.trl.sft import SFTConfig

__all__ = ["FIELDS", "GRPOConfig", "GRPOTrainer", "SFTConfig", "TRLConfigError"]


def __getattr__(name: str):
    if name == "GRPOTrainer":
        from grpo_core.trl.trainer import GRPOTrainer

        return GRPOTrainer
    raise AttributeError(f"module 'grpo_core.trl' has no attribute {name!r}")
