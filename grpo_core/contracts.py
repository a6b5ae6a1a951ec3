"""The data that flows between the engine and its plugins, and the shape of each component.

Shape vocabulary, used in every docstring of the project:

- ``P``: prompts per step, ``G``: group size (completions per prompt), ``B = P * G`` rows,
- ``T``: completion tokens (padded), ``L``: prompt tokens (left padded), ``V``: vocabulary,
- ``K``: steps per completion (padded), for process supervision.

Masks are ``bool``; padded positions of every per-token output are exactly zero.
Rows are ordered prompt-major: rows ``p*G .. p*G+G-1`` are the group of prompt ``p``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "AdvantageInputs",
    "AdvantageEstimator",
    "KLPenalty",
    "PolicyLossInputs",
    "PolicyLossOutput",
    "PolicyLoss",
    "BatchStats",
    "LossAggregator",
    "SamplingParams",
    "RolloutBatch",
    "RolloutBackend",
    "RewardFunction",
    "reward_value",
    "StepSplitter",
    "RewardExample",
    "TrainableReward",
    "Dataset",
    "Tracker",
    "Stateful",
    "Observation",
    "Environment",
    "Episodes",
    "completion_text",
]


# --------------------------------------------------------------------------- advantages
@dataclass
class AdvantageInputs:
    """What an advantage estimator sees.

    Attributes:
        scores: ``float (B,)`` sequence scores; ``NaN`` marks an unscorable completion
            (a reward function returned ``None``), which gets advantage 0 and is left out
            of its group's statistics.
        group_ids: ``long (B,)`` which prompt each row belongs to (``0 .. P-1``).
        mask: ``bool (B, T)`` completion tokens.
        step_scores: ``float (B, K)`` per-step scores for process supervision, or ``None``.
        step_ends: ``long (B, K)`` token index (into ``T``) where each step ends, or ``None``.
        step_mask: ``bool (B, K)`` which steps exist, or ``None``.
        baseline_scores: ``float (B,)`` the score of one greedy completion of each row's
            prompt (the same on every row of a group; ``NaN`` where it was unscorable), or
            ``None``; filled for an estimator that declares ``needs_greedy_baseline``.
    """

    scores: Tensor
    group_ids: Tensor
    mask: Tensor
    step_scores: Tensor | None = None
    step_ends: Tensor | None = None
    step_mask: Tensor | None = None
    baseline_scores: Tensor | None = None


@runtime_checkable
class AdvantageEstimator(Protocol):
    """``estimator(inputs) -> advantages float (B, T)``, zero where ``inputs.mask`` is False.

    It sees the whole step: with several processes the engine gathers every process's rows
    (groups renumbered, ``T`` and ``K`` padded) and calls it once on them, so a statistic over
    the batch (REINFORCE++'s whitening, say) is the one a single process would compute.

    Attributes:
        needs_step_scores: True for an estimator that reads ``inputs.step_scores``/
            ``step_ends``/``step_mask``: the engine then cuts completions into steps and
            fills them (an outcome reward's score counts on the last step). Default False.
        needs_greedy_baseline: True for an estimator that reads ``inputs.baseline_scores``
            (ReMax): the engine then generates one greedy completion per prompt with the
            rollout backend (the step's sampling settings with ``greedy=True``), scores it
            with the step's reward functions and fills them. Default False.
    """

    needs_step_scores: bool = False
    needs_greedy_baseline: bool = False

    def __call__(self, inputs: AdvantageInputs) -> Tensor: ...


# --------------------------------------------------------------------------- KL penalties
@runtime_checkable
class KLPenalty(Protocol):
    """``kl(logp, ref_logp, mask) -> float (B, T)``: a per-token estimate of KL(pi || pi_ref).

    ``logp`` and ``ref_logp`` are ``float (B, T)`` log-probabilities of the sampled tokens
    under the policy and the reference model; the output is zero where ``mask`` is False.
    """

    def __call__(self, logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor: ...


# --------------------------------------------------------------------------- policy losses
@dataclass
class PolicyLossInputs:
    """What a policy loss sees; every tensor is ``(B, T)`` for the rows of one micro-batch.

    Attributes:
        logp: log-probs of the sampled tokens under the current policy (with grad).
        old_logp: log-probs under the policy that sampled them (no grad); equal to
            ``logp.detach()`` when each rollout gets one update (``mu = 1``).
        advantages: per-token advantages.
        mask: ``bool`` completion tokens.
    """

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    mask: Tensor


@dataclass
class PolicyLossOutput:
    """``loss``: ``float (B, T)`` per-token loss to minimise, zero on padding.

    ``metrics``: name -> tensor statistics for logging. Per-token statistics are returned
    as ``(B, T)`` tensors (zero on padding) so the engine can average them over a whole
    mini-batch; scalars are logged as they are. Conventional names: ``ratio``,
    ``clip/low``, ``clip/high``, ``clip/region``.
    """

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


@runtime_checkable
class PolicyLoss(Protocol):
    """``loss(inputs) -> PolicyLossOutput``.

    Attributes:
        zero_advantage_is_zero_loss: True when rows whose advantage is 0 contribute
            exactly 0 loss and gradient: the engine then skips their forward and backward
            when nothing else (KL, entropy) needs them. Default False.
    """

    zero_advantage_is_zero_loss: bool = False

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossOutput: ...


# --------------------------------------------------------------------------- aggregation
@dataclass(frozen=True)
class BatchStats:
    """Normalizers of one optimizer mini-batch, computed before micro-batching and summed
    over processes, so that the gradient of a step does not depend on how the mini-batch
    is split.

    Attributes:
        num_tokens: valid completion tokens in the whole mini-batch.
        num_sequences: completions (rows) in the whole mini-batch.
        max_length: the rollout's ``max_new_tokens``: the constant of Dr. GRPO's norm.
    """

    num_tokens: int
    num_sequences: int
    max_length: int


@runtime_checkable
class LossAggregator(Protocol):
    """``aggregate(loss, mask, stats) -> scalar``.

    ``loss`` is ``float (b, T)`` for one micro-batch of ``b`` rows, ``mask`` its ``bool (b, T)``.
    The result must be a *sum of per-row contributions divided by a normalizer taken from
    ``stats``*, so that summing it over the micro-batches of a mini-batch gives the
    mini-batch's loss.
    """

    def __call__(self, loss: Tensor, mask: Tensor, stats: BatchStats) -> Tensor: ...


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
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    truncated: Tensor
    completions: list[str]
    sampling_logp: Tensor | None = None
    episodes: Episodes | None = None

    @property
    def group_size(self) -> int:
        return self.completion_ids.shape[0] // self.prompt_ids.shape[0]


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


@runtime_checkable
class RolloutBackend(Protocol):
    """Generates completions and keeps its copy of the weights in step with the policy.

    ``setup(model, tokenizer)`` is called once before the first rollout, with the policy
    model (unwrapped) and its tokenizer. ``generate`` samples ``group_size`` completions
    for each prompt. ``sync_weights(model)`` is called once per training step, after all of
    the step's optimizer steps (``algorithm.mu`` times ``train.mini_batches`` of them), and
    once after a resume, by every process (a sharded model is gathered while it runs); a
    backend that generates with the training model itself makes it a no-op.

    Attributes:
        generates_with_policy: True for a backend that runs the policy module it was given
            (the ``hf`` backend): the engine then makes a sharded (FSDP2) policy whole
            around each rollout phase. Default False (a backend with its own copy).
        device: the device of the tensors ``generate`` returns, or None for the CPU. The
            engine builds the tensors of multi-turn episodes there.
    """

    generates_with_policy: bool = False
    device: Any = None

    def setup(self, model: Any, tokenizer: Any) -> None: ...

    def generate(
        self, prompt_ids: list[list[int]], group_size: int, sampling: SamplingParams
    ) -> RolloutBatch: ...

    def sync_weights(self, model: Any) -> None: ...


# --------------------------------------------------------------------------- environments
@dataclass
class Observation:
    """What an environment answers to one model turn.

    Attributes:
        messages: chat messages appended to the conversation (``{"role": "tool",
            "content": ...}`` for a tool result, ``{"role": "user", ...}`` for a user
            turn); rendered with the model's chat template and fed back as context.
        done: the episode is over (no further model turn).
        reward: the environment's own reward for the episode, or ``None``; the last one
            an episode returns reaches reward functions as the ``env_reward`` column.
        tool_calls: tool calls the turn made (for the ``env/`` metrics).
        tool_errors: of those, calls that failed (malformed, unknown tool, raised, timed out).
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0


@runtime_checkable
class Environment(Protocol):
    """A multi-turn episode source: tools, a simulated user, a game.

    ``tools``: JSON schemas of the functions the model may call (transformers' format,
    ``{"type": "function", "function": {...}}``), given to the chat template with the
    prompt; empty for an environment without tools. ``stop``: strings that end a model
    turn besides EOS (``"</tool_call>"`` for tools). ``reset(row)`` opens an episode for
    a dataset row and returns its state (anything); ``step(state, text)`` takes the text of
    one model turn and returns the next :class:`Observation`. ``step`` runs in the
    trainer's process and must not raise for the model's mistakes: they are observations.
    """

    tools: list[dict[str, Any]]
    stop: tuple[str, ...]

    def reset(self, row: dict[str, Any]) -> Any: ...

    def step(self, state: Any, text: str) -> Observation: ...


@dataclass
class Episodes:
    """Per-row records of ``B`` multi-turn episodes (attached to their :class:`RolloutBatch`).

    Attributes:
        messages: the conversation after the prompt, per row (assistant turns and the
            environment's messages, in order): what reward functions receive.
        env_rewards: the environment's reward per row, or ``None``.
        turns: ``long (B,)`` model turns.
        tool_calls: ``long (B,)``; tool_errors: ``long (B,)``.
        lengths: ``long (B,)`` episode length in tokens after the prompt (model and
            environment tokens; the model's are ``completion_mask.sum(1)``).
    """

    messages: list[list[dict[str, Any]]]
    env_rewards: list[float | None]
    turns: Tensor
    tool_calls: Tensor
    tool_errors: Tensor
    lengths: Tensor

    def select(self, rows: Sequence[int]) -> Episodes:
        idx = torch.tensor(list(rows), dtype=torch.long)
        return Episodes([self.messages[i] for i in rows], [self.env_rewards[i] for i in rows],
                        self.turns[idx], self.tool_calls[idx], self.tool_errors[idx], self.lengths[idx])

    @staticmethod
    def concat(parts: Sequence[Episodes]) -> Episodes:
        return Episodes([m for p in parts for m in p.messages], [r for p in parts for r in p.env_rewards],
                        *(torch.cat([getattr(p, k) for p in parts]) for k in ("turns", "tool_calls",
                                                                              "tool_errors", "lengths")))


# --------------------------------------------------------------------------- rewards
@runtime_checkable
class RewardFunction(Protocol):
    """TRL's signature: ``reward(prompts, completions, **columns) -> list[float | None]``.

    ``prompts`` and ``completions`` have ``B`` entries each (a prompt repeated ``G`` times):
    strings, or lists of chat messages when the dataset's prompts are conversational.
    Every other dataset column arrives as a keyword argument, also repeated per completion,
    with ``completion_ids`` (list of token id lists). ``None`` marks an unscorable completion.

    A process reward names a ``steps`` parameter: the engine then passes ``steps``, one list
    of step texts per completion (cut by the spec's step splitter), and expects one score
    (or None) per step back for each completion. A completion whose text has no step gets
    one empty step ``""``, so it is still scored.

    Attributes:
        required_columns: dataset columns the function reads; the engine checks every row
            has them before the first step and names the missing one. Default ``()``.
    """

    required_columns: Sequence[str] = ()

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list: ...


def reward_value(value: Any) -> float | None:
    """The one rule for a reward value, whatever its source (a local function, a process
    reward's step score, the ``remote`` reward's answer): None (unscorable) stays None; a
    finite real number (``int``, ``float``, ``bool``, a numpy scalar, a one-element tensor or
    array) becomes a float. Anything else raises ``ValueError`` saying what it is: a string
    (even ``"0.5"``), NaN, an infinity, an integer too large for a float (``10**400``)."""
    if value is None:
        return None
    if not isinstance(value, numbers.Real) and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # a 0-d tensor or array, numpy's bool
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, numbers.Real):
        raise ValueError(f"{type(value).__name__} {value!r:.60}")
    try:
        out = float(value)
    except OverflowError:
        raise ValueError(f"{type(value).__name__} too large for a float ({str(value)[:20]}...)") from None
    if not math.isfinite(out):
        raise ValueError(str(out))
    return out


@runtime_checkable
class StepSplitter(Protocol):
    """``split(text) -> [(start, end), ...]``: character spans of the steps of one
    completion's text, in order, non-overlapping, each non-empty (``start < end``).

    ``text[start:end]`` is the step's text (delimiters and surrounding blanks left out).
    For the advantage, a step runs up to where the next one starts (its delimiter is part
    of it) and the last step runs to the completion's last token (EOS included), so every
    completion token gets an advantage.
    """

    def __call__(self, text: str) -> list[tuple[int, int]]: ...


@dataclass
class RewardExample:
    """One labelled sample for training a reward model (iterative GRPO).

    ``prompt`` and ``completion`` are what reward functions receive (strings, or chat
    messages for conversational data); ``label`` is the verifier's score.
    """

    prompt: Any
    completion: Any
    label: float


@runtime_checkable
class TrainableReward(Protocol):
    """A reward function that can be trained (iterative GRPO): it is called like any
    reward function and, at each iteration start, ``fit`` trains it on fresh labelled
    samples of the latest policy (plus whatever replay it keeps) and ``evaluate`` scores
    it on held-out samples. Both return metrics (name -> float; ``fit`` reports at least
    ``train_loss``, ``evaluate`` at least ``accuracy``). Its ``state_dict`` covers the
    weights, the optimizer and any replay buffer, so checkpoints and resume include them.
    """

    def fit(self, examples: list[RewardExample]) -> dict[str, float]: ...

    def evaluate(self, examples: list[RewardExample]) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# --------------------------------------------------------------------------- data
@runtime_checkable
class Dataset(Protocol):
    """Rows of a task: each a dict with the prompt column plus any other columns.

    ``load(split)`` returns the rows of ``"train"`` or ``"eval"`` (an empty list when the
    task has no held-out split). Relative paths in its options are resolved by the spec.
    """

    def load(self, split: str) -> list[dict[str, Any]]: ...


# --------------------------------------------------------------------------- tracking
@runtime_checkable
class Tracker(Protocol):
    """Receives run events; must never raise for a failure of its own backend.

    ``start(run_name, resume_id)`` returns the run id (or None); ``log_params`` gets the
    resolved spec flattened to dotted keys; ``log_metrics(metrics, step)``;
    ``log_artifact(path)``; ``log_table(name, rows, step)``; ``finish(status)`` with
    status one of ``FINISHED``, ``FAILED``, ``KILLED``.

    Attributes:
        run_id: the tracker's run id once it has one, else None; checkpointed, so that a
            resumed run logs into the same tracker run. Default None.
        tracking_uri: where the run can be browsed (the end-of-run summary prints it), or
            None. Default None.
        log_model: ``log_model(folder) -> uri or None``, called with the final model's
            folder after training, for a tracker that stores models; None for one that does
            not. Default None.
    """

    run_id: str | None = None
    tracking_uri: str | None = None
    log_model: Any = None

    def start(self, run_name: str, resume_id: str | None = None) -> str | None: ...

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifact(self, path: str) -> None: ...

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None: ...

    def finish(self, status: str) -> None: ...


# --------------------------------------------------------------------------- state
@runtime_checkable
class Stateful(Protocol):
    """A component whose state carries across steps (an adaptive controller, a replay
    buffer, a sampler's position), of any kind: the engine checkpoints ``state_dict()`` with
    the run and hands it back to ``load_state_dict(state)`` on resume, before the first
    resumed step. The state is pickled with ``torch.save``; tensors in it are fine.

    A component has both methods or neither (:func:`grpo_core.registry.conform` refuses one
    without the other).
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def masked_fill_zero(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` with every position outside ``mask`` set to exactly 0 (NaN/inf included)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _content_text(content: Any) -> str:
    """The text of a message's ``content``: a string, or a list of typed parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal parts: [{"type": "text", "text": ...}]
        return "".join(
            part.get("text", "") if isinstance(part, dict) else str(part) for part in content
        )
    return str(content)


def completion_text(completion: Any) -> str:
    """The text of one completion, whatever its representation.

    A string is returned as is; a chat message ``{"role", "content"}`` gives its content;
    a list of messages (TRL's conversational completion, ``[{"role": "assistant",
    "content": text}]``) gives the concatenated contents of its assistant messages: in a
    multi-turn episode the tool results and user turns are the environment's text, not
    the model's.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _content_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        return "".join(
            completion_text(message) for message in completion
            if not isinstance(message, dict) or message.get("role", "assistant") == "assistant"
        )
    raise TypeError(
        f"a completion must be a string or a list of chat messages, got {type(completion).__name__}"
    )
