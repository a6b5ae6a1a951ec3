"""The fields TRL's ``GRPOConfig`` inherits from ``transformers.TrainingArguments`` (5.x, plus
the few of 4.56+ that TRL 1.16 also runs on), one entry each.

TRL counts optimizer steps (``max_steps``, ``eval_steps``, ``save_steps``...); grpo-core
counts rollout steps, each of which makes ``num_iterations x steps_per_generation /
gradient_accumulation_steps`` optimizer steps (:class:`~grpo_core.trl.table.Layout`).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from grpo_core.trl.table import Context, Refusal, TRLField, ignored, mapped, refused, same

#: transformers' ``lr_scheduler_type`` -> ``train.schedule`` (constant_with_warmup: constant
#: after warm-up; plain constant ignores the warm-up in transformers).
SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
#: transformers ``optim`` values that are torch's AdamW.
ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf")
#: ``report_to`` names -> grpo-core trackers.
TRACKERS = ("mlflow", "wandb", "tensorboard")
#: ``save_total_limit=None`` (keep every checkpoint) as ``checkpoint.keep``.
KEEP_ALL = 1_000_000


def _name(value: Any) -> Any:
    """An enum of transformers (``SchedulerType.LINEAR``) as its string."""
    return getattr(value, "value", value)


def _per_epoch(ctx: Context) -> int | None:
    return None if ctx.rows is None else max(1, ctx.rows // ctx.layout.prompts)


def _steps(value: Any, ctx: Context) -> dict[str, Any]:
    steps = ctx.rollout_steps()
    return {} if steps is None else {"train.steps": steps}


def _micro_batch(value: Any, ctx: Context) -> dict[str, Any]:
    return {"train.micro_batch_size": ctx.layout.micro_batch}


def _schedule(value: Any, ctx: Context) -> dict[str, Any]:
    name = _name(value)
    if name not in SCHEDULES:
        raise Refusal("lr_scheduler_type", name, "grpo-core's schedules are linear, cosine and constant (with "
                      "warm-up)", f"one of {', '.join(SCHEDULES)} (train.schedule)")
    return {"train.schedule": SCHEDULES[name]}


def _scheduler_kwargs(value: Any) -> bool:
    if not value:
        return True
    return dict(value) in ({"num_cycles": 0.5}, {"min_lr_rate": 0.0}, {"num_cycles": 0.5, "min_lr_rate": 0.0})


def _warmup(value: Any, ctx: Context) -> dict[str, Any]:
    if _name(ctx["lr_scheduler_type"]) == "constant":
        return {"train.warmup_steps": 0}  # transformers' constant schedule has no warm-up
    ratio = ctx.values.get("warmup_ratio") or 0.0
    if not isinstance(value, int | float) or value < 0:
        raise Refusal("warmup_steps", value, "must be >= 0", "a step count, or a fraction in [0, 1)")
    if value >= 1:
        return {"train.warmup_steps": int(value)}
    fraction = value or ratio
    if not fraction:
        return {"train.warmup_steps": 0}
    total = ctx.total_optimizer_steps()
    return {} if total is None else {"train.warmup_steps": math.ceil(total * fraction)}


def _optim(value: Any, ctx: Context) -> dict[str, Any]:
    if _name(value) not in ADAMW:
        raise Refusal("optim", _name(value), "grpo-core's optimizer is torch's AdamW",
                      f"one of {', '.join(ADAMW)} (train.optimizer)")
    return {"train.optimizer.name": "adamw", "train.optimizer.state_dtype": "float32"}


def _precision(value: Any, ctx: Context) -> dict[str, Any]:
    fp16 = bool(ctx["fp16"])
    bf16 = (not fp16) if value is None else bool(value)
    if bf16 and fp16:
        raise Refusal("bf16", value, "bf16 and fp16 cannot both be on (transformers refuses it too)", "one of them")
    return {"train.mixed_precision": "bf16" if bf16 else "fp16" if fp16 else "no"}


def _every(ctx: Context, strategy_field: str, steps_field: str, steps: Any) -> int | None:
    """Rollout steps between two events of a ``*_strategy`` (steps or epoch)."""
    strategy = _name(ctx[strategy_field])
    if strategy == "epoch":
        return _per_epoch(ctx)
    if strategy == "steps":
        return ctx.optimizer_steps_to_rollout_steps(steps_field, steps)
    return 0


def _trackers(value: Any, ctx: Context) -> dict[str, Any]:
    names = [] if value in (None, "none") else [value] if isinstance(value, str) else list(value)
    names = [n for n in names if n != "none"]
    bad = [n for n in names if n not in TRACKERS]
    if bad:
        raise Refusal("report_to", value, f"grpo-core's trackers are {', '.join(TRACKERS)} ('all' picks whatever "
                      "is installed, which a spec never does)", "those names, or a tracker plugin in tracking")
    out: list[dict[str, Any]] = []
    if _name(ctx["logging_strategy"]) != "no":
        every = _every(ctx, "logging_strategy", "logging_steps", ctx["logging_steps"])
        out.append({"name": "console", "every": every or 1})
    for name in names:
        if name == "mlflow":
            out.append({"name": "mlflow", "experiment": os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"})
        elif name == "wandb":
            out.append({"name": "wandb", "project": os.environ.get("WANDB_PROJECT", "huggingface")})
        else:
            folder = os.environ.get("TENSORBOARD_LOGGING_DIR") or ctx.values.get("logging_dir") or str(
                Path(ctx["output_dir"] or "trainer_output") / "runs")
            out.append({"name": "tensorboard", "log_dir": folder})
    return {"tracking": out}


def _eval(value: Any, ctx: Context) -> dict[str, Any]:
    strategy = _name(value)
    if strategy not in ("no", "steps", "epoch"):
        raise Refusal("eval_strategy", strategy, "transformers knows no, steps and epoch", "one of them")
    steps = ctx["eval_steps"] if ctx["eval_steps"] is not None else ctx["logging_steps"]
    every = _every(ctx, "eval_strategy", "eval_steps", steps)
    out: dict[str, Any] = {"eval.at_end": strategy != "no"}
    if every is not None:
        out["eval.every"] = every
    return out


def _save(value: Any, ctx: Context) -> dict[str, Any]:
    strategy = _name(value)
    if strategy == "best":
        raise Refusal("save_strategy", strategy, "grpo-core checkpoints on a schedule as well as at each best "
                      "evaluation, and keeps the best beside the last checkpoints", "'steps' or 'epoch' with "
                      "save_steps equal to eval_steps and metric_for_best_model (checkpoint.best_metric)")
    if strategy not in ("no", "steps", "epoch"):
        raise Refusal("save_strategy", strategy, "transformers knows no, steps, epoch and best", "one of them")
    every = _every(ctx, "save_strategy", "save_steps", ctx["save_steps"])
    out: dict[str, Any] = {"checkpoint.every_minutes": 0.0 if strategy == "no" else 30.0}
    if every is not None:
        out["checkpoint.every"] = every
    return out


def _best_metric(value: Any, ctx: Context) -> dict[str, Any]:
    """``metric_for_best_model`` as ``checkpoint.best_metric`` and ``best_mode``, where grpo-core
    ranks the same evaluations of the same metric as transformers' ``_determine_best_metric``."""
    if value is None:
        return {}
    name = str(value).removeprefix("eval_")  # transformers adds the prefix when it is missing
    n = ctx["num_generations_eval"] or ctx["num_generations"]
    per_function = re.fullmatch(r"rewards/(.+)/mean", name)
    if name == "reward":
        metric = f"eval/mean@{n}"
    elif per_function:
        metric = f"eval/rewards/{per_function.group(1)}/mean@{n}"
    else:
        raise Refusal("metric_for_best_model", value, "grpo-core's evaluation computes TRL's eval_reward (as "
                      f"eval/mean@{n}) and eval_rewards/NAME/mean (eval/rewards/NAME/mean@{n}); not TRL's evaluation "
                      "loss, nor its other metrics", "'reward' or 'rewards/NAME/mean'")
    evaluate, save = _name(ctx["eval_strategy"]), _name(ctx["save_strategy"])
    if evaluate == "no":
        return {}  # nothing is evaluated, so nothing ranked (transformers neither)
    if save != evaluate:
        raise Refusal("metric_for_best_model", value, f"with save_strategy={save!r} transformers can restore "
                      "only a step it both evaluated and saved (it refuses load_best_model_at_end with another "
                      f"save_strategy than eval_strategy={evaluate!r}); grpo-core checkpoints every best step",
                      f"save_strategy={evaluate!r}")
    steps = ctx["eval_steps"] if ctx["eval_steps"] is not None else ctx["logging_steps"]
    every = _every(ctx, "eval_strategy", "eval_steps", steps)
    saves = _every(ctx, "save_strategy", "save_steps", ctx["save_steps"])
    if every != saves:
        raise Refusal("metric_for_best_model", value, f"transformers ranks every evaluation but keeps a best "
                      f"checkpoint only where it saved: with saves every {saves} and evaluations every {every} "
                      "rollout steps, a best evaluation between two saves leaves the best checkpoint where it was; "
                      "grpo-core checkpoints each best step", "save_steps equal to eval_steps")
    if ctx["eval_on_start"]:
        raise Refusal("metric_for_best_model", value, "with eval_on_start=True grpo-core ranks the evaluation "
                      "before training too (the base model can be the best); transformers does not rank it",
                      "eval_on_start=False")
    total = ctx.rollout_steps()
    if total is not None and every and total % every:
        raise Refusal("metric_for_best_model", value, f"grpo-core evaluates after the last step ({total}) too and "
                      f"ranks it; transformers evaluates every {every} rollout steps only, so there the last step is "
                      "no candidate", f"a run length that is a multiple of the evaluation interval ({every})")
    better = ctx["greater_is_better"]
    if better is None:  # transformers' default
        better = not name.endswith("loss")
    return {"checkpoint.best_metric": metric, "checkpoint.best_mode": "max" if better else "min"}


def _final(value: Any, ctx: Context) -> dict[str, Any]:
    if not value or _name(ctx["eval_strategy"]) == "no":
        return {}  # with no evaluation transformers finds no best checkpoint and keeps the last weights
    if ctx["metric_for_best_model"] is None:
        raise Refusal("load_best_model_at_end", value, "without metric_for_best_model transformers ranks by 'loss', "
                      "TRL's loss on the evaluation batches, which grpo-core's evaluation does not compute",
                      "metric_for_best_model='reward' (or 'rewards/NAME/mean')")
    return {"checkpoint.final": "best"}


def _keep(value: Any, ctx: Context) -> dict[str, Any]:
    if value is None:
        return {"checkpoint.keep": KEEP_ALL}
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Refusal("save_total_limit", value, "grpo-core keeps at least one checkpoint", "a positive integer")
    return {"checkpoint.keep": value}


def _hub(value: Any, ctx: Context) -> dict[str, Any]:
    if not value:
        return {"export.push_to_hub": None}
    repo = ctx["hub_model_id"]
    if not repo or "/" not in repo:
        raise Refusal("push_to_hub", value, f"grpo-core pushes to a named repository ('user/name' or 'org/name'), "
                      f"not to one named after output_dir in the logged-in account (hub_model_id={repo!r})",
                      "hub_model_id='user/name' (export.push_to_hub.repo_id)")
    private = True if ctx["hub_private_repo"] is None else bool(ctx["hub_private_repo"])
    return {"export.push_to_hub": {"repo_id": repo, "private": private, "revision": ctx["hub_revision"]}}


def _positive(name: str, key: str) -> Any:
    def to(value: Any, ctx: Context) -> dict[str, Any]:
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise Refusal(name, value, "must be a number >= 0", key)
        return {key: float(value)}

    return to


def _grad_norm(value: Any, ctx: Context) -> dict[str, Any]:
    return {"train.max_grad_norm": float(value) if value and value > 0 else None}


def _falsy(value: Any) -> bool:
    return not value


#: How a count of optimizer steps converts.
IN_ROLLOUT_STEPS = "optimizer steps / optimizer steps per generation batch, rounded up"


_DATALOADER = "grpo-core draws the prompts itself; the loader's workers and memory pinning change no result"
_DDP = "process-group mechanics of DDP; grpo-core sets up its own (train.parallel), with the same gradients"
_LOGGING = "where and how much transformers logs; grpo-core's console and trackers log every metric"

#: Fields under which metric_for_best_model ranks the same steps as transformers (the examples' 8 rows
#: make 24 rollout steps: 3 epochs of 8 prompts).
_BEST_GRID = {"eval_strategy": "steps", "eval_steps": 6, "save_steps": 6}
_BEST = {**_BEST_GRID, "metric_for_best_model": "reward"}

FIELDS: list[TRLField] = [
    mapped("output_dir", None, "train.output_dir", "as is ('trainer_output' when None, as transformers)",
           lambda v, ctx: {"train.output_dir": str(v or "trainer_output")},
           note="A second train() without resume_from_checkpoint moves the previous run's files into "
           "output_dir/overwritten/TIME/ (nothing is deleted), where TRL writes over them.",
           examples=(("runs/x", {"train.output_dir": "runs/x"}),)),
    mapped("per_device_train_batch_size", 8, "train.micro_batch_size", "as is: completions per forward/backward "
           "of a process", _micro_batch,
           note="TRL's per_device_train_batch_size counts completions, not prompts; with the default "
           "gradient_accumulation_steps=1 and steps_per_generation, a generation batch is per_device_train_batch_size"
           " x processes completions, i.e. that / num_generations prompts (train.prompts_per_step).",
           examples=((16, {"train.micro_batch_size": 16, "train.prompts_per_step": 2}),),
           refusals=((0, "an integer >= 1"),)),
    mapped("num_train_epochs", 3.0, "train.steps", "with max_steps unset: epochs x (rows // prompts per "
           "generation batch) rollout steps", lambda v, ctx: {},
           note="TRL's sampler drops an incomplete last batch of an epoch, as the count does.",
           examples=((1, {"train.steps": 8}),)),
    mapped("max_steps", -1, "train.steps", "max_steps / optimizer steps per generation batch (must divide)",
           _steps, examples=((6, {"train.steps": 3}, {"num_iterations": 2}),),
           refusals=((5, "a multiple of 2", {"num_iterations": 2}),)),
    mapped("learning_rate", 1e-6, "train.lr", "as is", same("train.lr", float),
           examples=((1e-5, {"train.lr": 1e-5}),)),
    mapped("lr_scheduler_type", "linear", "train.schedule", "linear, cosine, constant; constant_with_warmup: "
           "constant", _schedule, note="transformers' constant schedule ignores warmup_steps; so does the door.",
           examples=(("cosine", {"train.schedule": "cosine"}),), refusals=(("polynomial", "train.schedule"),)),
    refused("lr_scheduler_kwargs", None, "grpo-core's schedules take no arguments",
            "None, or {'num_cycles': 0.5} / {'min_lr_rate': 0.0} with cosine (the values they equal)",
            accepts=_scheduler_kwargs, bad={"num_cycles": 2}),
    mapped("warmup_steps", 0, "train.warmup_steps", "an integer as is; a float in (0, 1): ceil(fraction x "
           "optimizer steps), as transformers", _warmup,
           note="transformers' warm-up multiplies the learning rate by step/W at optimizer step 0..W-1 (0 at the "
           "first step), grpo-core's by (step+1)/W (W/W at the last warm-up step): the same from step W on, one "
           "step ahead during the warm-up.",
           examples=((3, {"train.warmup_steps": 3}), (0.5, {"train.warmup_steps": 2}, {"max_steps": 4}))),
    mapped("warmup_ratio", 0.0, "train.warmup_steps", "transformers 4.x: ceil(ratio x optimizer steps) when "
           "warmup_steps is 0", lambda v, ctx: {}, examples=((0.25, {"train.warmup_steps": 1}, {"max_steps": 4}),)),
    mapped("optim", "adamw_torch_fused", ("train.optimizer.name", "train.optimizer.state_dtype"),
           "adamw_torch, adamw_torch_fused: adamw with float32 moments", _optim,
           note="The door sets state_dtype float32: grpo-core's auto would keep bf16 moments under bf16.",
           examples=(("adamw_torch", {"train.optimizer.state_dtype": "float32"}),),
           refusals=(("sgd", "train.optimizer"),)),
    refused("optim_args", None, "grpo-core's AdamW takes its arguments from train.*", "train.adam_*", bad="x=1"),
    refused("optim_target_modules", None, "grpo-core optimizes every trainable weight", "model.lora",
            bad=["attn"]),
    mapped("weight_decay", 0.0, "train.weight_decay", "as is", _positive("weight_decay", "train.weight_decay"),
           examples=((0.1, {"train.weight_decay": 0.1}),)),
    mapped("adam_beta1", 0.9, "train.adam_betas", "[adam_beta1, adam_beta2]",
           lambda v, ctx: {"train.adam_betas": [float(v), float(ctx["adam_beta2"])]},
           examples=((0.8, {"train.adam_betas": [0.8, 0.999]}),)),
    mapped("adam_beta2", 0.999, "train.adam_betas", "see adam_beta1", lambda v, ctx: {},
           examples=((0.99, {"train.adam_betas": [0.9, 0.99]}),)),
    mapped("adam_epsilon", 1e-8, "train.adam_eps", "as is", same("train.adam_eps", float),
           examples=((1e-6, {"train.adam_eps": 1e-6}),)),
    mapped("gradient_accumulation_steps", 1, "train.mini_batches",
           "with steps_per_generation: optimizer steps per generation batch = steps_per_generation / this",
           lambda v, ctx: {}, note="grpo-core's gradient does not depend on the micro-batching, so accumulating "
           "is only train.micro_batch_size per forward.",
           examples=((2, {"train.mini_batches": 1, "train.prompts_per_step": 2}),)),
    ignored("average_tokens_across_devices", True, "GRPOTrainer normalizes its loss itself (loss_type)"),
    mapped("max_grad_norm", 1.0, "train.max_grad_norm", "as is; 0 or None: null (no clipping)", _grad_norm,
           examples=((0.0, {"train.max_grad_norm": None}),)),
    ignored("label_smoothing_factor", 0.0, "GRPOTrainer's loss reads no labels"),
    mapped("bf16", None, "train.mixed_precision", "None: True unless fp16 (TRL's default); bf16 or fp16 autocast, "
           "else 'no'", _precision, note="Weights stay in model.dtype (float32 by default), as under TRL's "
           "mixed precision.", examples=((False, {"train.mixed_precision": "no"}),),
           refusals=((True, "one of them", {"fp16": True}),)),
    mapped("fp16", False, "train.mixed_precision", "see bf16", lambda v, ctx: {},
           examples=((True, {"train.mixed_precision": "fp16"}),)),
    refused("bf16_full_eval", False, "grpo-core evaluates in the training precision", "train.mixed_precision",
            bad=True),
    refused("fp16_full_eval", False, "grpo-core evaluates in the training precision", "train.mixed_precision",
            bad=True),
    refused("tf32", None, "grpo-core leaves torch's TF32 setting alone (off for matmuls)",
            "torch.backends.cuda.matmul.allow_tf32 in your script", accepts=_falsy, bad=True),
    refused("activation_checkpointing", None, "FSDP activation checkpointing is not how grpo-core checkpoints",
            "gradient_checkpointing (model.gradient_checkpointing)", bad=True),
    refused("activation_checkpointing_kwargs", None, "see activation_checkpointing", "gradient_checkpointing",
            bad={"x": 1}),
    mapped("gradient_checkpointing", True, "model.gradient_checkpointing", "as is (TRL's default is True)",
           same("model.gradient_checkpointing", bool), examples=((False, {"model.gradient_checkpointing": False}),)),
    ignored("gradient_checkpointing_kwargs", None, "how activations are recomputed (grpo-core: non-reentrant), "
            "not what"),
    ignored("torch_compile", False, "compiled kernels compute the same loss faster"),
    ignored("torch_compile_backend", None, "see torch_compile"),
    ignored("torch_compile_mode", None, "see torch_compile"),
    ignored("use_liger_kernel", False, "Liger's fused kernels compute the same loss with less memory; grpo-core's "
            "log-probs are already chunked"),
    ignored("liger_kernel_config", None, "see use_liger_kernel"),
    ignored("use_cache", False, "the model config's KV cache during the training forward (memory only)"),
    refused("neftune_noise_alpha", None, "grpo-core adds no noise to the embeddings", "None", bad=5.0),
    ignored("torch_empty_cache_steps", None, "frees cached device memory (speed and memory only)"),
    refused("auto_find_batch_size", False, "TRL refuses it too: a smaller batch breaks the groups",
            "per_device_train_batch_size", bad=True),
    mapped("logging_strategy", "steps", "tracking[0]", "'no': no console tracker; steps / epoch: see logging_steps",
           lambda v, ctx: {}, examples=(("no", {"tracking": []}),)),
    mapped("logging_steps", 10, "tracking[0].every", "the console tracker's every: " + IN_ROLLOUT_STEPS,
           lambda v, ctx: {}, note="grpo-core writes every step's metrics to output_dir/metrics.jsonl and to "
           "the trackers whatever this is; it only thins what the console prints.",
           examples=((4, {"tracking[0].every": 4}),)),
    ignored("logging_first_step", False, _LOGGING),
    ignored("log_on_each_node", True, _LOGGING),
    ignored("logging_nan_inf_filter", True, _LOGGING + " (grpo-core skips a non-finite update and says so)"),
    ignored("include_num_input_tokens_seen", "no", _LOGGING),
    ignored("log_level", "passive", _LOGGING),
    ignored("log_level_replica", "warning", _LOGGING),
    mapped("disable_tqdm", None, "train.progress", "not disable_tqdm (None: a progress bar)",
           lambda v, ctx: {"train.progress": not v}, examples=((True, {"train.progress": False}),)),
    mapped("report_to", "none", "tracking", "console (every logging_steps) plus mlflow, wandb, tensorboard as named",
           _trackers, note="MLflow's experiment is $MLFLOW_EXPERIMENT_NAME or 'Default', W&B's project "
           "$WANDB_PROJECT or 'huggingface', TensorBoard's folder $TENSORBOARD_LOGGING_DIR, logging_dir or "
           "output_dir/runs, as transformers' integrations choose them.",
           examples=(("tensorboard", {"tracking[1].name": "tensorboard"}),), refusals=(("comet_ml", "tracking"),)),
    mapped("run_name", None, "run_name", "as is", same("run_name"), examples=(("try-1", {"run_name": "try-1"}),)),
    ignored("project", "huggingface", "Trackio's project; report_to='trackio' is refused"),
    ignored("trackio_space_id", None, "Trackio only"),
    ignored("trackio_bucket_id", None, "Trackio only"),
    ignored("trackio_static_space_id", None, "Trackio only"),
    mapped("eval_strategy", "no", ("eval.every", "eval.at_end"), "no: every 0, at_end false; steps: every "
           "eval_steps (logging_steps when None), at_end true; epoch: every epoch", _eval,
           note="Refused without eval_dataset, as TRL refuses it. TRL's evaluation loss is not computed; the "
           "rewards of sampled completions are (see num_generations_eval).",
           examples=(("steps", {"eval.every": 10, "eval.at_end": True}),), refusals=(("sometimes", "one of them"),)),
    mapped("eval_steps", None, "eval.every", IN_ROLLOUT_STEPS, lambda v, ctx: {},
           examples=((6, {"eval.every": 6}, {"eval_strategy": "steps"}),)),
    refused("eval_delay", 0, "grpo-core evaluates from the first interval on", "eval.every", bad=100),
    mapped("eval_on_start", False, "eval.at_start", "as is", same("eval.at_start", bool),
           examples=((True, {"eval.at_start": True}),)),
    ignored("per_device_eval_batch_size", 8, "how many completions one evaluation forward holds (memory only)"),
    ignored("prediction_loss_only", False, "GRPOTrainer's evaluation computes only its loss and rewards"),
    ignored("eval_do_concat_batches", True, "how transformers gathers predictions GRPOTrainer does not make"),
    ignored("eval_use_gather_object", False, "see eval_do_concat_batches"),
    ignored("eval_accumulation_steps", None, "see eval_do_concat_batches"),
    ignored("include_for_metrics", [], "see eval_do_concat_batches"),
    ignored("batch_eval_metrics", False, "see eval_do_concat_batches"),
    ignored("save_only_model", False, "grpo-core's checkpoints always hold the optimizer state, so that a resume "
            "is exact; the trained model is the same"),
    mapped("save_strategy", "steps", ("checkpoint.every", "checkpoint.every_minutes"), "no: every 0 and "
           "every_minutes 0; steps: every save_steps; epoch: every epoch; every_minutes 30 (grpo-core's) otherwise",
           _save, note="grpo-core also checkpoints every 30 minutes and when interrupted, so a crash loses little; "
           "those checkpoints change no result.", examples=(("no", {"checkpoint.every": 0}),),
           refusals=(("best", "'steps' or 'epoch'"),)),
    mapped("save_steps", 500, "checkpoint.every", IN_ROLLOUT_STEPS, lambda v, ctx: {},
           examples=((20, {"checkpoint.every": 20}),)),
    ignored("save_on_each_node", False, "grpo-core's main process writes the checkpoint for all"),
    mapped("save_total_limit", None, "checkpoint.keep", f"as is; None (keep all): {KEEP_ALL}", _keep,
           examples=((3, {"checkpoint.keep": 3}),), refusals=((0, "a positive integer"),)),
    ignored("enable_jit_checkpoint", False, "grpo-core always checkpoints on SIGTERM"),
    mapped("push_to_hub", False, "export.push_to_hub", "True: {repo_id: hub_model_id, private: hub_private_repo, "
           "revision: hub_revision}", _hub,
           note="grpo-core pushes once, at the end. hub_private_repo None (the Hub's default, public for a user) "
           "becomes private: grpo-core creates private repositories unless told otherwise.",
           examples=((True, {"export.push_to_hub.repo_id": "me/model", "export.push_to_hub.private": True},
                      {"hub_model_id": "me/model"}),),
           refusals=((True, "hub_model_id='user/name'"),)),
    refused("hub_token", None, "a token in a spec would be written to the run folder", "hf auth login, or HF_TOKEN",
            bad="hf_xxx"),
    mapped("hub_private_repo", None, "export.push_to_hub.private", "see push_to_hub", lambda v, ctx: {},
           examples=((False, {"export.push_to_hub.private": False}, {"push_to_hub": True,
                                                                     "hub_model_id": "me/model"}),)),
    mapped("hub_model_id", None, "export.push_to_hub.repo_id", "see push_to_hub", lambda v, ctx: {},
           examples=(("org/m", {"export.push_to_hub.repo_id": "org/m"}, {"push_to_hub": True}),)),
    ignored("hub_strategy", "every_save", "when the pushes happen (grpo-core: once, at the end), not what is pushed"),
    ignored("hub_always_push", False, "see hub_strategy"),
    mapped("hub_revision", None, "export.push_to_hub.revision", "see push_to_hub", lambda v, ctx: {},
           examples=(("dev", {"export.push_to_hub.revision": "dev"}, {"push_to_hub": True,
                                                                      "hub_model_id": "me/model"}),)),
    mapped("load_best_model_at_end", False, "checkpoint.final", "True: best (with metric_for_best_model); False: "
           "last", _final,
           note="The final model (trainer.model after train(), save_model, the export) is then the best "
           "checkpoint's, as transformers loads it at the end.",
           examples=((True, {"checkpoint.final": "best", "checkpoint.best_metric": "eval/mean@8"}, _BEST),),
           refusals=((True, "metric_for_best_model='reward'", {"eval_strategy": "steps"}),)),
    mapped("metric_for_best_model", None, ("checkpoint.best_metric", "checkpoint.best_mode"),
           "reward: eval/mean@n; rewards/NAME/mean: eval/rewards/NAME/mean@n (n = num_generations_eval, else "
           "num_generations); eval_ prefix optional; best_mode from greater_is_better", _best_metric,
           note="grpo-core checkpoints each step whose evaluation is the best so far and keeps it beside the last "
           "save_total_limit, as transformers keeps its best checkpoint. The same steps are ranked only when "
           "checkpoints and evaluations share their interval, no evaluation on start is ranked and the run ends on "
           "an evaluation step: the door refuses the rest. eval_reward is TRL's mean of its evaluation batches' "
           "means, grpo-core's mean@n the mean over all samples: the same when the batches are equal.",
           examples=(("eval_rewards/reward_len/mean", {"checkpoint.best_metric": "eval/rewards/reward_len/mean@8",
                                                       "checkpoint.best_mode": "max"}, _BEST_GRID),),
           refusals=(("loss", "'reward' or 'rewards/NAME/mean'", _BEST_GRID),
                     ("reward", "save_steps equal to eval_steps", {**_BEST_GRID, "save_steps": 12}),
                     ("reward", "eval_on_start=False", {**_BEST_GRID, "eval_on_start": True}),
                     ("reward", "a run length that is a multiple", {**_BEST_GRID, "eval_steps": 5, "save_steps": 5}))),
    mapped("greater_is_better", None, "checkpoint.best_mode", "True: max; False: min; None: transformers' default "
           "(min for a metric ending in loss, else max)", lambda v, ctx: {},
           examples=((False, {"checkpoint.best_mode": "min"}, {**_BEST_GRID, "metric_for_best_model": "reward"}),)),
    refused("ignore_data_skip", False, "a grpo-core resume always continues the prompt stream where it stopped",
            "False", bad=True),
    ignored("restore_callback_states_from_checkpoint", False, "transformers callbacks are refused (GRPOTrainer's "
            "callbacks)"),
    refused("full_determinism", False, "grpo-core does not switch torch to deterministic kernels (a run is "
            "reproducible with the same seed and thread count)", "False", bad=True),
    mapped("seed", 42, "train.seed", "as is (TRL's default 42)", same("train.seed"),
           examples=((7, {"train.seed": 7}),)),
    refused("data_seed", None, "the prompt order is seeded by train.seed", "seed", bad=1),
    mapped("use_cpu", False, "train.device", "True: cpu; False: auto", lambda v, ctx: {"train.device":
                                                                                       "cpu" if v else "auto"},
           examples=((True, {"train.device": "cpu"}),)),
    refused("accelerator_config", None, "grpo-core does not drive accelerate's batch dispatching",
            "None", bad={"split_batches": True}),
    refused("parallelism_config", None, "grpo-core's parallelism is train.parallel (ddp or fsdp2)",
            "train.parallel", bad={"dp_shard_size": 2}),
    ignored("dataloader_drop_last", False, "GRPOTrainer's sampler decides, and drops an incomplete batch as "
            "grpo-core's step count does"),
    ignored("dataloader_num_workers", 0, _DATALOADER),
    ignored("dataloader_pin_memory", True, _DATALOADER),
    ignored("dataloader_persistent_workers", False, _DATALOADER),
    ignored("dataloader_prefetch_factor", None, _DATALOADER),
    ignored("dataloader_multiprocessing_context", None, _DATALOADER),
    ignored("dataloader_in_order", True, _DATALOADER),
    ignored("label_names", None, "GRPOTrainer reads no labels"),
    ignored("train_sampling_strategy", "random", "GRPOTrainer replaces the sampler with its own"),
    ignored("length_column_name", "length", "GRPOTrainer replaces the sampler with its own"),
    ignored("ddp_find_unused_parameters", None, _DDP),
    ignored("ddp_bucket_cap_mb", None, _DDP),
    ignored("ddp_broadcast_buffers", None, _DDP),
    ignored("ddp_static_graph", None, _DDP),
    ignored("ddp_backend", None, _DDP),
    ignored("ddp_timeout", 1800, _DDP),
    refused("fsdp", None, "grpo-core shards with its own FSDP2 strategy", "train.parallel.strategy: fsdp2",
            accepts=_falsy, bad="full_shard"),
    refused("fsdp_config", None, "see fsdp", "train.parallel.*", bad={"min_num_params": 1}),
    refused("deepspeed", None, "grpo-core does not run on DeepSpeed", "train.parallel.strategy: fsdp2",
            bad="ds.json"),
    ignored("debug", "", "transformers' debugging aids (underflow detection, TPU metrics)"),
    ignored("skip_memory_metrics", True, "transformers' memory report"),
    ignored("do_train", False, "not read by the Trainer; for scripts"),
    ignored("do_eval", False, "not read by the Trainer; for scripts"),
    ignored("do_predict", False, "not read by the Trainer; for scripts"),
    ignored("resume_from_checkpoint", None, "not read by the Trainer; pass it to train(resume_from_checkpoint=...)"),
    ignored("local_rank", -1, "set by the launcher; grpo-core reads LOCAL_RANK itself"),
    # transformers 4.56+ (which TRL 1.16 also runs on)
    ignored("overwrite_output_dir", False, "transformers 4.x: a fresh train() moves a previous run's files aside "
            "(see output_dir)"),
    mapped("logging_dir", None, "tracking[i].log_dir", "transformers 4.x: the tensorboard tracker's log_dir",
           lambda v, ctx: {}, examples=(("tb", {"tracking[1].log_dir": "tb"}, {"report_to": "tensorboard"}),)),
    ignored("save_safetensors", True, "transformers 4.x: grpo-core always writes safetensors"),
    ignored("group_by_length", False, "transformers 4.x: GRPOTrainer replaces the sampler with its own"),
    ignored("include_tokens_per_second", False, "transformers 4.x: " + _LOGGING),
]

__all__ = ["ADAMW", "FIELDS", "KEEP_ALL", "SCHEDULES", "TRACKERS"]
