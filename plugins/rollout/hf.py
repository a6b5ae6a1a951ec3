"""Rollout backend ``hf``: transformers ``generate`` with the training model itself (or a
copy of it in ``options.dtype``; by default a bfloat16 copy where the hardware computes in
bfloat16 natively, :func:`~grpo_plugins.rollout.decode.auto_dtype`).

Generation, seeding and stopping: :meth:`HFRollout.generate`; prompt prefill shared by the
``G`` completions of a prompt: :meth:`HFRollout._prefill`; sampling follows
:class:`~grpo_core.contracts.SamplingParams` only (:func:`_generation_config`). The decode
itself is the lean loop of :mod:`grpo_plugins.rollout.decode` (``decode: lean``, the
default: :meth:`HFRollout._generate_part_lean`) or transformers ``generate``
(:meth:`HFRollout._generate_part`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch
from grpo_plugins.rollout.routes import PartRoutes, assemble_routes
from pydantic import Field, model_validator
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.contracts import (
    PromptImages,
    RolloutBatch,
    RolloutCapabilities,
    RolloutSetup,
    RouteRecorder,
    SamplingParams,
    check_request,
    cut_after_stop,
    left_pad,
    policy_copy,
    special_ids,
)
from grpo_core.errors import RunError
from grpo_core.options import Options

__all__ = ["HFRolloutOptions", "HFRollout", "register_rollout_backends"]


class HFRolloutOptions(Options):
    """Options of the ``hf`` rollout backend (sampling settings come from the spec's
    sampling section, not from here)."""

    share_prompt_prefill: bool = Field(
        True,
        description=(
            "Prefill each prompt once and repeat its KV cache G times, instead of prefilling "
            "every one of the P*G rows; same tokens, less prefill compute."
        ),
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = Field(
        "auto",
        description=(
            "Generate with a copy of the policy in this dtype (bfloat16 halves the bytes each "
            "decode step reads, and bf16 matmuls are ~2x faster on CPUs with AVX512-BF16 or AMX). "
            "null generates with the training model itself. auto: bfloat16 when the policy is "
            "float32 with at least 50M parameters, decode is lean, the policy is not sharded, and the "
            "device computes bfloat16 "
            "natively (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX); null otherwise. A copy "
            "in another dtype than the policy's samples from a slightly different distribution: "
            "the lean loop then returns each sampled token's log-prob (sampling_logp) and "
            "algorithm.rollout_correction weights the loss by the trainer/sampler ratio."
        ),
    )
    decode: Literal["lean", "generate"] = Field(
        "lean",
        description=(
            "lean: the backend's own decode loop (plugins/rollout/decode.py), which drops a "
            "row from the batch (and its KV cache) as soon as it ends and has no per-token "
            "overhead beyond the forward, the sampling and the stop check; same tokens as "
            "generate under a fixed seed, up to float rounding. generate: transformers "
            "generate, which decodes every row until the last one ends."
        ),
    )
    sampler: Literal["inverse-cdf", "multinomial"] = Field(
        "inverse-cdf",
        description=(
            "How the lean loop draws a sampled token. inverse-cdf: one uniform per row and the "
            "cumulative distribution, about 40x cheaper to draw at a 49k vocabulary than "
            "multinomial: as generate does (argmax of probs / Exponential(1) noise for every "
            "vocabulary entry), the same tokens as generate under a seed. Both draw from the "
            "same distribution. decode: generate always draws as multinomial."
        ),
    )
    keep_copy: bool = Field(
        False,
        description=(
            "With dtype: keep the copy resident, refreshed by sync_weights after every optimizer "
            "step. false (default) casts it from the training weights at the start of each "
            "generate call and frees it at the end, so it exists only while generating (when "
            "the trainer holds no gradients) and never adds to the training peak; this costs "
            "one cast of the weights per call."
        ),
    )
    prompts_per_generate: int | None = Field(
        None,
        ge=1,
        description=(
            "Prompts per generate call (each with its G completions), to bound generation "
            "memory; null generates all prompts of a step in one call."
        ),
    )

    @model_validator(mode="after")
    def _sampler_needs_the_lean_loop(self):
        if "sampler" in self.model_fields_set and self.sampler != "multinomial" and self.decode != "lean":
            raise ValueError(f"sampler: {self.sampler} needs decode: lean (generate draws with multinomial)")
        return self


class _EndRecorder:
    """A stopping criterion that records where each row first ended.

    ``ends``: ``long (b,)`` sequence length (prompt included) at which the row produced an
    EOS token or completed a stop string; -1 while it has not.
    """

    def __init__(self, eos_ids: Tensor, stop_criterion: Any | None):
        self.eos_ids = eos_ids
        self.stop_criterion = stop_criterion
        self.ends: Tensor | None = None

    def __call__(self, input_ids: Tensor, scores: Any, **kwargs: Any) -> Tensor:
        done = torch.isin(input_ids[:, -1], self.eos_ids.to(input_ids.device))
        if self.stop_criterion is not None:
            done = done | self.stop_criterion(input_ids, scores).to(done.device)
        if self.ends is None:
            self.ends = torch.full_like(done, -1, dtype=torch.long)
        newly = done & (self.ends < 0)
        self.ends = torch.where(newly, input_ids.shape[1], self.ends)
        return done


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    """Eval mode inside; every module's own ``training`` flag restored on exit."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device):
    """Seed the global RNGs inside (forked, so the caller's state is restored after)."""
    if seed is None:
        yield
        return
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _generation_config(sampling: SamplingParams, eos_ids: list[int], pad_id: int):
    """A ``GenerationConfig`` from ``sampling`` alone, neutralising the knobs a model's own
    generation config commonly sets (they would otherwise fill the unset fields)."""
    from transformers import GenerationConfig

    knobs: dict[str, Any] = {"do_sample": False}
    if not sampling.greedy:  # greedy ignores them (and transformers warns if they are set)
        knobs = {
            "do_sample": True,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "typical_p": 1.0,
            "epsilon_cutoff": 0.0,
            "eta_cutoff": 0.0,
        }
    return GenerationConfig(
        max_new_tokens=sampling.max_new_tokens,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_new_tokens=0,
        num_beams=1,
        num_return_sequences=1,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        use_cache=True,
        return_dict_in_generate=False,
        **knobs,
    )


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFRollout:
    """Generates with transformers ``generate`` on the training model, or on a copy of it in
    ``options.dtype``: cast from the training weights for each call and freed after, or kept
    resident and refreshed by ``sync_weights`` after each training step (``keep_copy``)."""

    def __init__(self, options: HFRolloutOptions | None = None):
        self.options = options or HFRolloutOptions()
        self.model: Any = None
        self.tokenizer: Any = None
        self._source: Any = None  # the training model
        self._stop_criteria: dict[tuple[str, ...], Any] = {}
        self._recorder: RouteRecorder | None = None  # with routing replay: hooks on the generating model's routers

    @property
    def capabilities(self) -> RolloutCapabilities:
        """Generates with the policy module (the engine gathers a sharded fsdp2 policy whole
        around each rollout phase, generation and scoring, and frees the gathered copy
        after); prompts with images (``data.image_column``) are generated with their image
        inputs; ``generate``'s tensors are on the generating model's device (None before setup)."""
        return RolloutCapabilities(generates_with_policy=True, accepts_images=True, records_routes=True,
                                   device=None if self.model is None else self.model.device)

    # ----------------------------------------------------------------- contract
    def setup(self, run: RolloutSetup) -> None:
        """Keep the policy model (or make the generation copy) and tokenizer; find the pad
        and EOS ids."""
        from grpo_plugins.rollout.decode import auto_dtype, use_decode_attention

        model, tokenizer = run.model, run.tokenizer
        self.model, self.tokenizer, self._source = model, tokenizer, model
        if self.options.dtype == "auto":
            dtype = auto_dtype(model, self.options.decode)
        else:
            dtype = _DTYPES.get(self.options.dtype) if self.options.dtype else None
        if dtype is not None and dtype != next(model.parameters()).dtype:
            if any(hasattr(p, "full_tensor") for p in model.parameters()):  # DTensor shards (fsdp2)
                raise RuntimeError("hf rollout: rollout.dtype makes a whole copy of the policy, which a "
                                   "sharded (fsdp2) run does not keep; drop rollout.dtype")
            if any(not p.is_floating_point() for p in model.parameters()):
                raise RuntimeError("hf rollout: rollout.dtype makes a copy of the policy cast to it, but the policy's "
                                   "base is quantized (model.quantization: 4-bit weights cannot be cast); drop "
                                   "rollout.dtype (it generates with the policy itself)")
            self.model = policy_copy(model, dtype=dtype, weights=False)
            if dtype != torch.float32:
                use_decode_attention(self.model)
            if self.options.keep_copy:
                self._fill()
        self.eos_ids, self.pad_id = special_ids(model, tokenizer, "hf")
        if run.record_routes:
            if self._part_fn() != self._generate_part_lean:
                raise RunError("hf rollout: routing replay records routes in the lean decode loop; set "
                               "rollout.decode: lean (and no cache_implementation in the model's generation config)")
            self._recorder = RouteRecorder(self.model)

    def sync_weights(self, model: Any) -> None:
        """Copy the policy's weights into a resident generation copy; a no-op without one
        (a per-call copy is cast from the training weights when generating)."""
        if self.model is model or not self.options.keep_copy:
            return
        with torch.no_grad():
            for mine, theirs in zip(self.model.parameters(), model.parameters(), strict=True):
                mine.copy_(theirs)

    def _fill(self) -> None:
        """Give the generation copy the training weights, cast to its dtype."""
        with torch.no_grad():
            for mine, theirs in zip(self.model.parameters(), self._source.parameters(), strict=True):
                mine.data = theirs.detach().to(mine.dtype)

    def _release(self) -> None:
        """Free the generation copy's weights (its modules and buffers stay)."""
        for p in self.model.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    @contextlib.contextmanager
    def _weights(self, rows: int):
        """The generation copy filled inside, when it is made per call, and its bfloat16 CPU
        linear layers packed for oneDNN (:func:`~grpo_plugins.rollout.decode.packed_linears`)
        for about ``rows`` rows; the policy itself as it is."""
        from grpo_plugins.rollout.decode import packed_linears

        copied = self.model is not self._source
        per_call = copied and not self.options.keep_copy
        if per_call:
            self._fill()
        try:
            with packed_linears(self.model, rows) if copied else contextlib.nullcontext():
                yield
        finally:
            if per_call:
                self._release()

    def generate(
        self, prompt_ids: list[list[int]], group_size: int, sampling: SamplingParams,
        images: list[PromptImages | None] | None = None,
    ) -> RolloutBatch:
        """``G = group_size`` completions for each of the ``P`` prompts (token id lists).

        One batched, left-padded ``generate`` call (or one per ``prompts_per_generate``
        prompts) with the KV cache, under ``torch.inference_mode()`` and eval mode (each
        module's train flag restored after). With ``sampling.seed``, the call starting at
        prompt ``i`` runs on forked RNGs seeded with ``seed + i`` (the convention of
        :class:`~grpo_core.contracts.SamplingParams`); the caller's RNG is untouched. A row
        ends at its first EOS id or at the token completing a stop string (transformers'
        ``StopStringCriteria``, matching tokens, the prompt's tail included).

        Returns a :class:`RolloutBatch` of ``B = P * G`` rows, prompt-major. ``sampling_logp``
        is set when the lean loop samples from a copy in another dtype than the policy's
        (the sampled tokens' log-probs under the distribution drawn from); else None: the
        backend samples from the very weights the trainer evaluates.

        ``images``: each prompt's :class:`~grpo_core.contracts.PromptImages` (or None), for
        prompts with images: :meth:`_generate_part_images` then generates each part.
        """
        if self.model is None:
            raise RuntimeError("hf rollout: setup must be called before generate")
        check_request(prompt_ids, group_size, sampling, "hf")
        device = self.model.device
        ids, mask = (t.to(device) for t in left_pad(prompt_ids, self.pad_id))
        step = self.options.prompts_per_generate or len(prompt_ids)
        pieces, routed = [], [] if self._recorder is not None else None
        recording = self._recorder if self._recorder is not None and images is None else contextlib.nullcontext()
        with self._weights(step * group_size), _eval_mode(self.model), torch.inference_mode(), recording:
            for start in range(0, len(prompt_ids), step):
                part = slice(start, start + step)
                seed = None if sampling.seed is None else sampling.seed + start
                with _seeded(seed, device):
                    if routed is not None:
                        pieces.append(self._generate_part_lean(ids[part], mask[part], group_size, sampling, routed))
                    elif images is None:
                        pieces.append(self._part_fn()(ids[part], mask[part], group_size, sampling))
                    else:
                        pieces.append(self._generate_part_images(ids[part], mask[part], group_size, sampling,
                                                                 images[part]))
        completion_ids, completion_mask, truncated, logp = self._assemble(pieces, sampling)
        return RolloutBatch(
            prompt_ids=ids.clone(),
            prompt_mask=mask.clone(),
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            truncated=truncated,
            completions=self._decode(completion_ids, completion_mask, sampling.stop),
            sampling_logp=logp,
            routes=None if routed is None else assemble_routes(routed, mask, completion_mask.sum(1).tolist(),
                                                                completion_ids.shape[1]),
        )

    @property
    def _returns_logp(self) -> bool:
        """Whether the lean loop reports the sampled tokens' log-probs: when it samples from a
        copy whose dtype differs from the policy's."""
        return self.model is not self._source and (
            next(self.model.parameters()).dtype != next(self._source.parameters()).dtype)

    # ----------------------------------------------------------------- internals
    def _stop_criterion(self, stop: tuple[str, ...]) -> Any | None:
        """transformers' ``StopStringCriteria`` for ``stop`` (built once per tuple)."""
        if not stop:
            return None
        if stop not in self._stop_criteria:
            from transformers import StopStringCriteria

            self._stop_criteria[stop] = StopStringCriteria(
                tokenizer=self.tokenizer, stop_strings=list(stop)
            )
        return self._stop_criteria[stop]

    def _can_share(self, ids: Tensor, group_size: int) -> bool:
        if not self.options.share_prompt_prefill or group_size == 1 or ids.shape[1] < 2:
            return False
        config = getattr(self.model, "generation_config", None)
        return getattr(config, "cache_implementation", None) is None

    def _prefill(self, ids: Tensor, mask: Tensor, group_size: int) -> Any:
        """Encode prompts ``(p, L)`` minus their last token once; return the cache with every
        row repeated ``G`` times (``p*G`` rows, ``L-1`` positions), from which ``generate``
        continues feeding only each prompt's last token. Skipped (:meth:`_can_share`) when
        ``G == 1``, for one-token prompts, or when the model's generation config asks for
        a specific ``cache_implementation``."""
        from transformers import DynamicCache

        config = self.model.config
        text_config = (
            config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        )
        cache = DynamicCache(config=text_config)
        positions = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 0)
        self.model.get_decoder()(
            input_ids=ids[:, :-1],
            attention_mask=mask[:, :-1],
            position_ids=positions[:, :-1],
            past_key_values=cache,
            use_cache=True,
        )
        cache.batch_repeat_interleave(group_size)
        return cache

    def _generate_part_images(
        self, ids: Tensor, mask: Tensor, group_size: int, sampling: SamplingParams, images: list
    ) -> tuple[Tensor, Tensor, None]:
        """:meth:`_generate_part` for prompts with images: transformers ``generate`` with each
        row's image inputs, or (``share_prompt_prefill``) from each prompt encoded once with its
        images (:func:`~grpo_plugins.rollout.images.prefill_with_images`); the model places its
        image features and positions (Qwen2-VL's 3-D ones) itself."""
        from grpo_plugins.rollout.images import prefill_with_images, row_image_inputs

        first = int(mask.any(0).nonzero()[0])
        ids, mask = ids[:, first:], mask[:, first:]
        cache = prefill_with_images(self.model, ids, mask, images, group_size) if self._can_share(
            ids, group_size) else None
        kwargs = {"past_key_values": cache} if cache is not None else row_image_inputs(images, mask, group_size)
        return self._generate_part(ids, mask, group_size, sampling, kwargs)

    def _generate_part(
        self, ids: Tensor, mask: Tensor, group_size: int, sampling: SamplingParams,
        image_kwargs: dict[str, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, None]:
        """Generate for ``p`` prompts ``(p, L)``; returns completion ids ``(p*G, n)`` (tokens
        after each row's end are arbitrary), lengths ``long (p*G,)``, -1 where the row
        did not end (EOS / stop string) within ``n`` tokens, and no log-probs.
        ``image_kwargs``: the rows' image inputs (then no prefill is shared)."""
        from transformers import StoppingCriteriaList

        first = int(mask.any(0).nonzero()[0])  # drop columns that are padding in every row
        ids, mask = ids[:, first:], mask[:, first:]
        recorder = _EndRecorder(torch.tensor(self.eos_ids), self._stop_criterion(sampling.stop))
        kwargs: dict[str, Any] = dict(image_kwargs or {})
        if image_kwargs is None and self._can_share(ids, group_size):
            kwargs["past_key_values"] = self._prefill(ids, mask, group_size)
        out = self.model.generate(
            input_ids=ids.repeat_interleave(group_size, 0),
            attention_mask=mask.repeat_interleave(group_size, 0).long(),
            generation_config=_generation_config(sampling, self.eos_ids, self.pad_id),
            stopping_criteria=StoppingCriteriaList([recorder]),
            # Each process generates on its own: a sharded (fsdp2) policy is whole here, so
            # transformers' lock-step mode for FSDP models (an all-reduce per token) is off.
            synced_gpus=False,
            **kwargs,
        )
        length = ids.shape[1]
        completions = out[:, length:]
        ends = recorder.ends
        if ends is None:  # generate produced nothing
            ends = torch.full((completions.shape[0],), -1, dtype=torch.long, device=out.device)
        lengths = torch.where(ends >= 0, ends - length, -1)
        return completions, lengths, None

    # ----------------------------------------------------------------- lean decode
    def _part_fn(self):
        """The per-part generator: the lean loop unless the options or the model's own
        ``cache_implementation`` ask for transformers ``generate``."""
        config = getattr(self.model, "generation_config", None)
        if self.options.decode == "lean" and getattr(config, "cache_implementation", None) is None:
            return self._generate_part_lean
        return self._generate_part

    def _generate_part_lean(
        self, ids: Tensor, mask: Tensor, group_size: int, sampling: SamplingParams,
        routed: list[PartRoutes] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """:meth:`_generate_part` with :func:`~grpo_plugins.rollout.decode.lean_decode`:
        the same prefill (shared by the group when allowed), then the lean loop; with the
        sampled tokens' log-probs when :attr:`_returns_logp`. ``routed``: with routing replay,
        the list the part's routes are appended to (:class:`~grpo_plugins.rollout.routes.PartRoutes`)."""
        from grpo_plugins.rollout.decode import lean_decode
        from transformers import DynamicCache

        first = int(mask.any(0).nonzero()[0])  # drop columns that are padding in every row
        ids, mask = ids[:, first:], mask[:, first:]
        routes = None
        if routed is not None:
            routes = PartRoutes(self._recorder, mask, group_size, sampling.max_new_tokens)
            routed.append(routes)
        if self._can_share(ids, group_size):
            cache = self._prefill(ids, mask, group_size)
            if routes is not None:
                routes.prefilled(ids.shape[1] - 1)
        else:
            config = self.model.config
            if hasattr(config, "get_text_config"):
                config = config.get_text_config(decoder=True)
            cache = DynamicCache(config=config)
        return lean_decode(
            self.model, ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0),
            cache, sampling, self.eos_ids, self.pad_id, self._stop_criterion(sampling.stop),
            sampler=self.options.sampler, with_logp=self._returns_logp,
            on_forward=None if routes is None else routes.step,
        )

    def _assemble(
        self, pieces: list[tuple[Tensor, Tensor, Tensor | None]], sampling: SamplingParams
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Right-padded ``(B, T)`` ids and mask, ``(B,)`` truncation flags and ``(B, T)``
        float32 log-probs (0 on padding; None unless every part has them) from the parts,
        ``T`` trimmed to the longest row. Runs outside inference mode: the results are
        ordinary tensors that a training forward may save for backward."""
        rows, logps, lengths, truncated = [], [], [], []
        with_logp = all(piece[2] is not None for piece in pieces)
        for completions, ends, part_logp in pieces:
            for index, (row, end) in enumerate(zip(completions, ends.tolist(), strict=True)):
                stopped = end >= 0
                size = end if stopped else min(row.shape[0], sampling.max_new_tokens)
                rows.append(row[:size].clone())
                logps.append(part_logp[index, :size].clone() if with_logp else None)
                lengths.append(size)
                truncated.append(not stopped)
        width = max(lengths)
        device = pieces[0][0].device
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(rows), width), dtype=torch.bool, device=device)
        logp = torch.zeros((len(rows), width), dtype=torch.float32, device=device) if with_logp else None
        for index, row in enumerate(rows):
            ids[index, : row.shape[0]] = row
            mask[index, : row.shape[0]] = True
            if logp is not None:
                logp[index, : row.shape[0]] = logps[index]
        return ids, mask, torch.tensor(truncated, dtype=torch.bool, device=device), logp

    def _decode(self, ids: Tensor, mask: Tensor, stop: tuple[str, ...]) -> list[str]:
        """Completion texts (special tokens skipped), cut right after the first stop string."""
        texts = self.tokenizer.batch_decode(
            [row[m].tolist() for row, m in zip(ids, mask, strict=True)], skip_special_tokens=True
        )
        if not stop:
            return texts
        return [cut_after_stop(text, stop) for text in texts]


@hookimpl
def register_rollout_backends(register) -> None:
    register.add("hf", HFRollout, options=HFRolloutOptions,
                 description="transformers generate on the training model (KV cache, shared prefill)")
