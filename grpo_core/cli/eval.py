"""``grpo-run eval``: evaluate a saved model (or the spec's base model) on the spec's
held-out sets, without training, optimizer or trackers."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_core.contracts import RolloutSetup
from grpo_core.errors import RunError, UsageError
from grpo_core.spec import LoadedSpec, Spec
from grpo_core.train import model as modeling
from grpo_core.train.actor.actor import Actor
from grpo_core.train.actor.data import check_columns
from grpo_core.train.distributed import Dist
from grpo_core.train.loop.assemble import (
    build_actor,
    build_episodes,
    build_rewards,
    build_scorer,
    check_image_run,
    held_out_prompts,
    load_rows,
    prompt_budget,
    prompt_tools,
    required_columns,
    seed_everything,
)
from grpo_core.train.loop.evaluate import EvalSet, evaluate_sets, load_eval_sets


@dataclass
class EvalRun:
    """What evaluating needs: an actor (the rollout backend, the reward functions) and the sets."""

    spec: Spec
    actor: Actor
    sets: list[EvalSet]

    def evaluate(self) -> dict[str, float]:
        return evaluate_sets(self.spec, self.actor, self.sets)


def saved_model_folder(path: str) -> Path:
    """The folder holding a saved model's ``config.json`` (or a LoRA ``adapter_config.json``):
    ``path`` itself (``runs/<name>/final``), or its ``model/`` (a checkpoint folder)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UsageError(f"--model {path}: no such folder; give a folder written by grpo-run "
                         "(runs/<name>/final, or a checkpoint folder runs/<name>/checkpoints/step-N)")
    for candidate in (folder, folder / "model"):
        if (candidate / "config.json").is_file() or (candidate / "adapter_config.json").is_file():
            return candidate
    if (folder / "shards").is_dir():
        raise UsageError(f"--model {path}: a sharded checkpoint (checkpoint.format: sharded), whose weights are "
                         "per-process shards, not a save_pretrained model; evaluate runs/<name>/final, or write "
                         "gathered checkpoints (checkpoint.format: gathered) to evaluate a step")
    raise UsageError(f"--model {path}: the folder has no config.json (nor adapter_config.json); give a "
                     "folder written by save_pretrained, such as runs/<name>/final or a checkpoint folder")


def _load_saved(spec: Spec, base_dir: Path, folder: Path):
    """Tokenizer and model from ``folder``: full weights, or a LoRA adapter on the spec's
    base model. The tokenizer is the folder's when it has one, else the spec's."""
    own_tokenizer = (folder / "tokenizer_config.json").is_file()
    base = spec.model.model_copy(update={"lora": None, "gradient_checkpointing": False})
    tokenizer = modeling.load_tokenizer(
        base.model_copy(update={"path": str(folder), "package": None, "gguf_file": None, "revision": None,
                                "tokenizer": None}) if own_tokenizer else base, base_dir,
    )
    if (folder / "adapter_config.json").is_file():
        try:
            from peft import PeftModel
        except ImportError as exc:
            raise RunError("--model is a LoRA adapter, which needs peft: pip install 'grpo-core[lora]'") from exc
        model = PeftModel.from_pretrained(modeling.load_policy(base, base_dir, tokenizer), str(folder))
    else:
        section = base.model_copy(update={"path": str(folder), "package": None, "gguf_file": None,
                                          "revision": None, "tokenizer": None})
        model = modeling.load_policy(section, base_dir, tokenizer)
    return tokenizer, model


def _processor(spec: Spec, base_dir: Path, folder: Path | None):
    """The processor of prompts with images (``data.image_column``): the saved folder's when
    it has one, else the spec model's; None for text prompts."""
    if spec.data.image_column is None:
        return None
    section = spec.model
    if folder is not None and (folder / "processor_config.json").is_file():
        section = section.model_copy(update={"path": str(folder), "package": None, "gguf_file": None,
                                             "revision": None})
    return modeling.load_processor(section, base_dir)


def build_eval_run(loaded: LoadedSpec, model_dir: str | None = None) -> EvalRun:
    """The model (saved in ``model_dir``, or the spec's), the reward functions and the
    held-out sets of the spec."""
    spec = loaded.spec
    folder = saved_model_folder(model_dir) if model_dir is not None else None
    dist = Dist.from_env(spec.train.device, spec.train.parallel.timeout_s)
    seed_everything(spec.train.seed)
    if spec.train.threads:
        torch.set_num_threads(spec.train.threads)
    splitter = spec.algorithm.step_splitter.build()
    rewards = build_rewards(spec, splitter)
    rows = load_rows(spec, "eval")
    required = required_columns(rewards)
    check_columns(rows, {spec.data.prompt_column: "data.prompt_column", **required}, "held-out")
    if folder is None:
        base = spec.model.model_copy(update={"lora": None, "gradient_checkpointing": False})
        tokenizer = modeling.load_tokenizer(base, loaded.base_dir)
        model = modeling.load_policy(base, loaded.base_dir, tokenizer)
    else:
        tokenizer, model = _load_saved(spec, loaded.base_dir, folder)
    model = model.to(dist.device).eval()
    processor = _processor(spec, loaded.base_dir, folder)
    scorer = build_scorer(spec, rewards, splitter)
    driver = build_episodes(spec, model, tokenizer, scorer)
    tools = prompt_tools(driver)
    max_prompt = prompt_budget(spec, model)
    eval_prompts = held_out_prompts(spec, rows, tokenizer, max_prompt, tools, processor)
    eval_sets = load_eval_sets(spec, tokenizer, max_prompt, required, tools, processor)
    if not eval_prompts and not any(s.prompts for s in eval_sets.values()):
        raise UsageError(f"{loaded.name}: the spec has no held-out prompts to evaluate on; give data a "
                         "held-out split (e.g. eval_size, or eval: FILE) or name sets in eval.sets")
    backend = spec.rollout.build()
    if processor is not None:
        check_image_run(spec, backend, model)
    backend.setup(RolloutSetup(model, tokenizer, processor=processor))
    sets = [EvalSet("eval/", eval_prompts, spec.data.prompt_column), *eval_sets.values()]
    actor = build_actor(spec, backend, scorer, dist, driver, weights=nullcontext, greedy_baseline=False)
    return EvalRun(spec, actor, sets)


def evaluate_model(loaded: LoadedSpec, model_dir: str | None = None) -> dict[str, float]:
    """Every held-out set's metrics (as logged during training) for the model saved in
    ``model_dir``, or for the spec's base model when None."""
    with torch.no_grad():
        return build_eval_run(loaded, model_dir).evaluate()


def format_table(metrics: dict[str, float], set_names: list[str]) -> str:
    """``set  metric  value`` rows: the default set as ``(default)``, then each named set."""
    rows = []
    for key, value in metrics.items():
        rest = key[len("eval/"):]
        name = next((n for n in set_names if rest.startswith(f"{n}/")), None)
        metric = rest[len(name) + 1:] if name else rest
        shown = "nan" if math.isnan(value) else f"{value:.4f}"
        rows.append((name or "(default)", metric, shown))
    rows.sort(key=lambda r: (r[0] != "(default)", r[0]))
    widths = [max(len(r[i]) for r in rows + [("set", "metric", "value")]) for i in range(3)]
    lines = [f"{'set':<{widths[0]}}  {'metric':<{widths[1]}}  {'value':>{widths[2]}}"]
    lines += [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}" for a, b, c in rows]
    return "\n".join(lines)
