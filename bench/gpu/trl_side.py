"""Part 3, TRL's ``GRPOTrainer`` at the throughput part's settings, side by side: the same
random Qwen2.5-0.5B-shaped model from the same folder (float32 weights; TRL's bf16 autocast on a
GPU), the same ``P`` prompts of the same token ids (as the words of the wide tokenizer), ``G``
completions of up to the same number of tokens, a reward that differs within every group,
beta 0, one optimizer step per generation batch (``per_device_train_batch_size = G``,
``gradient_accumulation_steps = P``). TRL's own defaults otherwise (gradient checkpointing on).

Two steps; the second is timed (the first pays the warm-up): step seconds, the generation's
share (TRL's ``_generate``, when this TRL has it) and generated tokens per second, and peak
memory. TRL is not on the GPU machine: its wheel and those it needs travel with the check
(``bench/gpu/wheels.txt``); where it cannot be imported the part says why.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import Record, peak_memory, reset_peak, save_random_qwen, sync
from throughput import model_folder, prompt_ids, settings


def run(record: Record, device: torch.device, work: Path, args: Any) -> None:
    s = settings(args)
    record.note(settings={k: v for k, v in s.items() if k not in ("shape", "micro_batch_tokens", "repeats")})
    versions = record.check("import", _import)
    if versions["status"] != "ok":
        return
    folder = model_folder(work, args)
    record.check("model", lambda: save_random_qwen(folder, s["shape"], device))
    record.check("steps", lambda: _steps(folder, device, s))


def _import() -> dict[str, Any]:
    """TRL's versions, or the part skipped where TRL cannot be imported (its wheels were not
    carried, or one it needs is missing)."""
    try:
        import datasets
        import trl
        from trl import GRPOConfig, GRPOTrainer  # noqa: F401  (the import is the check)
    except ImportError as exc:
        return {"status": "skipped", "reason": f"TRL cannot be imported here ({type(exc).__name__}: {exc}); "
                "carry its wheels (bench/gpu/fetch_wheels.sh)"}
    return {"trl": trl.__version__, "datasets": datasets.__version__}


def varied(completions, **kwargs):
    """A reward that differs within every group, whatever a random model writes."""
    return [float(i % 2) for i in range(len(completions))]


def _steps(folder: Path, device: torch.device, s: dict[str, Any]) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    tokenizer.padding_side = "left"
    texts = [" ".join(f"t{i}" for i in ids) for ids in prompt_ids(s)]
    assert [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts] == prompt_ids(s)
    steps: list[dict[str, float]] = []
    timings: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            reset_peak(device)

        def on_step_begin(self, *a, **k):
            sync(device)
            timings.clear()
            timings["_start"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync(device)
            steps.append({"seconds": time.perf_counter() - timings.pop("_start"), **timings})

    cpu = device.type == "cpu"
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-gpu-check-"), report_to=[], use_cpu=cpu, bf16=not cpu,
        per_device_train_batch_size=s["group"], gradient_accumulation_steps=s["prompts"],
        num_generations=s["group"], max_completion_length=s["new_tokens"], learning_rate=1e-6, beta=0.0,
        max_steps=2, logging_steps=1, save_strategy="no", seed=0, temperature=1.0, top_k=0, top_p=1.0,
        model_init_kwargs={"dtype": torch.float32}, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=str(folder), reward_funcs=[varied], args=config,
                          train_dataset=Dataset.from_list([{"prompt": t} for t in texts]),
                          processing_class=tokenizer, callbacks=[Clock()])
    timed = _time_generation(trainer, device, timings)
    trainer.train()
    memory = peak_memory(device)
    last = steps[-1]
    out = {"steps_seconds": [round(x["seconds"], 3) for x in steps], "step_seconds": last["seconds"],
           "gradient_checkpointing": config.gradient_checkpointing, "bf16": config.bf16,
           "generation_batch_size": config.generation_batch_size, **memory}
    if timed:
        out.update(generate_seconds=last.get("generate", 0.0), generated_tokens=int(last.get("tokens", 0)),
                   train_seconds=last["seconds"] - last.get("generate", 0.0))
        if last.get("generate"):
            out["tokens_per_s"] = last.get("tokens", 0) / last["generate"]
    else:
        out["generate_seconds"] = "this TRL has no _generate method to time"
    out["ok"] = len(steps) == 2
    return out


def _time_generation(trainer, device: torch.device, timings: dict[str, float]) -> bool:
    """Time TRL's ``_generate`` (its second result is the completions' token ids); False where
    this TRL has no such method."""
    original = getattr(trainer, "_generate", None)
    if original is None:
        return False

    def wrapper(*a, **k):
        sync(device)
        start = time.perf_counter()
        result = original(*a, **k)
        sync(device)
        timings["generate"] = timings.get("generate", 0.0) + time.perf_counter() - start
        try:
            timings["tokens"] = timings.get("tokens", 0.0) + float(sum(len(c) for c in result[1]))
        except (TypeError, IndexError):
            pass
        return result

    trainer._generate = wrapper
    return True
