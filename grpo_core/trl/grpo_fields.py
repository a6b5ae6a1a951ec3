"""TRL 1.16's own ``GRPOConfig`` fields (those it adds to ``transformers.TrainingArguments``),
one entry each: where it lands in a grpo-core spec, or why it is refused or ignored.

Facts about TRL come from its source (``trl/trainer/grpo_config.py`` and
``grpo_trainer.py``, version 1.16.0): the loss of each ``loss_type`` (``_compute_loss``;
``get_gamma_weights`` for ``vespo``, ``get_off_policy_mask`` for ``off_policy_mask_threshold``),
the advantage of each ``scale_rewards`` and ``multi_objective_aggregation``
(``_generate_and_score_completions``: the unbiased std, plus 1e-4), the KL term (k3 without
clamps, times the importance ratio under ``use_bias_correction_kl``) and the vLLM
importance-sampling modes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grpo_core.trl.table import (
    Context,
    Refusal,
    TRLField,
    ignored,
    mapped,
    refused,
    same,
)

#: TRL ``loss_type`` -> (grpo-core policy loss at token level, aggregator). Each aggregator
#: normalizes as TRL's loss does once its micro-batch losses are accumulated over an
#: optimizer step: ``grpo`` and ``sapo`` average each sequence's token mean, ``dr_grpo``
#: divides the token sum by rows x max_completion_length, ``dapo``, ``cispo`` and ``vespo``
#: divide by the tokens of the whole optimizer step, ``luspo`` averages each sequence's token sum.
#: ``importance_sampling_level="sequence"`` turns ``clip`` into ``gspo`` (:func:`policy_loss`).
LOSS_TYPES: dict[str, tuple[str, str]] = {
    "grpo": ("clip", "seq-mean-token-mean"),
    "dr_grpo": ("clip", "seq-mean-token-sum-norm"),
    "dapo": ("clip", "token-mean"),
    "bnpo": ("clip", "token-mean"),
    "cispo": ("cispo", "token-mean"),
    "sapo": ("sapo", "seq-mean-token-mean"),
    "luspo": ("clip", "seq-mean-token-sum"),
    "vespo": ("vespo", "token-mean"),
}
#: The TRL losses whose ratio is PPO's clip (``epsilon``, ``epsilon_high``, ``delta``).
CLIPPED = ("grpo", "dr_grpo", "dapo", "bnpo", "luspo")


def policy_loss(ctx: Context) -> str:
    """The grpo-core policy loss of ``ctx``'s ``loss_type``, ``importance_sampling_level`` and
    ``off_policy_mask_threshold`` (PPO's token-level clip with the off-policy mask is ``opsm``)."""
    loss_type, level = ctx["loss_type"], ctx["importance_sampling_level"]
    if loss_type not in LOSS_TYPES:
        return ""
    name = LOSS_TYPES[loss_type][0]
    if level == "sequence" and name == "clip":
        return "gspo"
    return "opsm" if name == "clip" and ctx["off_policy_mask_threshold"] is not None else name


def trl_warnings(values: Mapping[str, Any]) -> list[str]:
    """What TRL 1.16's ``GRPOTrainer.__init__`` logs as a warning for these field ``values``
    (the loss settings it takes, but not as their papers set them), in TRL's words."""
    loss_type, level = values["loss_type"], values["importance_sampling_level"]
    out = []
    if loss_type == "luspo" and level != "sequence":
        out.append("When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'` to mirror "
                   "the paper's setup.")
    if loss_type == "vespo" and level != "token":
        out.append("VESPO computes sequence-level importance weights internally. `importance_sampling_level` should "
                   "be set to `'token'` (the default).")
    if level == "sequence" and loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        out.append(f"When using `importance_sampling_level='sequence'`, the `'{loss_type}'` loss sums per-token "
                   "contributions, which effectively weights each sequence by its completion length instead of "
                   "optimizing the per-sequence objective. To reproduce the GSPO paper's setup, set "
                   "`loss_type='grpo'` (see https://huggingface.co/docs/trl/main/en/paper_index"
                   "#group-sequence-policy-optimization).")
    return out


# --------------------------------------------------------------------------- converters
def _loss_type(value: Any, ctx: Context) -> dict[str, Any]:
    level = ctx["importance_sampling_level"]
    if value not in LOSS_TYPES:
        raise Refusal("loss_type", value, f"not a TRL 1.16 loss type ({', '.join(LOSS_TYPES)})", "one of them")
    if value == "vespo" and ctx["use_vllm"] and ctx["vllm_importance_sampling_correction"]:
        raise Refusal("loss_type", value, "with vLLM's importance-sampling correction TRL's vespo folds the vLLM "
                      "ratio pi_old/pi_sampler into the sequence ratio w inside its gamma weight phi(w), while "
                      "grpo-core's vespo weighs only pi/pi_old and its rollout correction multiplies the loss "
                      "after it: another weight", "vllm_importance_sampling_correction=False, or without vLLM")
    if level not in ("token", "sequence"):
        raise Refusal("importance_sampling_level", level, "TRL knows 'token' and 'sequence'", "one of them")
    if value in ("cispo", "sapo") and level == "sequence":
        raise Refusal("importance_sampling_level", level, f"TRL's {value} on a sequence-level ratio has no grpo-core "
                      "equivalent (grpo-core's sequence-level loss is gspo, PPO's clip)",
                      "importance_sampling_level='token', or loss_type='grpo' for GSPO")
    if value == "bnpo":
        layout = ctx.layout
        if layout.accumulation != 1 or ctx.world_size != 1:
            raise Refusal("loss_type", value, "bnpo divides each micro-batch of each process by its own token "
                          "count; grpo-core normalizes over the whole optimizer step (a gradient step is the same "
                          "whatever the micro-batching), which is bnpo only with gradient_accumulation_steps=1 on "
                          "one process", "loss_type='dapo' (the token mean over the optimizer step)")
    out = {"algorithm.policy_loss.name": policy_loss(ctx), "algorithm.aggregation.name": LOSS_TYPES[value][1]}
    if value != "vespo":  # vespo clamps as TRL's get_gamma_weights does, and has no other clamp
        out["algorithm.policy_loss.log_ratio_clamp"] = None
    return out


def _epsilon(value: Any, ctx: Context) -> dict[str, Any]:
    if ctx["loss_type"] not in CLIPPED:
        return {}  # cispo and sapo do not read it (TRL neither)
    if not (isinstance(value, int | float) and 0 < value < 1):
        raise Refusal("epsilon", value, "the lower clip 1 - epsilon must stay in (0, 1)",
                      "a value in (0, 1) (algorithm.policy_loss.eps_low)")
    return {"algorithm.policy_loss.eps_low": float(value)}


def _epsilon_high(value: Any, ctx: Context) -> dict[str, Any]:
    loss = ctx["loss_type"]
    if loss == "cispo":
        cap = ctx["epsilon"] if value is None else value
        if not (isinstance(cap, int | float) and cap > 1):
            raise Refusal("epsilon_high", value, f"TRL's cispo caps the importance weight at epsilon_high itself "
                          f"(here {cap!r}, epsilon when unset); grpo-core's cispo caps it at 1 + eps_high with "
                          "eps_high > 0, so the cap must be above 1", "epsilon_high > 1, e.g. 5.0 (ScaleRL's)")
        return {"algorithm.policy_loss.eps_high": float(cap) - 1.0}
    if loss not in CLIPPED:
        return {}
    if value is not None and not (isinstance(value, int | float) and value > 0):
        raise Refusal("epsilon_high", value, "the upper clip 1 + epsilon_high needs epsilon_high > 0",
                      "a positive number or None (algorithm.policy_loss.eps_high)")
    return {"algorithm.policy_loss.eps_high": None if value is None else float(value)}


def _delta(value: Any, ctx: Context) -> dict[str, Any]:
    if value is None or ctx["loss_type"] not in CLIPPED:
        return {}  # TRL reads delta only in the clipped losses
    if policy_loss(ctx) == "gspo":
        raise Refusal("delta", value, "grpo-core's gspo has no two-sided clip", "delta=None")
    high = ctx["epsilon"] if ctx["epsilon_high"] is None else ctx["epsilon_high"]
    if not (isinstance(value, int | float) and value > 1 + high):
        raise Refusal("delta", value, f"TRL's two-sided clip caps the ratio at delta for A < 0; it equals grpo-core's "
                      f"dual clip only above the upper clip 1 + epsilon_high = {1 + high:g} (TRL recommends that "
                      "too)", f"a delta above {1 + high:g} (algorithm.policy_loss.dual_clip)")
    return {"algorithm.policy_loss.dual_clip": float(value)}


def _vespo(option: str) -> Any:
    def to(value: Any, ctx: Context) -> dict[str, Any]:
        return {f"algorithm.policy_loss.{option}": float(value)} if ctx["loss_type"] == "vespo" else {}

    return to


def _off_policy_mask(value: Any, ctx: Context) -> dict[str, Any]:
    """TRL's ``get_off_policy_mask`` on the loss of ``loss_type``: grpo-core's ``opsm`` is the
    mask on PPO's token-level clip, so the clipped token-level losses only."""
    if value is None:
        return {}
    if policy_loss(ctx) != "opsm":
        raise Refusal("off_policy_mask_threshold", value, f"TRL masks whatever loss loss_type="
                      f"{ctx['loss_type']!r} (importance_sampling_level={ctx['importance_sampling_level']!r}) "
                      "computes; grpo-core's opsm masks PPO's token-level clip only (loss_type grpo, dr_grpo, dapo, "
                      "bnpo or luspo at importance_sampling_level='token')", "one of those, or None")
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise Refusal("off_policy_mask_threshold", value, "grpo-core's opsm threshold (delta) is a positive mean "
                      "log-ratio", "a positive number (algorithm.policy_loss.delta)")
    return {"algorithm.policy_loss.delta": float(value)}


def _sapo(option: str) -> Any:
    def to(value: Any, ctx: Context) -> dict[str, Any]:
        return {f"algorithm.policy_loss.{option}": float(value)} if ctx["loss_type"] == "sapo" else {}

    return to


def _kl_estimator(value: Any, ctx: Context) -> dict[str, Any]:
    """k3 without clamps; under ``use_bias_correction_kl`` TRL multiplies it by the
    importance ratio ``rho``, whose value is 1 on-policy but whose gradient is not 0: the
    gradient of ``rho * k3`` at ``rho = 1`` is ``(logp - ref) * grad logp``, k2's, which is
    ``k3+`` (value of k3, gradient of k2)."""
    out = {"algorithm.kl.log_ratio_clamp": None, "algorithm.kl.output_clamp": None}
    if not value or ctx["beta"] == 0:
        return {"algorithm.kl.name": "low_var_kl", **out}
    if ctx["importance_sampling_level"] == "sequence":
        raise Refusal("use_bias_correction_kl", value, "with importance_sampling_level='sequence' TRL multiplies "
                      "each token's k3 by its sequence's ratio, which no grpo-core KL estimator computes",
                      "use_bias_correction_kl=False (k3), or beta=0")
    if ctx.layout.per_step != 1:
        raise Refusal("use_bias_correction_kl", value, f"each generation batch makes {ctx.layout.per_step} "
                      "optimizer steps, so the ratio TRL multiplies the KL by departs from 1 after the first; "
                      "grpo-core's k3+ has the gradient of ratio x k3 only at ratio 1",
                      "use_bias_correction_kl=False (plain k3), or one optimizer step per generation batch")
    return {"algorithm.kl.name": "k3+", **out}


def _ref_sync(value: Any, ctx: Context) -> dict[str, Any]:
    if not value:
        return {}
    every, alpha = ctx["ref_model_sync_steps"], ctx["ref_model_mixup_alpha"]
    per_step = ctx.layout.per_step
    if not isinstance(every, int) or every < 1 or every % per_step:
        raise Refusal("ref_model_sync_steps", every, f"TRL syncs every ref_model_sync_steps optimizer steps, and a "
                      f"generation batch makes {per_step}; grpo-core syncs between rollout steps",
                      f"a multiple of {per_step} (algorithm.kl.ref_sync.every counts rollout steps)")
    return {"algorithm.kl.ref_sync": {"every": every // per_step, "alpha": alpha}}


#: TRL's ``multi_objective_aggregation`` values.
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def _scale_rewards(value: Any, ctx: Context) -> dict[str, Any]:
    scope = {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value
    if scope not in ("group", "batch", "none"):
        raise Refusal("scale_rewards", value, "TRL knows 'group' (True), 'batch' and 'none' (False)", "one of them")
    aggregation = ctx["multi_objective_aggregation"]
    if aggregation == "normalize_then_sum":
        # TRL reads no scale_rewards here: each function's scores divided by their group's unbiased
        # std + 1e-4, the weighted sum centred and divided by the batch's unbiased std + 1e-4 (GDPO)
        return {"algorithm.advantage.name": "gdpo", "algorithm.advantage.scale_by_std": True,
                "algorithm.advantage.std": "unbiased", "algorithm.advantage.eps": 1e-4,
                "algorithm.advantage.batch_norm": "sequence", "algorithm.advantage.batch_eps": 1e-4}
    if aggregation != "sum_then_normalize":
        return {}  # multi_objective_aggregation's entry says why
    return {"algorithm.advantage.name": "grpo", "algorithm.advantage.scale_by_std": scope != "none",
            "algorithm.advantage.std_scope": "batch" if scope == "batch" else "group",
            "algorithm.advantage.std": "unbiased", "algorithm.advantage.eps": 1e-4}


def _aggregation(value: Any, ctx: Context) -> dict[str, Any]:
    if value not in AGGREGATIONS:
        raise Refusal("multi_objective_aggregation", value, f"TRL knows {' and '.join(AGGREGATIONS)}", "one of them")
    return {}  # scale_rewards' entry writes the advantage keys of both


def _reward_weights(value: Any, ctx: Context) -> dict[str, Any]:
    if value is not None and ctx.rewards is not None and len(value) != ctx.rewards:
        raise Refusal("reward_weights", value, f"{len(value)} weights for {ctx.rewards} reward functions",
                      "one weight per entry of reward_funcs")
    return {}  # GRPOTrainer writes each weight into its rewards entry


def _entropy_coef(value: Any, ctx: Context) -> dict[str, Any]:
    if not value:
        return {"algorithm.entropy_coef": 0.0}
    if LOSS_TYPES.get(ctx["loss_type"], ("", ""))[1] != "token-mean" or ctx.layout.accumulation != 1 \
            or ctx.world_size != 1:
        raise Refusal("entropy_coef", value, "TRL subtracts the token mean of the entropy over each micro-batch "
                      "of each process, whatever loss_type; grpo-core subtracts the entropy per token, aggregated "
                      "as the loss is: the same only for a token-mean loss (dapo, cispo) with "
                      "gradient_accumulation_steps=1 on one process",
                      "algorithm.entropy_coef in GRPOTrainer(overrides=...), grpo-core's form")
    return {"algorithm.entropy_coef": float(value)}


def _vllm(option: str, mode: str = "colocate") -> Any:
    """A vLLM setting: it lands on the backend's option only in its mode (TRL ignores it otherwise)."""

    def to(value: Any, ctx: Context) -> dict[str, Any]:
        if not ctx["use_vllm"] or ctx["vllm_mode"] != mode:
            return {}
        return {f"rollout.{option}": value}

    return to


def _backend(value: Any, ctx: Context) -> dict[str, Any]:
    if not value:
        # model.generate with the training weights: no sampler copy, so no sampler/trainer gap
        return {"rollout.name": "hf", "rollout.dtype": None}
    mode = ctx["vllm_mode"]
    if mode == "colocate":
        return {"rollout.name": "vllm"}
    if mode == "server":
        return {"rollout.name": "vllm-server"}
    raise Refusal("vllm_mode", mode, "TRL knows 'colocate' and 'server'", "one of them")


def _server_urls(value: Any, ctx: Context) -> dict[str, Any]:
    if not ctx["use_vllm"] or ctx["vllm_mode"] != "server":
        return {}
    url = value or f"http://{ctx['vllm_server_host']}:{ctx['vllm_server_port']}"
    return {"rollout.urls": [url.rstrip("/")]}


#: TRL ``vllm_importance_sampling_mode`` -> grpo-core (level, mode).
IS_MODES = {"token_truncate": ("token", "truncate"), "token_mask": ("token", "mask"),
            "sequence_truncate": ("sequence", "truncate"), "sequence_mask": ("sequence", "mask")}


def _is_level(value: Any, ctx: Context) -> dict[str, Any]:
    mode = ctx["vllm_importance_sampling_mode"]
    if mode not in IS_MODES:
        raise Refusal("vllm_importance_sampling_mode", mode, f"TRL knows {', '.join(IS_MODES)}", "one of them")
    return {"algorithm.rollout_correction.level": IS_MODES[mode][0] if value else "off"}


def _is_mode(value: Any, ctx: Context) -> dict[str, Any]:
    return {"algorithm.rollout_correction.mode": IS_MODES[value][1]} if value in IS_MODES else {}


def _is_cap(value: Any, ctx: Context) -> dict[str, Any]:
    cap = ctx["vllm_importance_sampling_cap"] if ctx["vllm_importance_sampling_cap"] is not None else value
    if not (isinstance(cap, int | float) and cap > 1):
        raise Refusal("vllm_importance_sampling_clip_max", cap, "grpo-core's rollout correction needs a cap above 1",
                      "a number above 1 (algorithm.rollout_correction.cap)")
    return {"algorithm.rollout_correction.cap": float(cap)}


def _is_lower(value: Any, ctx: Context) -> dict[str, Any]:
    if value is None:
        return {"algorithm.rollout_correction.lower": None}
    if ctx["vllm_importance_sampling_mode"] in ("token_truncate", "sequence_truncate"):
        raise Refusal("vllm_importance_sampling_clip_min", value, "TRL's truncate modes raise ratios below it to it; "
                      "grpo-core's lower bound zeroes them (a mask)", "a *_mask mode, or None")
    if not (isinstance(value, int | float) and 0 < value < 1):
        raise Refusal("vllm_importance_sampling_clip_min", value, "grpo-core's lower bound is in (0, 1)",
                      "a value in (0, 1) (algorithm.rollout_correction.lower)")
    return {"algorithm.rollout_correction.lower": float(value)}


def init_kwargs(value: Any) -> dict[str, Any]:
    """``model_init_kwargs`` as a dict: None is empty, a JSON string (TRL's command line) is parsed."""
    if value is None:
        return {}
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except ValueError:
            raise Refusal("model_init_kwargs", value, "a string must be a JSON object", "a dict") from None
    if not isinstance(value, dict):
        raise Refusal("model_init_kwargs", value, "must be a dict of from_pretrained arguments", "a dict")
    return value


#: ``BitsAndBytesConfig`` field -> ``model.quantization`` key (QLoRA's 4-bit base).
QUANTIZATION_FIELDS = {"bnb_4bit_quant_type": "quant_type", "bnb_4bit_use_double_quant": "double_quant",
                       "bnb_4bit_compute_dtype": "compute_dtype"}


def quantization_keys(field: str, value: Any) -> dict[str, Any]:
    """The ``model.quantization.*`` keys of a transformers ``BitsAndBytesConfig`` (or its dict):
    4-bit only, with :data:`QUANTIZATION_FIELDS` carried over; any other setting away from
    ``BitsAndBytesConfig(load_in_4bit=True)``'s default is a :class:`Refusal`."""
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig.from_dict(dict(value)) if isinstance(value, Mapping) else value
    if not isinstance(config, BitsAndBytesConfig):
        raise Refusal(field, type(value).__name__, "grpo-core quantizes with bitsandbytes only",
                      "a transformers BitsAndBytesConfig(load_in_4bit=True, ...) (model.quantization)")
    if not config.load_in_4bit:
        raise Refusal(field, "load_in_8bit=True" if config.load_in_8bit else "load_in_4bit=False",
                      "grpo-core loads a quantized base in 4 bits only", "BitsAndBytesConfig(load_in_4bit=True)")
    mine, default = config.to_dict(), BitsAndBytesConfig(load_in_4bit=True).to_dict()
    other = {k: v for k, v in mine.items() if k not in QUANTIZATION_FIELDS and v != default.get(k)}
    if other:
        raise Refusal(field, other, "grpo-core sets only bnb_4bit_quant_type, bnb_4bit_use_double_quant and "
                      "bnb_4bit_compute_dtype", "leave the other BitsAndBytesConfig fields at their defaults")
    out = {f"model.quantization.{QUANTIZATION_FIELDS[k]}": mine[k] for k in QUANTIZATION_FIELDS}
    out["model.quantization.compute_dtype"] = str(out["model.quantization.compute_dtype"]).replace("torch.", "")
    return out


def _model_init(value: Any, ctx: Context) -> dict[str, Any]:
    kwargs = init_kwargs(value)
    if ctx.values.get("_model_object"):
        return {}  # TRL ignores them for a model object too
    out: dict[str, Any] = {}
    for key, item in kwargs.items():
        if key in ("dtype", "torch_dtype"):
            name = str(item).replace("torch.", "")
            if name not in ("float32", "bfloat16", "float16"):
                raise Refusal("model_init_kwargs", {key: item}, "grpo-core loads the policy in float32, bfloat16 "
                              "or float16 (no 'auto')", "dtype='float32', 'bfloat16' or 'float16' (model.dtype)")
            out["model.dtype"] = name
        elif key in ("revision", "attn_implementation"):
            out[f"model.{key}"] = item
        elif key == "quantization_config" and item is not None:
            try:
                out.update(quantization_keys("model_init_kwargs", item))
            except Refusal as exc:
                raise Refusal("model_init_kwargs", {key: exc.value}, exc.why, exc.instead) from None
        elif key in ("device_map", "low_cpu_mem_usage", "trust_remote_code"):
            if key == "device_map" and item not in (None, "auto"):
                raise Refusal("model_init_kwargs", {key: item}, "grpo-core places the policy on train.device",
                              "train.device, or the launcher's processes (train.parallel)")
        else:
            raise Refusal("model_init_kwargs", {key: item}, "grpo-core loads the policy with dtype, revision, "
                          "attn_implementation, quantization_config and trust_remote_code only",
                          "drop it, or pass a loaded model")
    return out


def _trust(value: Any, ctx: Context) -> dict[str, Any]:
    try:
        kwargs = init_kwargs(ctx["model_init_kwargs"])
    except Refusal:
        kwargs = {}  # model_init_kwargs' own entry says why
    return {"model.trust_remote_code": bool(kwargs.get("trust_remote_code", value))}


def _max_completion_length(value: Any, ctx: Context) -> dict[str, Any]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Refusal("max_completion_length", value, "grpo-core bounds every completion", "a positive integer")
    return {"rollout.max_new_tokens": value}


def _eval_n(value: Any, ctx: Context) -> dict[str, Any]:
    n = ctx.layout.group if value is None else value
    return {"eval.n": n, "eval.greedy": False}


def _completions_log(value: Any, ctx: Context) -> dict[str, Any]:
    if not value:
        return {"train.log_completions_every": 0}
    return {"train.log_completions_every": ctx.optimizer_steps_to_rollout_steps("logging_steps", ctx["logging_steps"])}


def _no_kwargs(value: Any) -> bool:
    return not value


_ADAPTIVE = "read only with use_adaptive_entropy=True, which is refused"

FIELDS: list[TRLField] = [
    # ----- the model
    mapped("model_init_kwargs", None, ("model.dtype", "model.revision", "model.attn_implementation"),
           "dtype (or torch_dtype), revision and attn_implementation land on model.*, a 4-bit BitsAndBytesConfig "
           "quantization_config on model.quantization (QLoRA, with peft_config); device_map None or 'auto' is "
           "accepted (placement); any other key is refused", _model_init,
           note="Ignored for a loaded model object, as TRL ignores it. TRL's default dtype is float32, as "
           "model.dtype's; 'auto' is refused (name the dtype).",
           examples=(({"dtype": "bfloat16", "revision": "main"},
                      {"model.dtype": "bfloat16", "model.revision": "main"}),
                     ('{"torch_dtype": "float16"}', {"model.dtype": "float16"})),
           refusals=(({"dtype": "auto"}, "model.dtype"), ({"quantization_config": {"load_in_8bit": True}},
                                                              "load_in_4bit"))),
    mapped("trust_remote_code", False, "model.trust_remote_code", "as is (model_init_kwargs' wins, as in TRL)",
           _trust, note="Also applied to reward models named by a string, as TRL does.",
           examples=((True, {"model.trust_remote_code": True}),)),
    refused("router_aux_loss_coef", None, "grpo-core adds no Mixture-of-Experts load-balancing loss",
            "None (a MoE model's own config then decides in TRL; grpo-core adds no auxiliary loss)", bad=0.01),
    refused("disable_dropout", False, "grpo-core trains with the model's own dropout",
            "set the dropout fields of the model's config to 0 and pass the loaded model", bad=True),
    refused("cast_lm_head_to_fp32", False, "grpo-core computes the output layer in the policy's compute dtype",
            "model.dtype float32, or train.mixed_precision 'no'", bad=True),
    # ----- data
    ignored("remove_unused_columns", False, "grpo-core passes each reward function every dataset column as a "
            "keyword argument, as TRL's default (False) does; True would only hide columns from them"),
    mapped("num_generations", 8, "rollout.group_size", "as is (G)", same("rollout.group_size"),
           examples=((4, {"rollout.group_size": 4, "train.prompts_per_step": 2}),),
           refusals=((1, "an integer >= 2"),)),
    mapped("num_generations_eval", None, ("eval.n", "eval.greedy"),
           "eval.n = the value (num_generations when None); eval.greedy = false", _eval_n,
           note="TRL's evaluation samples num_generations_eval completions per prompt at the training temperature "
           "and reports their mean reward: grpo-core's eval.n sampled completions (mean@n), without the greedy one.",
           examples=((2, {"eval.n": 2, "eval.greedy": False}),)),
    mapped("max_completion_length", 512, "rollout.max_new_tokens", "as is", _max_completion_length,
           examples=((64, {"rollout.max_new_tokens": 64}),), refusals=((None, "a positive integer"),)),
    ignored("ds3_gather_for_generation", True, "DeepSpeed ZeRO-3 only; grpo-core shards with FSDP2"),
    mapped("shuffle_dataset", True, "data.shuffle", "as is", same("data.shuffle"),
           examples=((False, {"data.shuffle": False}),)),
    ignored("pad_to_multiple_of", "auto", "padding changes shapes, not what is computed on the tokens"),
    # ----- generation
    mapped("generation_batch_size", None, "train.prompts_per_step",
           "P = generation_batch_size / num_generations; None: per_device_train_batch_size x processes x "
           "steps_per_generation, as TRL", lambda v, ctx: {"train.prompts_per_step": ctx.layout.prompts},
           note="TRL's per_device_train_batch_size counts completions, not prompts.",
           examples=((32, {"train.prompts_per_step": 4, "train.mini_batches": 4}),),
           refusals=((12, "a multiple of num_generations", {"per_device_train_batch_size": 4}),)),
    mapped("steps_per_generation", None, "train.mini_batches",
           "steps_per_generation / gradient_accumulation_steps optimizer steps per generation batch",
           lambda v, ctx: {"train.mini_batches": ctx.layout.mini_batches},
           note="With more than one optimizer step per generation batch, TRL splits the shuffled batch into "
           "random rows, grpo-core into whole groups (a group never spans two optimizer steps); and TRL's dapo "
           "divides each step by the batch's average token count per step, grpo-core's token-mean by the step's "
           "own. The same in expectation, not row for row.",
           examples=((2, {"train.mini_batches": 2, "train.prompts_per_step": 2}),),
           refusals=((3, "a multiple of gradient_accumulation_steps", {"gradient_accumulation_steps": 2}),)),
    mapped("temperature", 1.0, ("rollout.temperature", "eval.temperature"), "as is, for sampling and log-probs",
           lambda v, ctx: {"rollout.temperature": v, "eval.temperature": v},
           examples=((0.7, {"rollout.temperature": 0.7, "eval.temperature": 0.7}),)),
    mapped("top_p", 1.0, ("rollout.top_p", "eval.top_p"), "as is", lambda v, ctx: {"rollout.top_p": v, "eval.top_p": v},
           examples=((0.9, {"rollout.top_p": 0.9, "eval.top_p": 0.9}),)),
    mapped("top_k", 0, "rollout.top_k", "as is (0: off)", same("rollout.top_k"),
           examples=((50, {"rollout.top_k": 50}),)),
    refused("min_p", None, "grpo-core's samplers have no min-p filter", "rollout.top_p or rollout.top_k", bad=0.1),
    refused("generation_kwargs", None, "grpo-core passes no free-form generation arguments to its backend",
            "the rollout.* sampling keys", accepts=_no_kwargs, bad={"num_beams": 2}),
    mapped("chat_template_kwargs", None, "data.chat_template_kwargs", "as is ({} when None)",
           lambda v, ctx: {"data.chat_template_kwargs": dict(v or {})},
           examples=(({"enable_thinking": False}, {"data.chat_template_kwargs": {"enable_thinking": False}}),)),
    refused("repetition_penalty", 1.0, "grpo-core samples from the policy's distribution without penalties",
            "1.0", bad=1.1),
    ignored("cache_implementation", None, "the KV cache's layout changes speed and memory, not the tokens"),
    # ----- vLLM
    mapped("use_vllm", False, ("rollout.name", "rollout.dtype"),
           "False: hf with rollout.dtype null; True: vllm (vllm_mode='colocate') or vllm-server ('server')", _backend,
           note="TRL without vLLM generates with the training model (its generate method), so the door sets the hf "
           "backend's dtype to null: no bfloat16 sampling copy, no sampler/trainer gap. grpo-core's faster bf16 "
           "copy is one override away: overrides={'rollout.dtype': 'auto'}.",
           examples=((True, {"rollout.name": "vllm"}),)),
    mapped("vllm_mode", "colocate", "rollout.name", "see use_vllm", lambda v, ctx: {},
           note="'server' needs servers started with `grpo-run serve` (not `trl vllm-serve`: another protocol).",
           examples=(("server", {"rollout.name": "vllm-server", "rollout.urls": ["http://0.0.0.0:8000"]},
                      {"use_vllm": True}),),
           refusals=(("remote", "one of them", {"use_vllm": True}),)),
    mapped("vllm_model_impl", "vllm", "rollout.model_impl", "as is (colocate)", _vllm("model_impl"),
           examples=(("transformers", {"rollout.model_impl": "transformers"}, {"use_vllm": True}),)),
    mapped("vllm_enable_sleep_mode", False, "rollout.enable_sleep_mode", "as is (colocate)",
           _vllm("enable_sleep_mode"), examples=((True, {"rollout.enable_sleep_mode": True}, {"use_vllm": True}),)),
    refused("vllm_structured_outputs_regex", None, "grpo-core does not constrain generation to a regular expression",
            "a format reward (rewards: format)", bad="[0-9]+"),
    mapped("vllm_server_base_url", None, "rollout.urls", "[base_url], else ['http://HOST:PORT'] (server)",
           _server_urls, examples=(("http://gen:8000/", {"rollout.urls": ["http://gen:8000"]},
                                    {"use_vllm": True, "vllm_mode": "server"}),)),
    mapped("vllm_server_host", "0.0.0.0", "rollout.urls", "see vllm_server_base_url", lambda v, ctx: {},
           examples=(("10.0.0.2", {"rollout.urls": ["http://10.0.0.2:8000"]},
                      {"use_vllm": True, "vllm_mode": "server"}),)),
    mapped("vllm_server_port", 8000, "rollout.urls", "see vllm_server_base_url", lambda v, ctx: {},
           examples=((9000, {"rollout.urls": ["http://0.0.0.0:9000"]}, {"use_vllm": True, "vllm_mode": "server"}),)),
    ignored("vllm_server_timeout", 240.0, "how long TRL waits for a server to come up; grpo-core's servers are "
            "reached per request (rollout.timeout_s), which changes no result"),
    mapped("vllm_group_port", 51216, "rollout.weight_port", "as is (server)", _vllm("weight_port", "server"),
           examples=((52000, {"rollout.weight_port": 52000}, {"use_vllm": True, "vllm_mode": "server"}),)),
    mapped("vllm_gpu_memory_utilization", 0.3, "rollout.gpu_memory_utilization", "as is (colocate)",
           _vllm("gpu_memory_utilization"),
           examples=((0.5, {"rollout.gpu_memory_utilization": 0.5}, {"use_vllm": True}),)),
    mapped("vllm_max_model_length", None, "rollout.max_model_len", "as is (colocate)", _vllm("max_model_len"),
           examples=((4096, {"rollout.max_model_len": 4096}, {"use_vllm": True}),)),
    mapped("vllm_tensor_parallel_size", 1, "rollout.tensor_parallel_size", "as is (colocate)",
           _vllm("tensor_parallel_size"), examples=((2, {"rollout.tensor_parallel_size": 2}, {"use_vllm": True}),)),
    # ----- the objective
    mapped("beta", 0.0, "algorithm.kl.beta", "as is (0: no reference model)", same("algorithm.kl.beta"),
           note="TRL's KL is k3 in the loss (placement: loss), without clamps: see use_bias_correction_kl.",
           examples=((0.04, {"algorithm.kl.beta": 0.04, "algorithm.kl.name": "k3+"}),)),
    mapped("num_iterations", 1, "algorithm.mu", "as is (mu)", same("algorithm.mu"),
           examples=((2, {"algorithm.mu": 2}),), refusals=((0, "an integer >= 1"),)),
    mapped("epsilon", 0.2, "algorithm.policy_loss.eps_low", "as is (the clipped losses)", _epsilon,
           examples=((0.1, {"algorithm.policy_loss.eps_low": 0.1}),), refusals=((1.5, "a value in (0, 1)"),)),
    mapped("delta", None, "algorithm.policy_loss.dual_clip", "as is (clip), when above 1 + epsilon_high", _delta,
           note="TRL's two-sided clip (INTELLECT-2) caps the ratio at delta; for A < 0 that is the dual clip, and "
           "for A > 0 the ordinary clip already binds below delta.",
           examples=((3.0, {"algorithm.policy_loss.dual_clip": 3.0}),),
           refusals=((1.1, "algorithm.policy_loss.dual_clip"),)),
    mapped("epsilon_high", None, "algorithm.policy_loss.eps_high",
           "as is (clip, gspo); cispo: epsilon_high - 1 (TRL caps cispo's weight at epsilon_high itself)",
           _epsilon_high,
           examples=((0.28, {"algorithm.policy_loss.eps_high": 0.28}),
                     (5.0, {"algorithm.policy_loss.name": "cispo", "algorithm.policy_loss.eps_high": 4.0},
                      {"loss_type": "cispo"})),
           refusals=((-0.1, "a positive number"),)),
    mapped("sapo_temperature_neg", 1.05, "algorithm.policy_loss.tau_neg", "as is (sapo)", _sapo("tau_neg"),
           examples=((1.2, {"algorithm.policy_loss.tau_neg": 1.2}, {"loss_type": "sapo"}),)),
    mapped("sapo_temperature_pos", 1.0, "algorithm.policy_loss.tau_pos", "as is (sapo)", _sapo("tau_pos"),
           examples=((0.8, {"algorithm.policy_loss.tau_pos": 0.8}, {"loss_type": "sapo"}),)),
    mapped("vespo_k_pos", 2.0, "algorithm.policy_loss.k_pos", "as is (vespo)", _vespo("k_pos"),
           examples=((1.5, {"algorithm.policy_loss.k_pos": 1.5}, {"loss_type": "vespo"}),)),
    mapped("vespo_lambda_pos", 3.0, "algorithm.policy_loss.lambda_pos", "as is (vespo)", _vespo("lambda_pos"),
           examples=((2.5, {"algorithm.policy_loss.lambda_pos": 2.5}, {"loss_type": "vespo"}),)),
    mapped("vespo_k_neg", 3.0, "algorithm.policy_loss.k_neg", "as is (vespo)", _vespo("k_neg"),
           examples=((4.0, {"algorithm.policy_loss.k_neg": 4.0}, {"loss_type": "vespo"}),)),
    mapped("vespo_lambda_neg", 2.0, "algorithm.policy_loss.lambda_neg", "as is (vespo)", _vespo("lambda_neg"),
           examples=((1.0, {"algorithm.policy_loss.lambda_neg": 1.0}, {"loss_type": "vespo"}),)),
    mapped("importance_sampling_level", "token", "algorithm.policy_loss.name",
           "'sequence' turns the clipped losses into gspo (with epsilon / epsilon_high as its clip range)",
           lambda v, ctx: {},
           note="TRL's sequence ratio is the exp of the mean token log-ratio, gspo's; set epsilon=3e-4, "
           "epsilon_high=4e-4 for the GSPO paper's range (TRL's defaults stay 0.2).",
           examples=(("sequence", {"algorithm.policy_loss.name": "gspo"}, {"use_bias_correction_kl": False}),),
           refusals=(("sentence", "one of them"),)),
    mapped("reward_weights", None, "rewards[i].weight", "one weight per reward function, in order (1.0 each "
           "when None)", _reward_weights, examples=(([0.5], {"rewards[0].weight": 0.5}),),
           refusals=(([1.0, 2.0], "one weight per entry of reward_funcs"),)),
    mapped("multi_objective_aggregation", "sum_then_normalize", "algorithm.advantage.name",
           "sum_then_normalize: grpo (see scale_rewards); normalize_then_sum: gdpo with std unbiased, eps 1e-4, "
           "batch_norm sequence, batch_eps 1e-4 (scale_rewards is not read, as in TRL)", _aggregation,
           note="normalize_then_sum is GDPO's (Liu et al. 2026): each reward function's scores normalized in its "
           "group, the weighted sum normalized over the generation batch, both with TRL's unbiased std + 1e-4.",
           examples=(("normalize_then_sum", {"algorithm.advantage.name": "gdpo", "algorithm.advantage.eps": 1e-4,
                                             "algorithm.advantage.batch_norm": "sequence",
                                             "algorithm.advantage.batch_eps": 1e-4}),),
           refusals=(("sum", "one of them"),)),
    mapped("scale_rewards", "group", ("algorithm.advantage.name", "algorithm.advantage.scale_by_std",
                                      "algorithm.advantage.std_scope", "algorithm.advantage.std",
                                      "algorithm.advantage.eps", "algorithm.advantage.batch_norm",
                                      "algorithm.advantage.batch_eps"),
           "group (True): std per group; batch: one std over the batch; none (False): no scaling. Always std "
           "unbiased, eps 1e-4 (TRL divides by std + 1e-4, with Bessel's correction)", _scale_rewards,
           examples=(("batch", {"algorithm.advantage.std_scope": "batch", "algorithm.advantage.std": "unbiased"}),
                     (False, {"algorithm.advantage.scale_by_std": False})),
           refusals=(("prompt", "one of them"),)),
    mapped("loss_type", "dapo", ("algorithm.policy_loss.name", "algorithm.aggregation.name"),
           "grpo: clip + seq-mean-token-mean; dr_grpo: clip + seq-mean-token-sum-norm; dapo: clip + token-mean; "
           "bnpo: clip + token-mean (gradient_accumulation_steps=1, one process); cispo: cispo + token-mean; sapo: "
           "sapo + seq-mean-token-mean; luspo: clip + seq-mean-token-sum (gspo at importance_sampling_level="
           "'sequence', the paper's setup); vespo: vespo + token-mean (without vLLM's importance-sampling "
           "correction). The ratio's log_ratio_clamp is null, but for vespo (TRL clamps nothing)", _loss_type,
           note="luspo at TRL's default importance_sampling_level='token' is taken as TRL takes it, with TRL's "
           "warning: PPO's token-level clip, each sequence's token sum averaged over the sequences.",
           examples=(("grpo", {"algorithm.aggregation.name": "seq-mean-token-mean"}),
                     ("dr_grpo", {"algorithm.aggregation.name": "seq-mean-token-sum-norm"}),
                     ("sapo", {"algorithm.policy_loss.name": "sapo"}),
                     ("luspo", {"algorithm.policy_loss.name": "gspo", "algorithm.aggregation.name":
                                "seq-mean-token-sum"}, {"importance_sampling_level": "sequence",
                                                        "use_bias_correction_kl": False}),
                     ("luspo", {"algorithm.policy_loss.name": "clip", "algorithm.aggregation.name":
                                "seq-mean-token-sum"}),
                     ("vespo", {"algorithm.policy_loss.name": "vespo", "algorithm.aggregation.name": "token-mean"})),
           refusals=(("vespo", "vllm_importance_sampling_correction=False", {"use_vllm": True}),
                     ("grpo_v2", "one of them"))),
    mapped("mask_truncated_completions", False, "rollout.mask_truncated_completions", "as is",
           same("rollout.mask_truncated_completions"),
           examples=((True, {"rollout.mask_truncated_completions": True}),)),
    mapped("sync_ref_model", False, "algorithm.kl.ref_sync",
           "{every: ref_model_sync_steps / optimizer steps per generation batch, alpha: ref_model_mixup_alpha}",
           _ref_sync, examples=((True, {"algorithm.kl.ref_sync.every": 512, "algorithm.kl.ref_sync.alpha": 0.6},
                                 {"beta": 0.1}),)),
    mapped("ref_model_mixup_alpha", 0.6, "algorithm.kl.ref_sync.alpha", "see sync_ref_model", lambda v, ctx: {},
           examples=((0.9, {"algorithm.kl.ref_sync.alpha": 0.9}, {"sync_ref_model": True, "beta": 0.1}),)),
    mapped("ref_model_sync_steps", 512, "algorithm.kl.ref_sync.every", "see sync_ref_model", lambda v, ctx: {},
           examples=((64, {"algorithm.kl.ref_sync.every": 32},
                      {"sync_ref_model": True, "beta": 0.1, "num_iterations": 2, "use_bias_correction_kl": False}),),
           refusals=((3, "a multiple of 2", {"sync_ref_model": True, "beta": 0.1, "num_iterations": 2,
                                               "use_bias_correction_kl": False}),)),
    refused("top_entropy_quantile", 1.0, "grpo-core has no entropy-quantile mask on the policy loss",
            "1.0, or a policy-loss plugin (algorithm.policy_loss.name)", bad=0.2),
    mapped("entropy_coef", 0.0, "algorithm.entropy_coef",
           "as is, for a token-mean loss (dapo, cispo) with gradient_accumulation_steps=1 on one process",
           _entropy_coef, examples=((0.01, {"algorithm.entropy_coef": 0.01}),),
           refusals=((0.01, "algorithm.entropy_coef in GRPOTrainer(overrides=...)", {"loss_type": "grpo"}),)),
    refused("use_adaptive_entropy", False, "grpo-core's entropy coefficient is fixed", "algorithm.entropy_coef",
            bad=True),
    ignored("entropy_coef_min", 0.0, _ADAPTIVE),
    ignored("entropy_coef_max", 1.0, _ADAPTIVE),
    ignored("entropy_coef_delta", 0.005, _ADAPTIVE),
    ignored("entropy_target", 0.2, _ADAPTIVE),
    ignored("max_tool_calling_iterations", None, "read by GRPOTrainer with tools= or environment_factory (the "
            "rounds of tool calls of TRL's loop, run as an agent), and without them by nothing, as in TRL"),
    mapped("vllm_importance_sampling_correction", True, "algorithm.rollout_correction.level",
           "the mode's level (token or sequence); False: off", _is_level,
           note="grpo-core weights only completions whose backend returns sampling log-probs (vllm does; hf with "
           "rollout.dtype null, the door's default without vLLM, does not), as TRL corrects only vLLM's.",
           examples=((False, {"algorithm.rollout_correction.level": "off"}),)),
    mapped("vllm_importance_sampling_mode", "sequence_mask", "algorithm.rollout_correction.mode",
           "token_truncate: token + truncate; token_mask: token + mask; sequence_truncate: sequence + truncate; "
           "sequence_mask: sequence + mask (the sequence ratio is the product over tokens in both)", _is_mode,
           examples=(("token_truncate", {"algorithm.rollout_correction.level": "token",
                                         "algorithm.rollout_correction.mode": "truncate"}),),
           refusals=(("token_clip", "one of them"),)),
    mapped("vllm_importance_sampling_clip_max", 3.0, "algorithm.rollout_correction.cap", "as is (above 1)", _is_cap,
           examples=((5.0, {"algorithm.rollout_correction.cap": 5.0}),), refusals=((None, "a number above 1"),)),
    mapped("vllm_importance_sampling_clip_min", None, "algorithm.rollout_correction.lower",
           "as is, in (0, 1), mask modes only", _is_lower,
           examples=((0.5, {"algorithm.rollout_correction.lower": 0.5}),),
           refusals=((0.5, "a *_mask mode", {"vllm_importance_sampling_mode": "token_truncate"}),)),
    mapped("off_policy_mask_threshold", None, ("algorithm.policy_loss.name", "algorithm.policy_loss.delta"),
           "a threshold: the clip loss becomes opsm with delta = the threshold (loss_type grpo, dr_grpo, dapo, "
           "bnpo at token level); None: no mask", _off_policy_mask,
           note="TRL's get_off_policy_mask (DeepSeek-V3.2's off-policy sequence masking): a completion with A < 0 "
           "whose mean log(pi_sampler / pi) exceeds the threshold is left out of the loss; the sampler's "
           "log-probs are vLLM's, else the old policy's, in both.",
           examples=((0.5, {"algorithm.policy_loss.name": "opsm", "algorithm.policy_loss.delta": 0.5}),),
           refusals=((0.5, "or None", {"loss_type": "sapo"}), (-0.1, "a positive number"))),
    mapped("use_bias_correction_kl", True, "algorithm.kl.name",
           "with beta > 0: True: k3+ (value of k3, gradient of k2: the gradient of TRL's ratio x k3 at ratio 1, "
           "one optimizer step per generation batch, token level); False: low_var_kl (k3). Clamps null",
           _kl_estimator, examples=((False, {"algorithm.kl.name": "low_var_kl"}, {"beta": 0.04}),),
           refusals=((True, "use_bias_correction_kl=False", {"beta": 0.04, "num_iterations": 2}),)),
    # ----- logging
    mapped("log_completions", False, "train.log_completions_every",
           "True: every logging_steps (in rollout steps); False: 0", _completions_log,
           examples=((True, {"train.log_completions_every": 10}),)),
    ignored("log_multimodal", True, "images in the completions table; grpo-core logs completions as text"),
    ignored("num_completions_to_print", None, "how many completions TRL prints"),
    ignored("log_unique_prompts", False, "how TRL's completions table shows prompts"),
    refused("log_completions_hub_repo", None, "grpo-core does not upload completion tables",
            "a tracker (report_to) that keeps the completions table", bad="me/completions"),
    ignored("use_transformers_continuous_batching", False, "a faster generate for the same tokens"),
    ignored("transformers_continuous_batching_config", None, "settings of continuous batching (speed)"),
    ignored("use_transformers_paged", False, "deprecated alias of use_transformers_continuous_batching (speed)"),
    mapped("vllm_importance_sampling_cap", None, "algorithm.rollout_correction.cap",
           "deprecated alias of vllm_importance_sampling_clip_max, which it replaces when set", lambda v, ctx: {},
           examples=((4.0, {"algorithm.rollout_correction.cap": 4.0}),)),
]

__all__ = ["CLIPPED", "FIELDS", "IS_MODES", "LOSS_TYPES", "init_kwargs", "policy_loss"]
