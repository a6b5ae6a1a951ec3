"""The ``sft`` section: a supervised (cold-start) stage that trains the policy on demonstrations
before the GRPO steps, in the same run (DeepSeek-R1's cold start, https://arxiv.org/abs/2501.12948,
section 2.3.1; DeepSeekMath's RL starts from its SFT model, https://arxiv.org/abs/2402.03300)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from grpo_core.spec.data import DataSlot
from grpo_core.spec.slots import Section


class SftSection(Section):
    """Supervised fine-tuning before GRPO: next-token cross-entropy on the completion tokens of
    demonstrations only (the prompt, and in chat data every turn but the assistant's, are context,
    never trained), token-mean over each optimizer batch. Its own optimizer (AdamW, as train's,
    with this section's lr and schedule), the model, LoRA, parallel strategy, mixed precision and
    packing of train and model. The GRPO steps then start from its last (or best) weights."""

    data: DataSlot = Field(
        description="The demonstrations: a dataset slot as `data` (name, options, prompt_column, system_prompt, "
        "chat_template...). Its eval split gives the held-out loss."
    )
    completion_column: str | None = Field(
        "completion", description="Column holding each demonstration's answer (a string, or a list of assistant "
        "messages); trained after the prompt of data.prompt_column. null: use messages_column."
    )
    messages_column: str | None = Field(
        None, description="Column holding whole conversations (lists of chat messages): every assistant turn is "
        "trained, everything else is context. Set it instead of completion_column."
    )
    steps: int = Field(100, ge=1, description="Optimizer steps of the SFT stage.")
    batch_size: int = Field(
        8, ge=1, description="Demonstrations per optimizer step, over all processes together."
    )
    micro_batch_size: int | None = Field(
        None, ge=1, description="Demonstrations per forward/backward (gradient accumulation); null: as many as hold "
        "at most train.micro_batch_tokens positions (packed tokens when the learner packs, train.packing)."
    )
    max_length: int = Field(
        1024, ge=2, description="Longest demonstration in tokens (prompt + completion); longer ones are cut at "
        "the right, as TRL's SFTTrainer does, and counted (sft/truncated). A prompt alone that long is skipped."
    )
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate of the SFT stage.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay of the SFT stage.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up, in SFT optimizer steps.")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Learning-rate schedule after warm-up."
    )
    shuffle: bool = Field(True, description="Shuffle the demonstrations (seeded by train.seed) every epoch.")
    eval_every: int = Field(
        0, ge=0, description="Held-out loss on the eval split before the first SFT step, every N steps and after "
        "the last (logged at SFT step 0, N, 2N...); 0: after the last only (when the split has rows)."
    )
    eval_max_rows: int | None = Field(None, ge=1, description="Held-out demonstrations to use; default all.")
    eval_rewards: bool = Field(
        False, description="At each SFT evaluation also run the GRPO held-out evaluation (eval section: greedy "
        "rewards on data's eval split), logged as sft/eval/...: how the SFT checkpoints score on the RL task."
    )
    start_from: Literal["last", "best"] = Field(
        "last", description="The weights GRPO starts from: the last SFT step's, or the SFT step with the lowest "
        "held-out loss (needs eval rows)."
    )

    @model_validator(mode="after")
    def _one_format(self):
        if (self.completion_column is None) == (self.messages_column is None):
            raise ValueError("set one of sft.completion_column (prompt + completion rows) and sft.messages_column "
                             "(whole conversations); set the other to null")
        d = self.data
        unsupported = [k for k, v in (("sampler", d.sampler), ("more_sources", d.more_sources),
                                      ("image_column", d.image_column)) if v]
        if unsupported:
            raise ValueError(f"sft.data.{unsupported[0]} is not supported in the SFT stage (its demonstrations are "
                             "read in a seeded shuffle, text only): drop it")
        return self
