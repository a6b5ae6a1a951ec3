"""Partial rollouts (``rollout.partial_rollouts``), engine-neutral: what a backend whose engine
continues a request from a prefix (``vllm``, ``vllm-server``) keeps of each completion while a
weight update interrupts it, and how it continues.

A completion is a list of segments, each sampled with one policy version. When newer weights
wait (:class:`~grpo_core.contracts.WeightSwitch`), the backend stops every unfinished
completion (the colocated engine aborts its requests; a server is paused with vLLM's
``/pause?mode=abort``, which ends them with ``finish_reason: "abort"`` and the tokens so far),
keeps what each has sampled, takes the weights and sends each unfinished completion again as
one request: its prompt followed by its tokens so far, ``max_tokens`` what is left of its
budget. The engine computes that prefix's keys and values again with the new weights, so every
later token is sampled from exactly the new policy given the whole prefix (vLLM's ``keep``
pause mode would instead continue on keys and values of the old weights). The same approach
is AReaL's interruptible generation (Fu et al., 2025, https://arxiv.org/abs/2505.24298, section 4)
and slime's partial rollouts.

Seeds: completion ``k`` of a prompt whose request seed is ``s`` is vLLM's child ``k``
(seed ``s + k``); its continuation after ``m`` tokens is seeded with
``request_seed(s + k + m)`` (:func:`continuation_seed`), so a run with the same interruptions
draws the same tokens. A stop string that would span the cut is not seen (vLLM checks the
continuation's own text); a stop token is.

Plain Python on vLLM's output attributes: nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from grpo_plugins.rollout.outputs import Completion, Output, request_seed

__all__ = ["Completion", "PartialCompletion", "continuation_seed", "stitched_outputs", "versions_tensor"]


def continuation_seed(seed: int | None, done: int) -> int | None:
    """The seed of a completion's continuation after ``done`` tokens, from its own seed
    (``None``: unseeded)."""
    return None if seed is None else request_seed(seed + done)


@dataclasses.dataclass
class PartialCompletion:
    """Completion ``index`` of one prompt while it is generated: the tokens, sampler
    log-probs and versions of its finished segments, and the latest cumulative output of the
    segment now running (vLLM's ``CompletionOutput``, or a server's checked completion)."""

    prompt: list[int]
    index: int
    seed: int | None  # its own seed: the request's plus its index
    ids: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    segments: int = 0  # segments folded in so far
    finish_reason: str | None = None
    running: Any = None  # the running segment's latest output
    with_logps: bool = True

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def fold(self, output: Any, version: int) -> None:
        """Add ``output`` (a segment's cumulative output, sampled with ``version``) to the
        tokens kept; its finish reason ends the completion unless it is an abort."""
        ids = [int(t) for t in output.token_ids]
        entries = getattr(output, "logprobs", None)
        if entries is None:
            self.with_logps = False
        else:
            for t, token in enumerate(ids):
                entry = entries[t].get(token) if t < len(entries) else None
                if entry is None:
                    raise ValueError(f"vllm rollout: a partial completion lacks the log-prob of token {t} ({token})")
                self.logps.append(float(getattr(entry, "logprob", entry)))
        self.ids += ids
        self.versions += [version] * len(ids)
        self.segments += 1
        reason = getattr(output, "finish_reason", None)
        self.finish_reason = None if reason == "abort" else reason
        self.running = None

    def interrupt(self, version: int) -> None:
        """The running segment stops: keep what it sampled (with ``version``)."""
        if self.running is not None:
            self.fold(self.running, version)

    def rest(self, max_new_tokens: int) -> tuple[list[int], int, int | None]:
        """The continuation request: prompt plus the tokens so far, the tokens left, its seed."""
        return self.prompt + self.ids, max_new_tokens - len(self.ids), continuation_seed(self.seed, len(self.ids))

    def completion(self) -> Completion:
        logps = [{t: v} for t, v in zip(self.ids, self.logps, strict=True)] if self.with_logps else None
        return Completion(self.index, list(self.ids), self.finish_reason or "length", "", logps)


def stitched_outputs(completions: Sequence[Sequence[PartialCompletion]]) -> list[Output]:
    """One output per prompt, its completions stitched, for ``outputs_to_batch``."""
    return [Output([c.completion() for c in group]) for group in completions]


def versions_tensor(completions: Sequence[Sequence[PartialCompletion]], group_size: int, max_new_tokens: int,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """``long (B, T)``: each token's policy version, prompt-major, 0 on padding; a group of one
    greedy completion is repeated ``group_size`` times (as :func:`~grpo_plugins.vllm.io.repeat_greedy`)."""
    rows: list[list[int]] = []
    for group in completions:
        versions = [c.versions[:max_new_tokens] for c in group]
        rows += versions * group_size if len(group) == 1 and group_size > 1 else versions
    width = max((len(r) for r in rows), default=0)
    out = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out.to(device)
