"""Checks of a spec that read the components its slots resolved to, so that what a run would
refuse once started is a spec error at validation (``grpo-run validate``, exit 2) instead.

- A training split that streams: a dataset whose options model has a ``streaming`` field set
  to true (the ``file`` and ``hf`` datasets' ``streaming: true``) hands its rows over as a
  stream, which what draws rows by index or joins them in memory cannot take (a prompt
  sampler, a mixture, iterative GRPO, images, the SFT stage's demonstrations).
- Partial rollouts (``rollout.partial_rollouts``): the rollout backend must be able to stop
  mid-generation and return each token's own sampler log-prob (what its capabilities say),
  and the run must be one process (:func:`world_problems`, once the process count is known).
- Routing replay (``algorithm.routing_replay``): the rollout backend must record the experts each
  token was routed to (what its capabilities say).
"""

from __future__ import annotations

from typing import Any

from grpo_core.spec.slots import Slot

Problem = tuple[tuple, str]


def streams(slot: Slot | None) -> bool:
    """Whether the dataset of ``slot`` streams its training split (its options' ``streaming``)."""
    options = None if slot is None else slot.options
    return options is not None and "streaming" in type(options).model_fields and options.streaming is True


def streaming_problems(spec: Any) -> list[Problem]:
    """What a streamed training split (``data`` with ``streaming: true``) cannot take, each at
    its path; a streamed source of a mixture and streamed SFT demonstrations likewise."""
    data, problems = spec.data, []
    for i, more in enumerate(data.more_sources):
        if streams(more):
            problems.append((("data", "more_sources", i, "streaming"),
                             f"dataset '{more.name}' would stream its training rows, which a mixture cannot take "
                             "(it joins the sources' rows in memory): set its streaming: false"))
    if spec.sft is not None and streams(spec.sft.data):
        problems.append((("sft", "data", "streaming"), f"dataset '{spec.sft.data.name}' would stream the "
                         "demonstrations; the SFT stage reads them into memory: set sft.data.streaming: false"))
    if not streams(data):
        return problems
    needs = [(("data", "more_sources"), data.more_sources, "a mixture (data.more_sources) joins rows in memory"),
             (("data", "sampler"), data.sampler, f"data.sampler '{data.sampler.name if data.sampler else ''}' "
                                                 "draws rows by index from the whole training split"),
             (("iterative",), spec.iterative, "iterative GRPO draws its reward-model prompts on every process"),
             (("data", "image_column"), data.image_column, "images (data.image_column) are loaded and checked "
                                                           "with the rows")]
    for path, given, why in needs:
        if given:
            problems.append((path, f"dataset '{data.name}' streams its training rows (data.streaming: true), and "
                                   f"{why}: drop {'.'.join(path)}, or set data.streaming: false"))
    return problems


def _capabilities(spec: Any) -> Any:
    """What the spec's rollout backend declares it can do (built, not set up)."""
    return spec.rollout.build().capabilities


def partial_rollout_problems(spec: Any) -> list[Problem]:
    """``rollout.partial_rollouts`` on a backend that cannot stop mid-generation, or that
    generates with the policy module (whose log-probs are computed after the batch, with one
    version)."""
    rollout = spec.rollout
    if not rollout.partial_rollouts:
        return []
    can = _capabilities(spec)
    where = ("rollout", "partial_rollouts")
    if not can.interruptible:
        return [(where, f"rollout backend '{rollout.name}' cannot stop mid-generation; use rollout.name: vllm or "
                        "vllm-server, or partial_rollouts: false")]
    if can.generates_with_policy:
        return [(where, f"rollout backend '{rollout.name}' generates with the policy module, whose sampler "
                        "log-probs the pipeline computes after the batch with one version; partial rollouts need a "
                        "backend that returns each token's own (vllm, vllm-server)")]
    return []


def routing_replay_problems(spec: Any) -> list[Problem]:
    """``algorithm.routing_replay`` on a backend that does not record the experts each token was
    routed to (its capabilities' ``records_routes``), with the backend's reason when it gives one
    (``routes_refusal``)."""
    if not spec.algorithm.routing_replay:
        return []
    can = _capabilities(spec)
    if can.records_routes:
        return []
    why = f": {can.routes_refusal}." if can.routes_refusal else "."
    return [(("algorithm", "routing_replay"), f"rollout backend '{spec.rollout.name}' does not record the experts "
             f"each token was routed to{why} Use rollout.name: hf, or routing_replay: false")]


def resolved_problems(spec: Any) -> list[Problem]:
    """Every problem of this module's checks that needs no process count."""
    return streaming_problems(spec) + partial_rollout_problems(spec) + routing_replay_problems(spec)


def world_problems(spec: Any, world: int) -> list[str]:
    """What ``spec`` cannot do on ``world`` processes, as spec problems (``spec.<path>: ...``)."""
    if world > 1 and spec.rollout.partial_rollouts:
        return [f"spec.rollout.partial_rollouts: runs in one process only ({world} were asked for): set "
                "partial_rollouts: false or run one process"]
    size = spec.train.parallel.sequence
    if size > 1 and world % size:
        return [f"spec.train.parallel.sequence: {size} must divide the number of processes ({world}): each "
                "sequence is split over that many of them"]
    return []
