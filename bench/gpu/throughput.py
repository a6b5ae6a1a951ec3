"""Part 2, throughput at a realistic size: a Qwen2.5-0.5B-shaped model (random weights, built
from its config), ``P`` prompts of ``--prompt-tokens`` token ids, ``G`` completions of up to
``--new-tokens`` tokens, float32 master weights with bf16 autocast (``train.mixed_precision:
bf16``), the ``hf`` backend at its defaults (a bfloat16 generation copy on a GPU). Everything
goes through the engine as grpo-run builds it (``build_run`` from a spec).

- ``generation``: one ``generate`` call of the rollout backend for the whole step (after a
  short warm-up call): generated tokens per second, model FLOPs utilisation, peak memory.
- ``learner_<mode>``: one update (forward, backward, AdamW step) of the generated batch and of
  a long-tailed one (most completions short, one in 16 at the limit: where padding costs), for
  each mode: ``padded`` and ``packed`` when this build has ``train.packing`` (``packed``: on a
  GPU, one ``flex_attention`` call per layer where the build has it), plus ``packed_segments``
  (the per-segment attention, one call per prompt and per completion in each layer) on a GPU
  where the build has both, else the one learner there is. The first update of each batch is a
  warm-up (its loss and gradient norm are recorded: padded and packed start from the same
  weights, so they should agree within bf16 rounding); then ``--repeats`` timed ones (median).

Token ids are fed directly: a random model's tokens carry no text. The tokenizer
(:func:`common.wide_tokenizer`) maps every id of the 151936 to a word, so completions decode
and the special ids are those of the tiny test tokenizer.
"""

from __future__ import annotations

import contextlib
import statistics
from functools import partial
from pathlib import Path
from typing import Any

import torch
from common import (
    QWEN25_05B,
    TINY_QWEN,
    Dims,
    Record,
    batch_flops,
    clock,
    first_word_id,
    free_memory,
    load_run_spec,
    packing_available,
    peak_memory,
    peak_tflops,
    reset_peak,
    run_spec,
    save_random_qwen,
)


def settings(args: Any) -> dict[str, Any]:
    """The benchmark's sizes: the issue's on a GPU, a few tokens of the tiny Qwen2 on the CPU."""
    if args.tiny:
        return {"shape": TINY_QWEN, "prompts": 2, "group": 4, "new_tokens": 16, "prompt_tokens": 8,
                "micro_batch_tokens": 256, "repeats": 1}
    return {"shape": QWEN25_05B, "prompts": args.prompts, "group": args.group_size, "new_tokens": args.new_tokens,
            "prompt_tokens": args.prompt_tokens, "micro_batch_tokens": args.micro_batch_tokens,
            "repeats": args.repeats}


def model_folder(work: Path, args: Any) -> Path:
    return work / ("qwen-tiny" if args.tiny else "qwen2.5-0.5b-random")


def prompt_ids(s: dict[str, Any], seed: int = 0) -> list[list[int]]:
    """``P`` prompts of ``prompt_tokens`` ordinary word ids (the same for every tool)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(first_word_id(), s["shape"]["vocab_size"], (s["prompts"], s["prompt_tokens"]), generator=gen)
    return ids.tolist()


def run(record: Record, device: torch.device, work: Path, args: Any) -> None:
    s = settings(args)
    folder = model_folder(work, args)
    record.note(settings={k: v for k, v in s.items() if k != "shape"}, shape=s["shape"],
                peak_tflops=peak_tflops(device, args.peak_tflops))
    info = record.check("model", lambda: save_random_qwen(folder, s["shape"], device))
    if info["status"] != "ok":
        return
    modes = [("padded", "false"), ("packed", "true")] if packing_available() else [("default", None)]
    if packing_available() and _has_flex() and device.type == "cuda":  # on a CPU both packed modes are one
        modes.append(("packed_segments", "true"))
    record.note(packing="available" if modes[0][1] is not None else "packing not available in this build")
    batches: dict[str, Any] = {}
    for index, (mode, packing) in enumerate(modes):
        with _cuda_attention("segments" if mode == "packed_segments" else None):
            _mode(record, device, work, folder, s, args, mode, packing, batches, generate=index == 0)
        free_memory(device)
    _compare_modes(record)


@contextlib.contextmanager
def _cuda_attention(name: str | None):
    """The packed attention pack_rows picks on CUDA set to ``name`` inside (None: as it is)."""
    if name is None:
        yield
        return
    from grpo_core.train.learner import packing

    saved, packing.CUDA_ATTENTION = packing.CUDA_ATTENTION, name
    try:
        yield
    finally:
        packing.CUDA_ATTENTION = saved


def _has_flex() -> bool:
    """Whether this build packs with flex_attention on GPUs (grpo_core's packing.CUDA_ATTENTION)."""
    from grpo_core.train.learner import packing

    return hasattr(packing, "CUDA_ATTENTION")


def _mode(record: Record, device: torch.device, work: Path, folder: Path, s: dict[str, Any], args: Any, mode: str,
          packing: str | None, batches: dict[str, Any], generate: bool) -> None:
    """One learner mode, from a fresh load of the model: the generation first (``generate``:
    the first mode's, whose batch every mode then trains on), then each batch's updates."""
    overrides = [] if packing is None else [f"train.packing={packing}"]
    holder: dict[str, Any] = {}
    if record.check(f"build_{mode}", partial(_build, holder, work, folder, device, s, overrides))["status"] != "ok":
        return
    run = holder.pop("run")
    if generate:
        record.check("generation", partial(_generation, run, device, s, args, batches))
        batches["long_tailed"] = _long_tailed(s, device)
    for name, batch in batches.items():
        record.check(f"learner_{mode}_{name}", partial(_learner, run, device, batch, s, args))


def _build(holder: dict[str, Any], work: Path, folder: Path, device: torch.device, s: dict[str, Any],
           overrides: list[str]) -> dict[str, Any]:
    from grpo_core.train.loop.assemble import build_run

    spec = run_spec(
        work / "throughput-run", folder, device,
        model={"path": str(folder), "tokenizer": str(folder / "tokenizer")},
        rollout={"group_size": s["group"], "max_new_tokens": s["new_tokens"]},
        train={"steps": 1, "prompts_per_step": s["prompts"], "lr": 1e-6, "mixed_precision": "bf16",
               "micro_batch_tokens": s["micro_batch_tokens"]},
    )
    loaded = load_run_spec(work / "throughput-run", spec, overrides)
    reset_peak(device)
    times: dict[str, float] = {}
    with clock(device, times, "seconds"):
        holder["run"] = run = build_run(loaded)
    backend = run.actor.backend
    return {"overrides": overrides, "load_seconds": times["seconds"],
            "parameters": sum(p.numel() for p in run.learner.model.parameters()),
            "policy_dtype": str(next(run.learner.model.parameters()).dtype),
            "generation_copy": backend.model is not run.learner.model,
            "generation_dtype": str(next(backend.model.parameters()).dtype),
            "generation_attention": backend.model.config._attn_implementation,
            "packs": run.learner.packs,  # train.packing as the learner resolved it on this device
            "optimizer": type(run.learner.optimizer).__name__, **peak_memory(device)}


def _generation(run, device: torch.device, s: dict[str, Any], args: Any, batches: dict[str, Any]) -> dict[str, Any]:
    from grpo_core.contracts import SamplingParams
    from grpo_core.train.learner.batch import TrainBatch

    backend, prompts = run.actor.backend, prompt_ids(s)
    backend.generate(prompts[:1], s["group"], SamplingParams(max_new_tokens=8, seed=1))  # warm-up
    reset_peak(device)
    times: dict[str, float] = {}
    with clock(device, times, "seconds"):
        out = backend.generate(prompts, s["group"], SamplingParams(max_new_tokens=s["new_tokens"], seed=0))
    memory = peak_memory(device)
    tokens = int(out.completion_mask.sum())
    flops = batch_flops(Dims.of(run.learner.model.config), out.prompt_mask, out.completion_mask, training=False)
    rows = out.completion_ids.shape[0]
    signs = (torch.arange(rows, device=out.completion_ids.device) % 2 * 2 - 1).float()[:, None]
    batches["generated"] = TrainBatch(out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask,
                                      signs * out.completion_mask, sampling_logp=out.sampling_logp)
    return {"seconds": times["seconds"], "rows": rows, "tokens": tokens, "tokens_per_s": tokens / times["seconds"],
            "truncated_rows": int(out.truncated.sum()), "sampler_logprobs": out.sampling_logp is not None,
            **_utilisation(flops, times["seconds"], device, args), **memory}


def _long_tailed(s: dict[str, Any], device: torch.device, seed: int = 1):
    """``P*G`` completions whose lengths are log-normal (median an eighth of the limit, sigma
    1), clipped to [4, limit], with every 16th row at the limit; random token ids."""
    from grpo_core.train.learner.batch import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    limit, rows = s["new_tokens"], s["prompts"] * s["group"]
    median = max(limit / 8, 1.0)
    lengths = torch.exp(torch.randn(rows, generator=gen) + torch.log(torch.tensor(median))).round()
    lengths = lengths.clamp(4, limit).long()
    lengths[::16] = limit
    ids = torch.tensor(prompt_ids(s))
    completion = torch.randint(first_word_id(), s["shape"]["vocab_size"], (rows, limit), generator=gen)
    mask = torch.arange(limit)[None, :] < lengths[:, None]
    signs = (torch.arange(rows) % 2 * 2 - 1).float()[:, None]
    batch = TrainBatch(ids, torch.ones_like(ids, dtype=torch.bool), completion, mask, signs * mask)
    return TrainBatch(*(t.to(device) for t in (batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                                batch.mask, batch.advantages)))


def _learner(run, device: torch.device, batch, s: dict[str, Any], args: Any) -> dict[str, Any]:
    from grpo_core.train.learner.update import update

    learner = run.learner
    flops = batch_flops(Dims.of(learner.model.config), batch.prompt_mask, batch.mask, training=True)
    tokens = int(batch.mask.sum())
    lengths = batch.mask.sum(dim=1).float()
    reset_peak(device)
    first: dict[str, float] = {}
    with clock(device, first, "seconds"):
        warm = update(learner, batch)
    memory = peak_memory(device)
    seconds = []
    for _ in range(s["repeats"]):
        times: dict[str, float] = {}
        with clock(device, times, "seconds"):
            update(learner, batch)
        seconds.append(times["seconds"])
    median = statistics.median(seconds)
    return {"rows": batch.mask.shape[0], "tokens": tokens, "mean_length": float(lengths.mean()),
            "max_length": int(lengths.max()), "padded_width": batch.mask.shape[1],
            "first_seconds": first["seconds"], "seconds": seconds, "median_seconds": median,
            "tokens_per_s": tokens / median, "loss_first": warm["loss"], "grad_norm_first": warm.get("grad_norm"),
            "updates": warm["train/updates"], **_utilisation(flops, median, device, args), **memory}


def _utilisation(flops: float, seconds: float, device: torch.device, args: Any) -> dict[str, Any]:
    peak = peak_tflops(device, args.peak_tflops)
    achieved = flops / seconds / 1e12
    return {"model_tflop": flops / 1e12, "achieved_tflops": achieved,
            "mfu": achieved / peak if peak else None}


def _compare_modes(record: Record) -> None:
    """Padded against packed (and against packed_segments, where it ran), per batch: time,
    memory and the first update's loss."""
    checks = record.data["checks"]
    for mode in ("packed", "packed_segments"):
        out = {}
        for name in ("generated", "long_tailed"):
            padded, packed = checks.get(f"learner_padded_{name}"), checks.get(f"learner_{mode}_{name}")
            if not (padded and packed and padded["status"] == packed["status"] == "ok"):
                continue
            memory_key = "peak_allocated_gib" if "peak_allocated_gib" in padded else "peak_rss_gib"
            out[name] = {"speedup": padded["median_seconds"] / packed["median_seconds"],
                         "memory_ratio": packed[memory_key] / padded[memory_key] if padded[memory_key] else None,
                         "loss_difference": abs(padded["loss_first"] - packed["loss_first"])}
        if out:
            record.note(**{f"padded_vs_{mode}": out})
