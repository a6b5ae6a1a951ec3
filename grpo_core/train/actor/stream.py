"""Prompts from a training split that streams (:class:`~grpo_core.contracts.RowStream`): rows
read once per epoch, each process reading its share, through a seeded shuffle buffer, with a
position that a checkpoint saves and a resume continues from, row for row.

Sharding: row ``i`` of the stream (counted from 0 in each epoch) belongs to process
``i % world``; a process skips the others' rows (as ``datasets.distributed.split_dataset_by_node``
does for a stream of one shard), so over the processes every row is drawn once per epoch.

Shuffling: as ``datasets.IterableDataset.shuffle(buffer_size)`` does, the process fills a
buffer with its first ``data.shuffle_buffer`` rows; each draw takes a uniformly random row of
the buffer (a numpy generator seeded with ``train.seed``, the epoch and the rank) and puts the
next row of the stream in its place; when the stream ends the buffer empties, then the next
epoch opens the stream again. With ``data.shuffle: false`` the rows come in stream order.

State: the epoch, how many rows of the stream this epoch has read, the buffer's rows and the
generator's state: plain data, so a checkpoint holds it, and a restore opens the stream again
and skips the rows read (the buffer and generator taken from the state), so the next draw is
the one the uninterrupted run made. Restoring the state the source is already in reads nothing.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import numpy as np

from grpo_core.contracts import RowStream
from grpo_core.errors import RunError
from grpo_core.spec.data import DataSlot
from grpo_core.train.actor.data import PromptSource
from grpo_core.train.experience import Prompt


class StreamingPromptSource:
    """The prompt source of a streamed training split; see the module doc. ``sharded``: each
    process draws only its own prompts (``next(n)`` returns this process's ``n``)."""

    sharded = True
    sampler = None  # prompt samplers need random access to the rows

    def __init__(self, stream: RowStream, tokenizer, slot: DataSlot, *, seed: int, max_tokens: int,
                 rank: int = 0, world: int = 1, buffer_size: int = 1000, tools: Any = None, processor: Any = None):
        self.stream = stream
        self.slot = slot
        self.seed, self.rank, self.world = seed, rank, world
        self.buffer_size = buffer_size if slot.shuffle else 1
        self._renderer = PromptSource([{}], tokenizer, slot, seed=seed, max_tokens=max_tokens, shuffle=False,
                                      tools=tools, processor=processor)
        self.epoch = 0
        self.read = 0  # rows of the stream read this epoch (every process's)
        self.buffer: list[dict] = []
        self._rows = None  # the open iterator of this epoch
        self._rng = self._generator()
        self._drawn_in_epoch = 0

    @property
    def skipped(self) -> dict[str, int]:
        return self._renderer.skipped

    def render(self, row: dict) -> Prompt | None:
        return self._renderer.render(row)

    def _generator(self) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch, self.rank])

    # ----------------------------------------------------------------- reading
    def _open(self, skip: int = 0) -> None:
        self._rows = self.stream.open()
        if skip:
            self._rows = itertools.islice(self._rows, skip, None)

    def _pull(self) -> dict | None:
        """The next row of this process's share of the stream, or None at its end."""
        if self._rows is None:
            self._open(self.read)
        for row in self._rows:
            index = self.read
            self.read += 1
            if index % self.world == self.rank:
                if not isinstance(row, dict):
                    raise RunError(f"data: {self.stream.name} yielded a {type(row).__name__}, not a row (a dict of "
                                   "columns)")
                return row
        return None

    def _fill(self) -> None:
        while len(self.buffer) < self.buffer_size:
            row = self._pull()
            if row is None:
                return
            self.buffer.append(row)

    def _draw_row(self) -> dict:
        self._fill()
        if not self.buffer:  # the epoch is over: the next one reads the stream again
            if self._drawn_in_epoch == 0 and self.read == 0:
                raise RunError(f"data: {self.stream.name} has no rows")
            if self._drawn_in_epoch == 0:
                raise RunError(f"data: {self.stream.name} has no rows for process {self.rank} of {self.world} "
                               f"({self.read} rows in all): give at least {self.world}")
            self.epoch, self.read, self._drawn_in_epoch = self.epoch + 1, 0, 0
            self._rows, self._rng = None, self._generator()
            self._fill()
        i = int(self._rng.integers(len(self.buffer)))
        row = self.buffer[i]
        replacement = self._pull()
        if replacement is None:
            self.buffer[i] = self.buffer[-1]
            self.buffer.pop()
        else:
            self.buffer[i] = replacement
        self._drawn_in_epoch += 1
        return row

    def next(self, n: int) -> list[Prompt]:
        """This process's next ``n`` usable prompts, unusable rows skipped (and counted)."""
        out: list[Prompt] = []
        misses = 0
        while len(out) < n:
            prompt = self.render(self._draw_row())
            if prompt is None:
                misses += 1
                if misses > 10_000 and not out:
                    raise RunError(f"data: no usable prompt in {misses} rows of {self.stream.name} "
                                   f"(skipped: {self.skipped})")
                continue
            out.append(prompt)
        return out

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {"stream": True, "epoch": self.epoch, "read": self.read, "drawn": self._drawn_in_epoch,
                "buffer": list(self.buffer), "rng": self._rng.bit_generator.state,
                "skipped": dict(self.skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state.get("stream"):
            raise RunError("--resume: the checkpoint's training data was held in memory, but this run streams it "
                           "(data options changed): resume with the spec the run started with")
        epoch, read = int(state["epoch"]), int(state["read"])
        if (epoch, read) != (self.epoch, self.read) or self._rows is None:
            self._rows = None  # opened again on the next read, skipping the rows read before
        self.epoch, self.read, self._drawn_in_epoch = epoch, read, int(state.get("drawn", 0))
        self.buffer = copy.deepcopy(state["buffer"])
        self._rng = np.random.default_rng()
        self._rng.bit_generator.state = state["rng"]
        self._renderer.skipped = dict(state.get("skipped", {}))
