"""The spec's ``data`` section: the task's dataset, more datasets joining it (a mixture, each
labelled in a source column) and the prompt sampler that draws the training rows."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from grpo_core.spec.slots import Slot


class SamplerSlot(Slot):
    """Which training rows are drawn: a prompt sampler plugin (e.g. curriculum)."""

    kind = "prompt_sampler"


class SourceSlot(Slot):
    """One more dataset whose rows join the task's, labelled in data.source_column."""

    kind = "dataset"
    source: str = Field(min_length=1, description="Its rows' value in data.source_column (e.g. code).")


class DataSlot(Slot):
    """The task: a dataset plugin and how its rows become prompts."""

    kind = "dataset"
    name: str = Field("arithmetic", description="Dataset plugin to use.")
    prompt_column: str = Field("prompt", description="Column holding the prompt: a string or chat messages.")
    system_prompt: str | None = Field(
        None, description="A system message put before every conversational prompt."
    )
    chat_template: bool = Field(
        True,
        description="Apply the tokenizer's chat template to conversational prompts (lists of "
        "messages). Plain string prompts are always used as they are.",
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Prompts longer than this are skipped and counted; default: no limit "
        "below the model's context."
    )
    shuffle: bool = Field(True, description="Shuffle the training rows (seeded by train.seed) every epoch.")
    shuffle_buffer: int = Field(
        1000, ge=1, description="For a training split that streams (e.g. hf with streaming: true): rows each "
        "process holds in its shuffle buffer; a draw takes a random one and the next row of the stream takes its "
        "place (a larger buffer shuffles more widely). Rows held in memory are shuffled whole instead."
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keyword arguments of the tokenizer's apply_chat_template, which its "
        "template reads as variables, e.g. {enable_thinking: false} for Qwen3.",
    )
    as_user_message: bool = Field(
        False,
        description="Send a plain-string prompt as one user message (after system_prompt), so that "
        "the chat template applies; for datasets whose prompt column is text, e.g. GSM8K's question.",
    )
    image_column: str | None = Field(
        None, min_length=1,
        description="Column holding each row's image(s): a path to an image file (relative to the working "
        "directory), a PIL image, a datasets.Image value, or a list of them. The model must be an "
        "image-text-to-text one with a processor: prompts are rendered by the processor's chat template, "
        "the images first in the first user message unless the prompt's messages place image parts "
        "themselves (a string prompt is sent as a user message). Images are loaded and checked when the "
        "data loads. Rewards see the column as it is.",
    )
    max_image_pixels: int | None = Field(
        None, ge=1,
        description="With image_column: an image of more pixels (width x height) is refused when the data loads, "
        "from its header, naming its row and file: a small file that decodes to a huge image (a decompression "
        "bomb: 110 kB of PNG can hold 30000 x 30000 pixels, 2.7 GB in RGB) would exhaust the run's memory. "
        "Unset: Pillow's own limit (twice PIL.Image.MAX_IMAGE_PIXELS, 178,956,970 pixels by default). Raise it "
        "for data you trust that holds larger images.",
    )
    source_column: str | None = Field(
        None, min_length=1, description="Column naming each row's source (a mixture of datasets): rewards may "
        "score only some sources (their `sources`) and each step logs the reward per source (reward/source/<name>)."
    )
    source: str | None = Field(
        None, min_length=1, description="This dataset's rows' value in source_column (set for each row); unset: "
        "the rows' own column."
    )
    more_sources: list[SourceSlot] = Field(
        default_factory=list, description="More datasets whose rows join this one's (train and eval splits), "
        "each {name: <dataset>, source: <label>, ...its options}; rendered as this one's (prompt_column...)."
    )
    sampler: SamplerSlot | None = Field(
        None, description="A prompt sampler that chooses the training rows (e.g. {name: curriculum}); unset: "
        "every row once per epoch, in a seeded shuffle (see shuffle)."
    )

    @model_validator(mode="after")
    def _labelled_sources(self):
        _check_sources(self)
        return self


def _check_sources(data: DataSlot) -> None:
    """Labels need the column, and name each dataset once."""
    labelled = data.source is not None or data.more_sources
    if labelled and data.source_column is None:
        raise ValueError("data.source and data.more_sources label rows in data.source_column: set it (e.g. source)")
    labels = [data.source] + [m.source for m in data.more_sources] if data.more_sources else []
    if data.more_sources and data.source is None:
        raise ValueError("data.more_sources: set data.source too, the label of the main dataset's rows")
    if len(set(labels)) != len(labels):
        raise ValueError(f"data.source and data.more_sources[].source must differ, got {labels}")
