"""Part ``routing``: routing replay (``algorithm.routing_replay``) on a random Qwen3-MoE, on the device.

Checks:

- ``record``: the ``hf`` backend's generation of ``--prompts`` prompts times ``--group-size`` rows
  of up to ``--new-tokens`` tokens (the backend's default dtype: a bfloat16 copy where the device
  computes bfloat16) without and with the routes recorded; the overhead of recording (hooks on the
  routers and a copy of each step's experts).
- ``replay``: on that rollout, the learner's float32 forward and backward (``completion_logprobs``,
  padded and packed where packing runs) routed live and with the recorded routes forced; the
  overhead of replay, the share of tokens whose live routing differs from the sampler's
  (``routing/replay_mismatch_tokens`` of a training step at the sampling weights: the bfloat16
  sampler against the float32 learner; padded, and packed on the CPU), and the mean and max
  distance of the learner's log-probs from the sampler's (``sampling_logp``), live and replayed.
  Bound: replaying the routes does not move the log-probs further from the sampler's than live
  routing does (mean).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from common import Record, clock, free_memory, packing_available

#: The model: ``--tiny`` (and the CPU) about 0.1M parameters; on a GPU about 0.2B (8 layers of 32
#: experts, 4 per token).
SHAPES = {"tiny": dict(hidden_size=32, layers=2, experts=8, top_k=2),
          "gpu": dict(hidden_size=512, layers=8, experts=32, top_k=4)}


def run(record: Record, device: torch.device, work: Path, args: Any) -> None:
    from grpo_core.testing import build_moe_model, build_tokenizer

    tiny = args.tiny or device.type == "cpu"
    shape = SHAPES["tiny" if tiny else "gpu"]
    prompts, group = (2, 4) if tiny else (args.prompts, args.group_size)
    new_tokens = 16 if tiny else min(args.new_tokens, 256)
    record.note(shape=shape, prompts=prompts, group_size=group, new_tokens=new_tokens)
    tokenizer = build_tokenizer()
    model = build_moe_model(tokenizer, kind="qwen3-moe", **shape).to(device)
    ids = [tokenizer(f"What is {i} + {2 * i}? Think step by step.")["input_ids"] for i in range(prompts)]
    state: dict[str, Any] = {}
    record.check("record", lambda: _record(model, tokenizer, ids, group, new_tokens, device, state))
    if "rollout" in state:
        record.check("replay", lambda: _replay(model, state["rollout"], device))
    free_memory(device)


def _generate(model, tokenizer, ids, group: int, new_tokens: int, routes: bool):
    from grpo_plugins.rollout.hf import HFRollout

    from grpo_core.contracts import RolloutSetup, SamplingParams

    backend = HFRollout()
    backend.setup(RolloutSetup(model, tokenizer, record_routes=routes))
    start = time.perf_counter()
    rollout = backend.generate(ids, group, SamplingParams(max_new_tokens=new_tokens, seed=0))
    return rollout, time.perf_counter() - start


def _record(model, tokenizer, ids, group: int, new_tokens: int, device: torch.device, state: dict) -> dict:
    _generate(model, tokenizer, ids, group, new_tokens, False)  # warm-up
    plain, plain_s = _generate(model, tokenizer, ids, group, new_tokens, False)
    routed, routed_s = _generate(model, tokenizer, ids, group, new_tokens, True)
    state["rollout"] = routed
    tokens = int(routed.completion_mask.sum())
    return {"generate_s": plain_s, "generate_recorded_s": routed_s, "record_overhead": routed_s / plain_s - 1,
            "tokens": tokens, "routes_bytes": routed.routes.prompt.nbytes + routed.routes.completion.nbytes,
            "same_tokens": bool(torch.equal(plain.completion_ids, routed.completion_ids)),
            "sampling_dtype": "separate copy" if routed.sampling_logp is not None else "the policy"}


def _pass(model, rollout, packed: bool, routes, device: torch.device) -> tuple[torch.Tensor, float]:
    from grpo_core.train.learner.logprobs import completion_logprobs

    times: dict[str, float] = {}
    with clock(device, times, "s"):
        logp, _ = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                      rollout.completion_mask, packed=packed, routes=routes)
        logp.sum().backward()
    model.zero_grad(set_to_none=True)
    return logp.detach(), times["s"]


def _replay(model, rollout, device: torch.device) -> dict:
    from grpo_core.train.learner.routing import Replay

    out: dict[str, Any] = {}
    mask, ok = rollout.completion_mask, True
    # packed where train.packing: auto packs (the CPU); on a GPU the padded forward (the flex kernel's
    # compilation is the throughput part's to time)
    for packed in ([False, True] if device.type == "cpu" and packing_available() else [False]):
        name = "packed" if packed else "padded"
        _pass(model, rollout, packed, None, device)  # warm-up
        live, live_s = _pass(model, rollout, packed, None, device)
        replay = Replay(rollout.routes)
        forced, forced_s = _pass(model, rollout, packed, replay, device)
        shares = replay.tally.metrics(lambda values: list(values))
        out.update({f"forward_backward_s_{name}": live_s, f"forward_backward_replayed_s_{name}": forced_s,
                    f"replay_overhead_{name}": forced_s / live_s - 1,
                    f"mismatch_tokens_{name}": shares["routing/replay_mismatch_tokens"],
                    f"mismatch_routes_{name}": shares["routing/replay_mismatch_routes"]})
        if rollout.sampling_logp is not None:
            sampler = rollout.sampling_logp.to(live.device)
            for label, logp in (("live", live), ("replayed", forced)):
                diff = (logp - sampler).abs()[mask]
                out[f"logp_diff_{label}_mean_{name}"] = float(diff.mean())
                out[f"logp_diff_{label}_max_{name}"] = float(diff.max())
            ok = ok and out[f"logp_diff_replayed_mean_{name}"] <= out[f"logp_diff_live_mean_{name}"] * 1.01
    return {**out, "ok": ok}
