"""The ``export`` section of a spec: what the run writes next to the final model, and the
optional upload to the Hugging Face Hub."""

from __future__ import annotations

from pydantic import Field, field_validator

from grpo_core.spec.slots import Section


class PushToHubSection(Section):
    """Upload the final model to the Hugging Face Hub at the end of the run (huggingface_hub;
    log in first with `hf auth login` or set HF_TOKEN)."""

    repo_id: str = Field(description="Hub repository, 'user/name' or 'org/name' (created when missing).")
    private: bool = Field(True, description="Create the repository private (the Hub's own default is public).")
    revision: str | None = Field(
        None, min_length=1, description="Branch to push to (created when missing); default: main."
    )
    commit_message: str = Field("Upload a model trained with grpo-core (GRPO)", min_length=1,
                                description="Commit message of the upload.")

    @field_validator("repo_id")
    @classmethod
    def _repo_id(cls, value: str) -> str:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(value)
        except HFValidationError as exc:
            raise ValueError(f"not a valid Hub repository id ('user/name'): {exc}") from None
        return value


class ExportSection(Section):
    """What the run writes next to the final model in <output_dir>/final."""

    merged: bool = Field(
        False, description="With model.lora: also write final/merged, the adapter folded into the base "
        "weights, a plain transformers model that loads without peft."
    )
    model_card: bool = Field(
        True, description="Write final/README.md, a Hugging Face model card: base model, spec, steps, "
        "held-out scores."
    )
    push_to_hub: PushToHubSection | None = Field(
        None, description="Upload final/merged (when written) or final/ to the Hub; unset: no upload."
    )
