"""``GRPOTrainer``: TRL 1.16's trainer arguments, run by :class:`grpo_core.Trainer`.

The door adds nothing of its own to a run: it turns TRL's arguments into a spec (the
config's fields through the table, the model, the reward functions, the datasets, a
``peft.LoraConfig``) plus the in-memory objects, and hands both to :class:`grpo_core.Trainer`,
which validates the spec and runs the same loop as ``grpo-run``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_core.errors import SpecError, UsageError
from grpo_core.trainer import Trainer, TrainResult, as_rows
from grpo_core.trl.config import BY_NAME, FIELDS, GRPOConfig, TRLConfigError
from grpo_core.trl.grpo_fields import init_kwargs, quantization_keys, trl_warnings
from grpo_core.trl.table import Refusal

log = logging.getLogger("grpo.trl")

#: How TRL 1.16's tool loop (``GRPOTrainer._tool_call_loop``) differs from grpo-core's ``tools``
#: environment in what the model reads: why ``tools=`` and ``environment_factory`` are refused.
TOOL_DIFFERENCES = (
    "TRL parses a call with the tokenizer's response schema (transformers' parse_response, per model family), "
    "grpo-core the Hermes/Qwen <tool_call>{json}</tool_call> form",
    "TRL shows a result as str(result) (a dict as Python's repr) and a failure as {'error': '...'}, grpo-core a "
    "result as JSON and a failure as 'error: ...'",
    "grpo-core cuts a result at max_tool_output_chars, abandons a call after tool_timeout and runs "
    "max_calls_per_turn calls a turn, TRL none of these",
)

#: Where each of ``GRPOTrainer``'s arguments goes (for the docs): (argument, where, note).
ARGUMENTS: list[tuple[str, str, str]] = [
    ("model", "model.path, or grpo_core.Trainer(model=...)",
     "A Hub id or folder is loaded by grpo-core (model.dtype from model_init_kwargs, float32 by default, as TRL); "
     "a loaded transformers causal LM is trained in place. A PeftModel is refused: pass its base model and "
     "peft_config."),
    ("reward_funcs", "rewards, and grpo_core.Trainer(reward_funcs=...)",
     "A callable with TRL's signature (sync or async) is registered under its __name__; a string (a Hub id or "
     "folder of a sequence-classification model) becomes a reward_model entry as TRL scores with it (its first "
     "logit, no length limit, no special tokens added, dtype as transformers loads it); a list mixes both, in "
     "order, weighted by reward_weights."),
    ("args", "the spec, through the field table", "A GRPOConfig of this module; None: GRPOConfig('MODEL-GRPO'), "
     "as TRL."),
    ("train_dataset", "data (grpo_core.Trainer(train_dataset=...))",
     "A datasets.Dataset, a pandas DataFrame or a list of dicts with a 'prompt' column (text or chat messages); "
     "every other column reaches the reward functions. Required. An IterableDataset streams (as TRL takes it: "
     "max_steps required), through a seeded shuffle buffer with an exact resume (data.shuffle_buffer)."),
    ("sft_args, sft_dataset, sft_eval_dataset", "sft (grpo_core.Trainer(sft_dataset=...))",
     "Not TRL's: a cold-start SFT stage before GRPO. sft_args is a grpo_core.trl.SFTConfig (TRL SFTConfig's "
     "common arguments, the others refused by name); sft_dataset the demonstrations (prompt + completion rows, or "
     "a messages column with assistant_only_loss=True)."),
    ("eval_dataset", "the held-out split, or eval.sets",
     "One dataset, or {name: dataset} (a DatasetDict too) for named sets logged under eval/NAME/."),
    ("processing_class", "grpo_core.Trainer(tokenizer=...)",
     "A tokenizer, or for rows with images (an 'image' or 'images' column, TRL's names) the model's processor "
     "(None loads it from the model); the column becomes data.image_column."),
    ("reward_processing_classes", "refused unless None",
     "grpo-core's reward_model loads the tokenizer saved with the reward model."),
    ("callbacks", "grpo_core.Trainer(callbacks=...)",
     "grpo_core.Callback objects or functions (on_step(step, metrics), on_eval, on_save). transformers "
     "TrainerCallbacks are refused: their hooks receive the transformers Trainer's state and control objects, "
     "which grpo-core's loop does not have."),
    ("optimizers", "refused unless (None, None)", "train.lr, train.adam_*, train.schedule set the optimizer."),
    ("quantization_config", "model.quantization", "A transformers BitsAndBytesConfig with load_in_4bit=True "
     "(QLoRA, with peft_config): bnb_4bit_quant_type, bnb_4bit_use_double_quant and bnb_4bit_compute_dtype; "
     "8 bits, or any other field away from its default, is refused. Not with a loaded model object."),
    ("peft_config", "model.lora", "A peft.LoraConfig: r, lora_alpha, lora_dropout and target_modules (None: "
     "peft's default for the model type, resolved here); any other setting away from peft's default is refused."),
    ("tools", "rollout.agent (TRL's tool loop as an agent, grpo_core.trl.tool_loop)",
     "Each function is a tool, its JSON schema read off its signature and docstring as TRL reads it; the loop runs "
     "as an agent against the run's endpoint: the chat template shows the tools and the tool messages, the endpoint "
     "parses the calls per model family (Hermes/Qwen, Llama 3, Mistral; TRL uses the tokenizer's response schema), "
     "a result is shown as str(result) and a failure as {'error': '...'}, as in TRL; at most "
     "max_tool_calling_iterations rounds (rollout.agent.max_calls = rounds + 1), max_completion_length tokens per "
     "turn and per episode (rollout.agent.max_total_tokens). The chat template must render tool calls."),
    ("rollout_func", "refused unless None", "TRL calls rollout_func(prompts, trainer) with its own GRPOTrainer "
     "(its vLLM engine, tokenizer and state), which grpo-core does not have. A program that talks to a model is "
     "an agent (grpo_core.Trainer(agent=...), served the policy at an OpenAI-compatible endpoint); a generation "
     "engine is a rollout-backend plugin (rollout.name)."),
    ("environment_factory", "rollout.agent (the same tool loop, one environment per episode)",
     "A callable (or {name: callable}, chosen by each row's 'environment' column) making an environment with "
     "reset(**row) (a string it returns is appended to the last user message) and public methods as tools, as in "
     "TRL; get_reward(), when the class has one, is the episode's reward, scored as env_reward with weight 1 "
     "(TRL names its column after the class), and reward_funcs may then be empty. One environment is made per "
     "episode (TRL reuses a pool, resetting each). Reward functions that take environments= are refused: "
     "grpo-core passes rewards the dataset columns and completions."),
    ("overrides", "grpo_core.Trainer(overrides=...)",
     "grpo-core's own: spec keys applied after the table, e.g. {'rollout.dtype': 'auto', 'train.threads': 4}."),
]

#: ``peft.LoraConfig`` field -> ``model.lora`` key.
LORA_FIELDS = {"r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout", "target_modules": "target_modules"}
#: LoraConfig fields that do not change the adapter.
_LORA_NEUTRAL = {"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
                 "inference_mode", "runtime_config", "megatron_core"}
#: Reward-function parameters through which TRL hands its own objects, which grpo-core does not.
_TRL_ONLY_KWARGS = ("trainer_state", "log_extra", "log_metric", "environments")


@dataclass
class TRLTrainResult(TrainResult):
    """:class:`grpo_core.TrainResult`, plus the two attributes of TRL's ``TrainOutput`` a
    script reads: ``global_step`` (optimizer steps, as TRL counts) and ``training_loss``
    (the mean loss over the steps)."""

    optimizer_steps_per_step: int = 1

    @property
    def global_step(self) -> int:
        return self.step * self.optimizer_steps_per_step

    @property
    def training_loss(self) -> float:
        losses = [row["loss"] for row in self.history if "loss" in row]
        return sum(losses) / len(losses) if losses else float("nan")


# --------------------------------------------------------------------------- arguments
def _image_column(rows: list[dict], processing_class: Any, problems: list[str]) -> str | None:
    """TRL's image column of ``rows`` (``image``, or ``images`` for several a row), which
    becomes ``data.image_column``; a processor without one, or a plain tokenizer with one,
    is a problem named in ``problems``."""
    column = next((c for c in ("image", "images") if rows and c in rows[0]), None)
    multimodal = getattr(processing_class, "image_processor", None) is not None
    if multimodal and column is None:
        problems.append("processing_class: the model's processor, but train_dataset has no 'image' or 'images' "
                        "column (TRL's names for a row's images); instead: its tokenizer, or add the column")
    elif column is not None and processing_class is not None and not multimodal:
        problems.append(f"processing_class: a tokenizer, but train_dataset's '{column}' column holds images; "
                        "instead: the model's processor (AutoProcessor), or None to load it from the model")
    return column


def _lora(peft_config: Any, model: Any, model_spec: Mapping[str, Any], problems: list[str]) -> dict | None:
    """``model.lora`` of a ``peft.LoraConfig``; a setting it cannot carry is a problem."""
    if peft_config is None:
        return None
    try:
        from peft import LoraConfig
    except ImportError:
        problems.append("peft_config: needs peft (pip install 'grpo-core[lora]')")
        return None
    if not isinstance(peft_config, LoraConfig):
        problems.append(f"peft_config: a {type(peft_config).__name__}; grpo-core trains LoRA adapters only "
                        "(model.lora)")
        return None
    default = LoraConfig()
    changed = [f.name for f in dataclasses.fields(LoraConfig) if f.name not in LORA_FIELDS
               and f.name not in _LORA_NEUTRAL and getattr(peft_config, f.name) != getattr(default, f.name)]
    if changed:
        problems.append(f"peft_config: {', '.join(changed)} differ from peft's defaults; model.lora carries r, "
                        "lora_alpha, lora_dropout and target_modules only (instead: leave them at peft's defaults)")
    task = getattr(peft_config.task_type, "value", peft_config.task_type)
    if task not in (None, "CAUSAL_LM"):
        problems.append(f"peft_config.task_type={task!r}: the policy is a causal LM (instead: 'CAUSAL_LM')")
    targets = peft_config.target_modules
    if targets is None:
        targets = _default_targets(model, model_spec, problems)
    elif not isinstance(targets, str):
        targets = sorted(targets)
    return {"r": peft_config.r, "alpha": float(peft_config.lora_alpha), "dropout": float(peft_config.lora_dropout),
            "target_modules": targets}


def _default_targets(model: Any, model_spec: Mapping[str, Any], problems: list[str]) -> Any:
    """peft's default target modules for the model's type (what it picks for None)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as TARGETS

    if isinstance(model, str):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model, revision=model_spec.get("revision"),
                                                trust_remote_code=bool(model_spec.get("trust_remote_code")))
        except Exception as exc:  # noqa: BLE001 - the message names the model
            problems.append(f"peft_config.target_modules=None: cannot read {model}'s config to find peft's default "
                            f"({type(exc).__name__}: {exc}) (instead: name the modules)")
            return "all-linear"
    else:
        config = model.config
    targets = TARGETS.get(getattr(config, "model_type", None))
    if targets is None:
        problems.append(f"peft_config.target_modules=None: peft has no default for model type "
                        f"{getattr(config, 'model_type', None)!r} (instead: name the modules, or 'all-linear')")
        return "all-linear"
    return targets if isinstance(targets, str) else sorted(targets)


def _reward_entries(reward_funcs: Any, config: GRPOConfig, problems: list[str],
                    env_reward: bool = False) -> tuple[list[dict], list]:
    """The spec's ``rewards`` entries, in TRL's order, and the ``(name, callable)`` pairs to
    register; ``env_reward``: an environment's get_reward() scores too (last, weight 1)."""
    funcs = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [
        reward_funcs]
    if not funcs and not env_reward:
        problems.append("reward_funcs: none given; GRPO needs at least one reward function (or an "
                        "environment_factory whose environment has get_reward)")
    weights = config.reward_weights or [1.0] * len(funcs)
    try:
        kwargs = init_kwargs(config.model_init_kwargs)
    except Refusal:
        kwargs = {}  # the config's own check says why
    entries, objects = [], []
    for i, func in enumerate(funcs):
        weight = float(weights[i]) if i < len(weights) else 1.0
        if isinstance(func, str):
            entries.append({"name": "reward_model", "path": func, "weight": weight, "max_length": None,
                            "add_special_tokens": False, "dtype": _reward_dtype(kwargs),
                            "revision": kwargs.get("revision"),
                            "trust_remote_code": bool(kwargs.get("trust_remote_code", config.trust_remote_code))})
            continue
        if _is_module(func):
            problems.append(f"reward_funcs[{i}]: a loaded {type(func).__name__}; grpo-core's reward_model loads "
                            "its model itself (instead: pass its folder or Hub id as a string)")
            continue
        if not callable(func):
            problems.append(f"reward_funcs[{i}]: {func!r} is neither a callable nor a model id")
            continue
        named = [p for p in _parameters(func) if p in _TRL_ONLY_KWARGS]
        if named:
            problems.append(f"reward_funcs[{i}] ({getattr(func, '__name__', func)!r}) takes {', '.join(named)}: "
                            "objects of TRL's trainer, which grpo-core does not pass (instead: read the dataset "
                            "columns and completions only)")
        name = getattr(func, "__name__", None) or type(func).__name__
        entries.append({"name": name, "weight": weight})
        objects.append((name, func))
    if env_reward:
        entries.append({"name": "env_reward", "weight": 1.0})
    return entries, objects


def _tool_loop(tools: Any, factory: Any, config: GRPOConfig, rows: list[dict],
               problems: list[str]) -> tuple[Any, bool]:
    """TRL's tool loop as an agent for ``tools`` and ``environment_factory`` (None when both
    are None), and whether an environment's get_reward() scores the episodes. Each factory
    is called once here to check its environment, as TRL does."""
    if not tools and factory is None:
        return None, False
    from transformers.utils import get_json_schema

    from grpo_core.trl.tool_loop import TRLToolLoop, environment_tools

    def described(method: Any, where: str) -> None:
        try:  # the schema the chat template shows; transformers says what the docstring lacks
            get_json_schema(method)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{where}: {getattr(method, '__name__', method)!s:.60}: {exc} (TRL's tools are functions "
                            "with type hints and a Google-style docstring)")

    tools = list(tools or [])
    for tool in tools:
        described(tool, "tools")
    factories = factory if isinstance(factory, Mapping) else {None: factory} if factory is not None else {}
    env_reward = False
    for name, make in factories.items():
        where = "environment_factory" if name is None else f"environment_factory[{name!r}]"
        try:
            environment = make()
        except Exception as exc:  # noqa: BLE001 - the user's factory: name it
            problems.append(f"{where}: calling it raised {type(exc).__name__}: {exc}")
            continue
        if not callable(getattr(environment, "reset", None)):
            problems.append(f"{where}: its environment ({type(environment).__name__}) has no reset method; TRL's "
                            "environments define reset(**row) (returning None or a string for the prompt)")
        env_reward = env_reward or callable(getattr(environment, "get_reward", None))
        for method in environment_tools(environment):
            described(method, where)
    if isinstance(factory, Mapping):
        unknown = sorted({str(r.get("environment")) for r in rows} - {str(n) for n in factories})
        if unknown:
            problems.append(f"train_dataset: rows whose 'environment' names no environment_factory entry: "
                            f"{', '.join(unknown)}; entries: {', '.join(map(str, factories))}")
    if config.max_tool_calling_iterations is not None and (
            isinstance(config.max_tool_calling_iterations, bool) or not isinstance(config.max_tool_calling_iterations,
                                                                                   int)
            or config.max_tool_calling_iterations < 0):
        problems.append(f"max_tool_calling_iterations: {config.max_tool_calling_iterations!r}; None or an integer "
                        ">= 0")
    return TRLToolLoop(tools, factories, config.max_tool_calling_iterations), env_reward


def _max_calls(rounds: Any) -> dict[str, int]:
    """rollout.agent.max_calls for ``rounds`` rounds of tool calls: one request more (the
    answer after the last round); none for TRL's unbounded loop (the slot's default bounds)."""
    return {"max_calls": rounds + 1} if isinstance(rounds, int) and rounds >= 0 else {}


def _reward_dtype(kwargs: Mapping[str, Any]) -> str:
    """The dtype TRL's reward model loads in: model_init_kwargs' dtype, else transformers'
    default (the checkpoint's from transformers 5 on, float32 before)."""
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if dtype is not None:
        return str(dtype).replace("torch.", "")
    import transformers

    return "auto" if int(transformers.__version__.split(".")[0]) >= 5 else "float32"


def _is_module(obj: Any) -> bool:
    return any(c.__name__ == "Module" and c.__module__.startswith("torch.nn") for c in type(obj).__mro__)


def _parameters(func: Callable) -> list[str]:
    try:
        return list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return []


def _callbacks(callbacks: Any, problems: list[str]) -> list:
    from transformers import TrainerCallback

    items = [] if callbacks is None else list(callbacks) if isinstance(callbacks, list | tuple) else [callbacks]
    for cb in items:
        if isinstance(cb, TrainerCallback) or (isinstance(cb, type) and issubclass(cb, TrainerCallback)):
            name = cb.__name__ if isinstance(cb, type) else type(cb).__name__
            problems.append(f"callbacks: {name} is a transformers TrainerCallback; its hooks take the transformers "
                            "Trainer's state and control objects, which grpo-core's loop does not have (instead: a "
                            "grpo_core.Callback with on_step(step, metrics), on_eval(step, metrics), "
                            "on_save(step, folder), or a function, which is on_step)")
    return items


def _eval_sets(eval_dataset: Any) -> Any:
    if eval_dataset is None or isinstance(eval_dataset, Mapping):
        return eval_dataset
    if type(eval_dataset).__name__ in ("DatasetDict", "IterableDatasetDict"):
        return dict(eval_dataset)
    return eval_dataset


def _quantization(config: Any, model_object: bool, model_spec: dict, problems: list[str]) -> None:
    """``model.quantization`` of a ``BitsAndBytesConfig`` passed as ``quantization_config``."""
    if config is None:
        return
    if model_object:
        problems.append("quantization_config: the model is already loaded; instead: pass its name or folder "
                        "(model.path) and the config, or load it quantized yourself")
        return
    try:
        keys = quantization_keys("quantization_config", config)
    except Refusal as exc:
        problems.append(exc.text())
        return
    model_spec["quantization"] = {k.rsplit(".", 1)[1]: v for k, v in keys.items()}


def _refused(problems: list[str], **arguments: Any) -> None:
    """Each argument ``name=(value, instead)`` or ``name=(value, why, instead)`` set away from None."""
    for name, (value, *texts) in arguments.items():
        if value is not None and value != (None, None):
            why = texts[0] if len(texts) == 2 else "not supported by grpo-core's TRL door"
            problems.append(f"{name}: {why} (instead: {texts[-1]})")


def _annotated(error: SpecError) -> SpecError:
    """The spec's problems, each followed by the TRL fields that set its key."""
    sources: dict[str, list[str]] = {}
    for entry in FIELDS:
        for key in entry.keys:
            if "[" not in key:  # a list entry (rewards[i]) has other sources too
                sources.setdefault(key, []).append(entry.name)
    problems = []
    for problem in error.problems:
        path = problem.split(":", 1)[0].removeprefix("spec.")
        names = next((sources[k] for k in sorted(sources, key=len, reverse=True)
                      if path == k or path.startswith(k + ".")), [])
        problems.append(f"{problem} (GRPOConfig: {', '.join(names)})" if names else problem)
    return SpecError(problems, error.source)


# --------------------------------------------------------------------------- the trainer
class GRPOTrainer:
    """TRL's ``GRPOTrainer`` (1.16) for grpo-core: ``from grpo_core.trl import GRPOTrainer``.

    Takes TRL's arguments (``model``, ``reward_funcs``, ``args``, ``train_dataset``, ...;
    :data:`ARGUMENTS` says where each goes) and builds a :class:`grpo_core.Trainer` on the
    spec they stand for, validated at once. ``overrides`` (grpo-core's own) sets spec keys
    after the table, e.g. ``{"rollout.dtype": "auto"}``.

    Raises:
        TRLConfigError: every argument or field grpo-core cannot honour, naming what to use.
        SpecError: the spec the arguments make is invalid (each problem names the fields).
    """

    def __init__(self, model: Any, reward_funcs: Any = None, args: GRPOConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: Any = None, optimizers: tuple = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, tools: Any = None, rollout_func: Any = None,
                 environment_factory: Any = None, *, overrides: Mapping[str, Any] | Iterable[str] | None = None,
                 sft_args: Any = None, sft_dataset: Any = None, sft_eval_dataset: Any = None):
        if args is None:
            name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
            args = GRPOConfig(f"{str(name).rstrip('/').split('/')[-1] or 'model'}-GRPO")
        if not isinstance(args, GRPOConfig):
            raise UsageError(f"args: a {type(args).__name__}; pass grpo_core.trl.GRPOConfig (TRL's own "
                             "GRPOConfig is not read: change the import)")
        self.args = args
        problems: list[str] = []
        _refused(problems, reward_processing_classes=(reward_processing_classes, "save the tokenizer with the "
                 "reward model, whose folder grpo-core loads it from"),
                 optimizers=(None if optimizers in (None, (None, None)) else optimizers,
                             "train.lr, train.adam_*, train.schedule"),
                 rollout_func=(rollout_func, "TRL calls rollout_func(prompts, trainer) with its own GRPOTrainer "
                               "(its vLLM engine, tokenizer, state), which grpo-core does not have",
                               "an agent (grpo_core.Trainer(agent=...)) or a rollout-backend plugin (rollout.name)"))
        model_object = not isinstance(model, str)
        if model_object and hasattr(model, "peft_config"):
            problems.append("model: a PeftModel; instead: pass its base model with peft_config (model.lora)")
        if train_dataset is None:
            problems.append("train_dataset: required (grpo-core trains on the rows passed here)")
        if eval_dataset is None and getattr(args.eval_strategy, "value", args.eval_strategy) != "no":
            problems.append(f"eval_strategy={args.eval_strategy!r} without eval_dataset: nothing to evaluate (TRL "
                            "refuses it too); instead: pass eval_dataset, or eval_strategy='no'")
        streamed = type(train_dataset).__name__ == "IterableDataset"
        if streamed:  # no length: TRL needs max_steps for one too; its first row stands for the columns
            if not (isinstance(args.max_steps, int) and args.max_steps > 0):
                problems.append("max_steps: required with an IterableDataset train_dataset (it has no length, so "
                                "num_train_epochs cannot be counted; TRL requires it too); instead: max_steps=N")
            first = next(iter(train_dataset), None)
            rows = [dict(first)] if first is not None else []
        else:
            rows = as_rows(train_dataset, "train_dataset") if train_dataset is not None else []
        loop, env_reward = _tool_loop(tools, environment_factory, args, rows, problems)
        entries, objects = _reward_entries(reward_funcs, args, problems, env_reward)
        items = _callbacks(callbacks, problems)
        counted = len(rows) if train_dataset is not None and not streamed else None
        try:
            data = args.spec_data(rows=counted, rewards=len(entries) or None, model_object=model_object)
        except TRLConfigError as exc:
            problems = [*exc.problems, *problems]
            data = {}
        image_column = _image_column(rows, processing_class, problems)
        if image_column is not None:
            data.setdefault("data", {})["image_column"] = image_column
        model_spec = data.setdefault("model", {})
        if not model_object:
            model_spec["path"] = model
        lora = _lora(peft_config, model, model_spec, problems)
        if lora is not None:
            model_spec["lora"] = lora
        _quantization(quantization_config, model_object, model_spec, problems)
        if (sft_args is None) != (sft_dataset is None):
            problems.append("sft_args and sft_dataset: pass both (grpo_core.trl.SFTConfig and the demonstrations) to "
                            "run an SFT stage before GRPO, or neither")
        elif sft_args is not None:
            from grpo_core.trl.sft import SFTConfig

            if not isinstance(sft_args, SFTConfig):
                problems.append(f"sft_args: a {type(sft_args).__name__}; instead: grpo_core.trl.SFTConfig")
            else:
                data["sft"] = sft_args.sft_data()
        if problems:
            raise TRLConfigError(problems, "GRPOTrainer")
        data["rewards"] = entries
        if loop is not None:
            data.setdefault("rollout", {})["agent"] = {"max_total_tokens": args.max_completion_length,
                                                       **_max_calls(args.max_tool_calling_iterations)}
        for warning in trl_warnings(args.to_dict()):  # TRL's GRPOTrainer logs these too
            log.warning(warning)
        self.per_step = args.context(rows=counted).layout.per_step
        try:
            self.trainer = Trainer(data, overrides, model=model if model_object else None, tokenizer=processing_class,
                                   reward_funcs=objects, train_dataset=train_dataset if streamed else rows,
                                   eval_dataset=_eval_sets(eval_dataset),
                                   callbacks=items, sft_dataset=sft_dataset, sft_eval_dataset=sft_eval_dataset,
                                   agent=loop)
        except SpecError as exc:
            raise _annotated(exc) from None
        self._eval_given = eval_dataset is not None

    # ----------------------------------------------------------------- what a script reads
    @property
    def spec(self):
        """The validated spec this trainer runs (``grpo-run validate`` prints the same form)."""
        return self.trainer.spec

    @property
    def model(self):
        """The policy: the trained module after :meth:`train`, else the model passed (None
        for a Hub id or folder, loaded when training starts)."""
        run = self.trainer._run
        return run.model if run is not None else self.trainer.model

    @property
    def processing_class(self):
        run = self.trainer._run
        return run.tokenizer if run is not None else self.trainer.tokenizer

    # ----------------------------------------------------------------- running
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: Any = None, **kwargs: Any) -> TRLTrainResult:
        """Train. ``resume_from_checkpoint``: True for the latest checkpoint of ``output_dir``,
        or a checkpoint folder; None or False starts afresh (a previous run's files in
        ``output_dir`` are moved to ``output_dir/overwritten/<time>/``). Returns grpo-core's
        :class:`~grpo_core.TrainResult` with TRL's ``global_step`` and ``training_loss``."""
        if trial is not None or ignore_keys_for_eval is not None or kwargs:
            raise UsageError("train(): trial, ignore_keys_for_eval and other transformers arguments are not "
                             "supported; pass resume_from_checkpoint only")
        if resume_from_checkpoint in (None, False):
            result = self.trainer.train(overwrite=True)
        else:
            resume = "latest" if resume_from_checkpoint is True else str(resume_from_checkpoint)
            result = self.trainer.train(resume)
        fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(TrainResult)}
        return TRLTrainResult(**fields, optimizer_steps_per_step=self.per_step)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """The held-out metrics of the current policy on ``eval_dataset`` given at construction,
        as grpo-core logs them (``eval/...``; TRL's are ``eval_...``)."""
        if eval_dataset is not None or ignore_keys is not None or metric_key_prefix != "eval":
            raise UsageError("evaluate(): pass eval_dataset to GRPOTrainer(...); evaluate() takes no arguments here")
        if not self._eval_given:
            raise UsageError("evaluate(): no eval_dataset was given to GRPOTrainer (TRL refuses it too)")
        return self.trainer.evaluate()

    def save_model(self, output_dir: str | Path | None = None) -> Path:
        """Save the policy and tokenizer (a LoRA adapter under peft_config) to ``output_dir``,
        ``args.output_dir`` by default as TRL, after :meth:`train`."""
        return self.trainer.save(Path(output_dir) if output_dir is not None else self.trainer.run_dir)


__all__ = ["ARGUMENTS", "BY_NAME", "LORA_FIELDS", "GRPOTrainer", "TRLTrainResult"]
