"""The rollout contract: sampling settings, the batch a backend returns, the backend itself,
and the checks and helpers every backend shares."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor

if TYPE_CHECKING:
    from grpo_core.contracts.episodes import Episodes
    from grpo_core.contracts.images import PromptImages
    from grpo_core.contracts.routes import ExpertRoutes


# --------------------------------------------------------------------------- rollouts
@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings shared by every rollout backend.

    ``seed`` makes a rollout reproducible. A backend that seeds prompts separately uses
    ``seed + i`` for the ``i``-th prompt of the call: the engine passes each process of a
    multi-process run the step's seed plus the global index of its first prompt.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    greedy: bool = False
    seed: int | None = None


@dataclass
class RolloutBatch:
    """What a rollout backend returns for ``P`` prompts times ``G`` completions.

    Attributes:
        prompt_ids: ``long (P, L)`` left-padded prompt tokens (each prompt once).
        prompt_mask: ``bool (P, L)``.
        completion_ids: ``long (B, T)`` right-padded completion tokens, pad elsewhere.
        completion_mask: ``bool (B, T)``: True up to and including the EOS token (or the
            stop string's last token); False after it. For multi-turn episodes
            (``episodes`` set) it has holes: True only on model-generated tokens, False on
            the environment's tokens between turns and on padding.
        truncated: ``bool (B,)``: the completion hit ``max_new_tokens`` without stopping.
        sampling_logp: ``float (B, T)`` log-probs the sampler assigned, or ``None``.
        completions: decoded completion text, ``B`` strings (for an episode: the whole
            conversation after the prompt, environment turns included).
        episodes: what the environment recorded for multi-turn rollouts, else ``None``.
        prompt_images: each prompt's images (``P`` entries, None for a prompt without),
            or ``None`` for text-only prompts; set by the engine after ``generate``.
        token_versions: ``long (B, T)``: the policy version each completion token was
            sampled with (0 on padding), set by an interruptible backend under partial
            rollouts (:class:`WeightSwitch`); ``None``: every token was sampled with the
            weights the actor held when the batch began.
        routes: the experts a mixture-of-experts policy routed each token to where it was
            sampled (:class:`~grpo_core.contracts.routes.ExpertRoutes`), set by a backend that
            records them when the run asks (:attr:`RolloutSetup.record_routes`); else ``None``.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    truncated: Tensor
    completions: list[str]
    sampling_logp: Tensor | None = None
    episodes: Episodes | None = None
    prompt_images: list[PromptImages | None] | None = None
    token_versions: Tensor | None = None
    routes: ExpertRoutes | None = None

    @property
    def group_size(self) -> int:
        return self.completion_ids.shape[0] // self.prompt_ids.shape[0]


class WeightSwitch(Protocol):
    """Partial rollouts (``rollout.partial_rollouts``): what an interruptible backend (one
    whose :class:`RolloutCapabilities` say ``interruptible``) asks while it generates, between
    engine steps, when the engine hands it one (:attr:`RolloutSetup.switch`). ``version``: the
    policy version of the backend's weights now; ``pending()``: whether newer weights wait;
    ``take()``: put them into the backend now (through its ``sync_weights``) and return their
    version. The backend stops its unfinished completions before ``take`` and continues each
    from its prefix after it, recording every token's version in
    :attr:`RolloutBatch.token_versions`."""

    version: int

    def pending(self) -> bool: ...

    def take(self) -> int: ...


def oldest_versions(token_versions: Tensor, mask: Tensor, default: int) -> Tensor:
    """``long (B,)``: each row's oldest token version over ``mask`` (``bool (B, T)``), or
    ``default`` for a row without tokens: the version a completion's staleness counts from."""
    big = torch.iinfo(torch.long).max
    oldest = token_versions.masked_fill(~mask, big).amin(dim=1) if mask.shape[1] else torch.full(
        (mask.shape[0],), big, dtype=torch.long, device=mask.device)
    return oldest.masked_fill(oldest == big, default)


def token_staleness(token_versions: Tensor, mask: Tensor, trained_version: int) -> Tensor:
    """``long (B, T)``: versions between each token's sampling and its training at
    ``trained_version`` (``trained_version - token_versions``), 0 on padding."""
    return (trained_version - token_versions).masked_fill(~mask, 0)


def check_request(prompt_ids: Sequence[Sequence[int]], group_size: int, sampling: SamplingParams, backend: str) -> None:
    """Refuse a ``generate`` request no backend can honour (no prompt, an empty prompt, a
    group size below 1, impossible sampling settings), naming ``backend`` and what is valid."""
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        raise ValueError(f"{backend} rollout: every prompt needs at least one token")
    if group_size < 1:
        raise ValueError(f"{backend} rollout: group_size must be >= 1, got {group_size}")
    check_sampling(sampling, backend)


def check_sampling(sampling: SamplingParams, backend: str) -> None:
    """Refuse sampling settings no backend can honour, naming ``backend`` and what is valid."""
    if sampling.max_new_tokens < 1:
        raise ValueError(f"{backend} rollout: max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
    if not sampling.greedy and sampling.temperature <= 0:
        raise ValueError(
            f"{backend} rollout: temperature must be > 0 when sampling, got {sampling.temperature} "
            "(use greedy: true for argmax decoding)"
        )
    if not 0 < sampling.top_p <= 1:
        raise ValueError(f"{backend} rollout: top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k < 0:
        raise ValueError(f"{backend} rollout: top_k must be >= 0 (0 = off), got {sampling.top_k}")


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """``long (P, L)`` left-padded prompt ids and their ``bool (P, L)`` mask (CPU)."""
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            ids[row, length - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, length - len(prompt):] = True
    return ids, mask


def special_ids(model: Any, tokenizer: Any, backend: str) -> tuple[list[int], int]:
    """EOS ids (the model's generation config, then the tokenizer) and the pad id (the
    tokenizer's, the generation config's, else the first EOS) that rollout backends use."""
    eos: list[int] = []
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (configured, getattr(tokenizer, "eos_token_id", None)):
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if token is not None and int(token) not in eos:
                eos.append(int(token))
    if not eos:
        raise ValueError(f"{backend} rollout: neither the model's generation config nor the tokenizer has an EOS token")
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    return eos, int(pad) if pad is not None else eos[0]


def cut_after_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to and including the first of the ``stop`` strings it contains."""
    ends = [text.find(s) + len(s) for s in stop if s and s in text]
    return text[: min(ends)] if ends else text


@dataclass(frozen=True)
class RolloutCapabilities:
    """What a rollout backend can do: its ``capabilities`` attribute (a class attribute, or a
    property where a value is known only after ``setup``). The engine reads nothing else of
    a backend beyond :class:`RolloutBackend`'s methods; a backend that declares none gets
    this record's defaults (a plain backend with its own copy of the weights, on the CPU).

    Attributes:
        generates_with_policy: True for a backend that runs the policy module it was given
            (the ``hf`` backend): the engine then makes a sharded (FSDP2) policy whole
            around each rollout phase, and an asynchronous run gives it a copy of the policy
            of its own (:attr:`RolloutSetup.model`). False: a backend with its own copy.
        device: the device of the tensors ``generate`` returns, or None for the CPU. The
            engine builds the tensors of multi-turn episodes there. Read after ``setup``.
        accepts_images: True for a backend whose ``generate`` takes ``images=``: one
            :class:`~grpo_core.contracts.PromptImages` (or None) per prompt, passed only when
            the prompts have images (``data.image_column``), with the model's processor in
            :attr:`RolloutSetup.processor`; the prompt ids then hold the processor's image
            tokens. False: the engine refuses image prompts for it.
        interruptible: True for a backend that can take new weights mid-generation
            (``rollout.partial_rollouts``): :attr:`RolloutSetup.switch` is then a
            :class:`WeightSwitch`, which ``generate`` polls while it runs, and it returns
            :attr:`RolloutBatch.token_versions`. False: the option is refused for it.
        records_routes: True for a backend that records the experts a mixture-of-experts
            policy routed each token to (:attr:`RolloutBatch.routes`) when
            :attr:`RolloutSetup.record_routes` asks (``algorithm.routing_replay``). False:
            routing replay is refused for it.
        routes_refusal: for a backend that does not record routes, why (what its engine
            lacks, where), said in the refusal of ``algorithm.routing_replay``; empty when
            there is nothing more to say than that it does not.
    """

    generates_with_policy: bool = False
    device: Any = None
    accepts_images: bool = False
    interruptible: bool = False
    records_routes: bool = False
    routes_refusal: str = ""


@dataclass(frozen=True)
class RolloutSetup:
    """What the engine hands a rollout backend once, before the first rollout
    (:meth:`RolloutBackend.setup`).

    Attributes:
        model: the policy model (unwrapped), or for an asynchronous run of a backend that
            ``generates_with_policy`` the actor's own copy of it.
        tokenizer: the policy's tokenizer.
        processor: the model's processor when the prompts have images (``data.image_column``,
            only for a backend that ``accepts_images``), else None.
        max_staleness: the run's staleness bound (``rollout.max_staleness``, 0 for a
            synchronous run): a backend that keeps past policy versions loaded (``vllm``'s
            adapter pushes) keeps ``max_staleness + 1`` of them, as rollouts in flight may
            still sample with the oldest.
        switch: with ``rollout.partial_rollouts`` (an ``interruptible`` backend), the
            :class:`WeightSwitch` that ``generate`` polls; else None.
        record_routes: with ``algorithm.routing_replay`` (a backend whose capabilities say
            ``records_routes``): return every rollout's :attr:`RolloutBatch.routes`.
    """

    model: Any
    tokenizer: Any
    processor: Any = None
    max_staleness: int = 0
    switch: WeightSwitch | None = None
    record_routes: bool = False


@dataclass(frozen=True)
class WeightPush:
    """What one push of the policy's weights into a backend's copy sent, returned by
    ``sync_weights`` (and by ``setup`` for the first): None when nothing went anywhere (a
    backend that generates with the policy module, a push skipped). Logged with each training
    step whose rollouts sampled after that push, as ``sync/push_bytes``, ``sync/push_seconds``
    and ``sync/push_<key>`` for each of ``figures`` (:meth:`metrics`).

    Attributes:
        bytes: the bytes sent to one copy of the weights (one server, one engine).
        seconds: the push's wall-clock time, gathers and transfers included.
        figures: more figures of the push by name (a delta push's ``full_bytes``,
            ``elements_sent``, ``tensors_whole``).
    """

    bytes: float
    seconds: float
    figures: Mapping[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """The push as ``sync/push_*`` metrics."""
        named = {"bytes": self.bytes, "seconds": self.seconds, **self.figures}
        return {f"sync/push_{k}": float(v) for k, v in named.items()}


@runtime_checkable
class RolloutBackend(Protocol):
    """Generates completions and keeps its copy of the weights in step with the policy.

    ``setup(run)`` is called once before the first rollout with a :class:`RolloutSetup` (the
    policy model and its tokenizer, and the processor, staleness bound and weight switch the
    run gives it); a backend that loads the weights into a copy of its own returns that push
    (a :class:`WeightPush`, logged with the first step), else None. ``generate`` samples
    ``group_size`` completions for each prompt. ``sync_weights(model)`` is called once per
    training step, after all of the step's optimizer steps (``algorithm.mu`` times
    ``train.mini_batches`` of them), and once after a resume, by every process (a sharded
    model is gathered while it runs); it returns the :class:`WeightPush` it made, or None (a
    backend that generates with the training model itself makes it a no-op).

    Attributes:
        capabilities: what the backend can do (:class:`RolloutCapabilities`); optional, the
            defaults when absent. The engine reads no other attribute of a backend.
    """

    capabilities: RolloutCapabilities = RolloutCapabilities()

    def setup(self, run: RolloutSetup) -> WeightPush | None: ...

    def generate(
        self, prompt_ids: list[list[int]], group_size: int, sampling: SamplingParams
    ) -> RolloutBatch: ...

    def sync_weights(self, model: Any) -> WeightPush | None: ...


def policy_copy(model: Any, *, dtype: torch.dtype | None = None, weights: bool = True) -> Any:
    """A copy of the policy ``model`` that generates or scores and is never trained: the plain
    module (without a ``DistributedDataParallel`` or ``torch.compile`` wrapper) in eval mode,
    its parameters without gradients, in ``dtype`` when given. The engine makes every copy of
    the policy with it (an asynchronous run's snapshot and sampler, the KL reference), and so
    can a backend (the ``hf`` backend's bfloat16 generation copy).

    ``weights=False`` copies the modules and buffers with empty parameters (tied ones still
    shared), without a transient second copy of the weights: the caller fills them."""
    plain = getattr(model, "module", getattr(model, "_orig_mod", model))
    memo: dict[int, Any] = {}
    if not weights:
        memo = {id(p): torch.nn.Parameter(torch.empty(0, dtype=dtype or p.dtype, device=p.device), requires_grad=False)
                for p in plain.parameters()}
    copied = copy.deepcopy(plain, memo).eval()
    if dtype is not None:
        copied.to(dtype)
    return copied.requires_grad_(False)
