"""After training: the Hugging Face round trip and what the trackers keep of the run.

``finish_exports(run, final)`` runs on the main process once ``final/`` is written:

- ``environment.json`` in the run folder (Python, platform, versions of the packages that
  shape a run), logged as an artifact to every tracker;
- ``final/merged/`` with ``export.merged``: the LoRA adapter folded into its base weights,
  a plain transformers model that loads without peft;
- ``README.md`` model cards in ``final/`` (and ``final/merged/``): base model, algorithm,
  rewards, steps, held-out scores and the resolved spec;
- the final model logged to the trackers that take one (``log_model(folder)``: the
  ``mlflow`` tracker with ``log_model: true``);
- with ``export.push_to_hub``, the upload of that model folder to the Hub.

A failure here never loses the model: ``final/`` is complete before any of it starts.
"""

from __future__ import annotations

import json
import logging
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from grpo_core.spec import Spec, dump_spec

log = logging.getLogger("grpo.export")

#: Distributions whose versions are recorded in environment.json (those installed).
PACKAGES = (
    "grpo-core", "torch", "transformers", "tokenizers", "accelerate", "peft", "datasets",
    "huggingface_hub", "safetensors", "math-verify", "pydantic", "pluggy", "mlflow", "wandb",
    "tensorboard", "vllm", "numpy",
)

MERGED = "merged"


def environment() -> dict[str, Any]:
    """What produced a run: Python, platform, accelerator and installed package versions."""
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    env: dict[str, Any] = {
        "python": sys.version.split()[0], "platform": platform.platform(), "packages": packages,
    }
    try:
        import torch

        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # pragma: no cover - torch is a dependency
        pass
    return env


def write_environment(folder: Path) -> Path:
    path = Path(folder) / "environment.json"
    path.write_text(json.dumps(environment(), indent=2) + "\n", encoding="utf-8")
    return path


# --------------------------------------------------------------------------- merged LoRA
def write_merged(spec: Spec, base_dir: Path, final: Path) -> Path:
    """``final/merged``: the base model of ``spec`` loaded afresh on the CPU, the adapter
    saved in ``final`` loaded onto it and folded in (``merge_and_unload``), saved as a plain
    transformers model with the tokenizer (the processor, for a run whose prompts had images).
    A 4-bit base (``model.quantization``, QLoRA) is loaded quantized as it trained, then
    dequantized to ``model.dtype`` before the merge: the full-precision model that computes
    what the trained policy computed, not the original weights plus the adapter."""
    from peft import PeftModel
    from transformers import AutoProcessor, AutoTokenizer

    from grpo_core.train import model as modeling

    with_images = spec.data.image_column is not None
    processor = AutoProcessor.from_pretrained(final) if with_images else None
    tokenizer = processor.tokenizer if with_images else AutoTokenizer.from_pretrained(final)
    base = modeling.load_policy(spec.model.model_copy(update={"lora": None, "gradient_checkpointing": False}),
                                base_dir, tokenizer)
    if spec.model.quantization is not None:
        base = modeling.dequantize_4bit(base, modeling.DTYPES[spec.model.dtype])
    merged = PeftModel.from_pretrained(base, final).merge_and_unload().eval()
    out = final / MERGED
    merged.save_pretrained(out)
    (processor or tokenizer).save_pretrained(out)
    return out


# --------------------------------------------------------------------------- model card
def hub_id(spec: Spec, base_dir: Path) -> str | None:
    """The base model's Hub id, or None when it is a local folder or a package."""
    from grpo_core.train.model import model_location

    if spec.model.package is not None:
        return None
    try:
        where = model_location(spec.model, base_dir)
    except Exception:
        return None
    return None if Path(where).exists() else where


def _scores_table(last_eval: dict[str, float]) -> list[str]:
    keys = [k for k in sorted(last_eval) if k == "eval/reward" or k.startswith("eval/rewards/")]
    if not keys:
        return ["No held-out evaluation was run (see the spec's `eval` section)."]
    rows = ["| metric | value |", "|---|---|"]
    rows += [f"| {k} | {last_eval[k]:.4f} |" for k in keys]
    if "eval/prompts" in last_eval:
        rows.append(f"\nGreedy completions of {int(last_eval['eval/prompts'])} held-out prompts.")
    return rows


def model_card(spec: Spec, base_dir: Path, *, name: str, steps: int, last_eval: dict[str, float],
               adapter: bool, merged: bool = False) -> str:
    """A Hugging Face model card (README.md) saying how the model was trained."""
    from huggingface_hub import ModelCardData

    base = hub_id(spec, base_dir)
    shown_base = base or spec.model.package or spec.model.path
    data = ModelCardData(
        base_model=base, library_name="peft" if adapter else "transformers", pipeline_tag="text-generation",
        tags=["grpo", "grpo-core", "reinforcement-learning"] + (["lora"] if adapter else []),
    )
    algo = spec.algorithm
    rewards = ", ".join(f"`{r.name}` (weight {r.weight:g})" for r in spec.rewards)
    load = ("from peft import AutoPeftModelForCausalLM\nmodel = AutoPeftModelForCausalLM.from_pretrained(FOLDER)"
            if adapter else "from transformers import AutoModelForCausalLM\n"
            "model = AutoModelForCausalLM.from_pretrained(FOLDER)")
    lines = [
        "---", data.to_yaml(), "---", "", f"# {name}", "",
        f"`{shown_base}` fine-tuned with GRPO (Group Relative Policy Optimization; Shao et al., "
        "*DeepSeekMath*, 2024, arXiv:2402.03300) with grpo-core "
        + ("as a LoRA adapter." if adapter else
           "as a LoRA adapter, here merged into the base weights (no peft needed)." if merged else
           "(all weights)."), "",
        "## Training", "",
        f"- Base model: `{shown_base}`",
        f"- Steps: {steps} of {spec.train.steps}, {spec.train.prompts_per_step} prompts per step, "
        f"{spec.rollout.group_size} completions per prompt",
        f"- Data: `{spec.data.name}`",
        f"- Rewards: {rewards}",
        f"- Advantage: `{algo.advantage.name}`; policy loss: `{algo.policy_loss.name}`; "
        f"aggregation: `{algo.aggregation.name}`; KL: `{algo.kl.name}`, beta {algo.kl.beta:g}",
        f"- Learning rate {spec.train.lr:g}, seed {spec.train.seed}", "",
        "## Held-out scores", "", *_scores_table(last_eval), "",
        "## Loading", "", "```python", load, "```", "",
        "## Spec", "", "The resolved spec of the run (every default filled in):", "",
        "```yaml", dump_spec(spec).rstrip(), "```", "",
    ]
    return "\n".join(lines)


def write_model_card(folder: Path, text: str) -> Path:
    path = Path(folder) / "README.md"
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- Hub
def upload_plan(final: Path) -> tuple[Path, list[str]]:
    """The folder that ``push_to_hub`` uploads and the patterns it leaves out: the merged
    model when it was written, else ``final/`` itself."""
    merged = final / MERGED
    if (merged / "config.json").is_file():
        return merged, []
    return final, [f"{MERGED}/*"]


def push_to_hub(final: Path, options) -> str | None:
    """Upload the folder of :func:`upload_plan`; the commit URL, or None when it failed
    (the model stays on disk and the message says how to upload it by hand)."""
    from huggingface_hub import HfApi

    folder, ignore = upload_plan(final)
    try:
        api = HfApi()
        api.create_repo(options.repo_id, private=options.private, exist_ok=True)
        if options.revision:
            api.create_branch(options.repo_id, branch=options.revision, exist_ok=True)
        commit = api.upload_folder(
            folder_path=str(folder), repo_id=options.repo_id, revision=options.revision,
            commit_message=options.commit_message, ignore_patterns=ignore or None,
        )
    except Exception as exc:
        by_hand = f"hf upload {options.repo_id} {folder}"
        if options.revision:
            by_hand += f" --revision {options.revision}"
        print(f"grpo-run: push_to_hub to {options.repo_id} failed ({type(exc).__name__}: {exc}); "
              f"the model is in {folder}; upload it with: {by_hand}", file=sys.stderr)
        return None
    return str(getattr(commit, "commit_url", commit))


# --------------------------------------------------------------------------- entry point
def finish_exports(run, final: Path) -> dict[str, Any]:
    """Everything above, for a finished run (main process only); what was written."""
    if not run.dist.is_main:
        return {}
    spec, export = run.spec, run.spec.export
    done: dict[str, Any] = {"environment": write_environment(run.output_dir)}
    run.log.log_artifact(done["environment"])
    adapter = (final / "adapter_config.json").is_file()
    if export.merged:
        done["merged"] = write_merged(spec, run.loaded.base_dir, final)
    if export.model_card:
        card = dict(name=run.loaded.name, steps=run.step, last_eval=run.last_eval)
        done["card"] = write_model_card(final, model_card(spec, run.loaded.base_dir, adapter=adapter, **card))
        if "merged" in done:
            write_model_card(done["merged"], model_card(spec, run.loaded.base_dir, adapter=False, merged=True, **card))
    model_folder = done.get("merged", final)
    for name, tracker in run.log.trackers.items():
        if callable(getattr(tracker, "log_model", None)):
            try:
                uri = tracker.log_model(str(model_folder))
            except Exception as exc:  # a tracker must never fail the run
                log.warning("tracker '%s' failed in log_model: %s: %s", name, type(exc).__name__, exc)
                uri = None
            if uri:
                done[f"model:{name}"] = uri
    if export.push_to_hub is not None:
        done["hub"] = push_to_hub(final, export.push_to_hub)
    return done


def heldout_table(metrics_path: Path) -> list[list[str]]:
    """Rows ``[metric, first, last]`` of the held-out scores in ``metrics.jsonl``: the first
    evaluation (before training, with ``eval.at_start``) and the last one."""
    evals = []
    if Path(metrics_path).is_file():
        for line in Path(metrics_path).read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "eval/reward" in row:
                evals.append(row)
    if not evals:
        return []
    first, last = evals[0], evals[-1]
    keys = [k for k in last if k == "eval/reward" or k.startswith("eval/rewards/")]
    shown = lambda row, k: f"{row[k]:.4f}" if k in row else "-"  # noqa: E731
    return [[k, f"{shown(first, k)} (step {first['step']})", f"{shown(last, k)} (step {last['step']})"]
            for k in keys]


def print_exports(done: dict[str, Any], metrics_path: Path | None = None) -> None:
    """The end-of-run summary table (held-out scores, first and last evaluation) and the
    files :func:`finish_exports` wrote."""
    from grpo_core.textout import print_table

    rows = heldout_table(metrics_path) if metrics_path is not None else []
    if rows:
        print_table(["held-out", "first", "last"], rows, stream=sys.stderr)
    labels = {"merged": "merged model", "card": "model card", "environment": "environment", "hub": "pushed to the Hub"}
    lines = []
    for key, value in done.items():
        if value is None:
            continue
        label = f"{key.split(':', 1)[1]} model" if ":" in key else labels.get(key, key)
        lines.append(f"  {label}: {value}")
    if lines:
        print("\n".join(lines), file=sys.stderr)
