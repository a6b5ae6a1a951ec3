"""Opt-in part ``overlap`` (``--parts overlap``): generation and training sharing one GPU,
synchronous (``rollout.max_staleness: 0``) against ``max_staleness: 1`` without and with partial
rollouts (``rollout.partial_rollouts``), the GPU counterpart of ``bench/overlap.py``.

Each configuration is a ``grpo-run`` of the throughput part's random Qwen-shaped model (its
sizes: ``--prompts``, ``--group-size``, ``--new-tokens``) for ``--overlap-steps`` steps, on the
colocated ``vllm`` backend when vLLM imports (the engine and the learner on the one GPU; the
synchronous run with sleep mode, which frees the engine's memory while the learner trains; the
asynchronous ones without it, since the engine generates while the learner trains) and on the
``hf`` backend otherwise, where partial rollouts are skipped, saying why (``hf`` cannot stop
mid-generation). Per configuration: the median step time (first step excluded), the median
``time/generate``, the learner's wait for batches and the actor's wait for weights, the mean token
staleness, and the weight updates that reached a batch mid-generation. The held-out accuracy of a
random model says nothing, so none is reported: ``bench/overlap.py`` on a real model does.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from common import Record, free_memory, load_run_spec, run_spec, save_random_qwen
from throughput import model_folder, settings

CONFIGS = {"sync": (0, False), "async": (1, False), "partial": (1, True)}


def run(record: Record, device: torch.device, work: Path, args: Any) -> None:
    s = settings(args)
    folder = model_folder(work, args)
    backend = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    steps = getattr(args, "overlap_steps", None) or (3 if args.tiny else 8)
    record.note(backend=backend, steps=steps, settings={k: v for k, v in s.items() if k != "shape"})
    info = record.check("model", lambda: save_random_qwen(folder, s["shape"], device))
    if info["status"] != "ok":
        return
    for name, (k, partial) in CONFIGS.items():
        if partial and backend == "hf":
            record.data["checks"][name] = {
                "status": "skipped",
                "reason": "vLLM is not installed here: partial rollouts need the vllm or vllm-server backend "
                          "(hf cannot stop mid-generation)"}
            record.write()
            continue
        record.check(name, lambda k=k, partial=partial, name=name: _config(
            work / "overlap" / name, folder, device, s, backend, k, partial, steps))
        free_memory(device)
    _compare(record)


def _config(out: Path, model: Path, device: torch.device, s: dict[str, Any], backend: str, k: int, partial: bool,
            steps: int) -> dict[str, Any]:
    from grpo_core.train.loop.run import train

    rollout: dict[str, Any] = {"name": backend, "group_size": s["group"], "max_new_tokens": s["new_tokens"],
                               "max_staleness": k, "partial_rollouts": partial}
    if backend == "vllm":
        rollout.update(gpu_memory_utilization=0.3, enable_sleep_mode=device.type == "cuda" and k == 0)
    spec = run_spec(out, model, device, rollout=rollout,
                    model={"path": str(model), "tokenizer": str(model / "tokenizer")},
                    train={"steps": steps, "prompts_per_step": s["prompts"],
                           "micro_batch_tokens": s["micro_batch_tokens"]},
                    checkpoint={"every": 0, "keep": 1, "every_minutes": 0})
    loaded = load_run_spec(out, spec)
    if train(loaded) != 0:
        raise RuntimeError(f"the {'partial' if partial else 'async' if k else 'sync'} run failed; see {out / 'out'}")
    rows = [json.loads(line) for line in (out / "out" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    logged = [r for r in rows if "loss" in r]
    timed = logged[1:] or logged

    def median(key: str) -> float:
        values = [r[key] for r in timed if key in r]
        return statistics.median(values) if values else 0.0

    return {"k": k, "partial": partial, "steps": len(logged), "step_s": median("time/step"),
            "generate_s": median("time/generate"), "learner_wait_s": median("time/learner_wait"),
            "actor_wait_s": median("time/actor_wait"),
            "token_staleness": statistics.mean(r.get("async/token_staleness", r.get("async/staleness", 0.0))
                                               for r in logged) if k else 0.0,
            "switches": sum(r.get("async/switches", 0.0) for r in logged)}


def _compare(record: Record) -> None:
    checks = record.data["checks"]
    sync = checks.get("sync", {}).get("step_s")
    for name in ("async", "partial"):
        mine = checks.get(name, {})
        if sync and mine.get("step_s"):
            mine["speedup_vs_sync"] = round(sync / mine["step_s"], 3)
    record.write()
