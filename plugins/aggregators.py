"""Built-in loss aggregators: ``token-mean``, ``seq-mean-token-mean``,
``seq-mean-token-sum``, ``seq-mean-token-sum-norm`` (Dr. GRPO) and ``token-sum``.

``aggregate(loss (b, T), mask (b, T), stats) -> scalar`` for one micro-batch of ``b``
rows. Each result is a sum of per-row contributions divided by a normalizer taken from
``stats`` (:class:`~grpo_core.contracts.BatchStats`, computed over the whole optimizer
mini-batch), never from the micro-batch itself: summing the results over the
micro-batches of a mini-batch gives the mini-batch's loss, so the gradient of a step does
not depend on the micro-batch size or the number of processes.

Padded positions are excluded with ``torch.where``, so inf/NaN there never leak in. A zero
normalizer gives a loss of 0 (still attached to the graph), not NaN.
"""

from __future__ import annotations

from pydantic import Field, field_validator
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.contracts import BatchStats, masked_fill_zero
from grpo_core.options import Options

__all__ = [
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "token_sum",
    "SeqMeanTokenSumNormOptions",
]


def _divide(total: Tensor, normalizer: float) -> Tensor:
    """``total / normalizer``, or ``total * 0`` when the normalizer is not positive."""
    return total / normalizer if normalizer > 0 else total * 0.0


def token_sum(loss: Tensor, mask: Tensor, stats: BatchStats) -> Tensor:
    """``sum_i sum_t loss_it`` over valid tokens; no normalizer (``stats`` unused).

    Args:
        loss: ``float (b, T)``; mask: ``bool (b, T)``; stats: the mini-batch's normalizers.
    """
    return masked_fill_zero(loss, mask).sum()


def token_mean(loss: Tensor, mask: Tensor, stats: BatchStats) -> Tensor:
    """``sum_i sum_t loss_it / N`` with ``N = stats.num_tokens`` (valid tokens of the
    mini-batch): every token weighs the same (DAPO's token-level loss,
    https://arxiv.org/abs/2503.14476).

    Args:
        loss: ``float (b, T)``; mask: ``bool (b, T)``; stats: the mini-batch's normalizers.
    """
    return _divide(token_sum(loss, mask, stats), stats.num_tokens)


def seq_mean_token_mean(loss: Tensor, mask: Tensor, stats: BatchStats) -> Tensor:
    """``sum_i (1/|o_i| sum_t loss_it) / S`` with ``S = stats.num_sequences``: GRPO's
    ``1/G sum_i 1/|o_i| sum_t`` (DeepSeekMath, https://arxiv.org/abs/2402.03300). Rows without
    tokens contribute 0.

    Args:
        loss: ``float (b, T)``; mask: ``bool (b, T)``; stats: the mini-batch's normalizers.
    """
    row_sums = masked_fill_zero(loss, mask).sum(dim=1)
    lengths = mask.sum(dim=1).clamp(min=1).to(row_sums.dtype)
    return _divide((row_sums / lengths).sum(), stats.num_sequences)


def seq_mean_token_sum(loss: Tensor, mask: Tensor, stats: BatchStats) -> Tensor:
    """``sum_i sum_t loss_it / S`` with ``S = stats.num_sequences``.

    Args:
        loss: ``float (b, T)``; mask: ``bool (b, T)``; stats: the mini-batch's normalizers.
    """
    return _divide(token_sum(loss, mask, stats), stats.num_sequences)


def seq_mean_token_sum_norm(
    loss: Tensor, mask: Tensor, stats: BatchStats, *, norm_length: int | None = None
) -> Tensor:
    """Dr. GRPO's ``sum_i sum_t loss_it / (S * L)`` (https://arxiv.org/abs/2503.20783), with
    ``S = stats.num_sequences`` and the constant ``L = norm_length`` or, when None,
    ``stats.max_length`` (the rollout's ``max_new_tokens``): no length bias.

    Args:
        loss: ``float (b, T)``; mask: ``bool (b, T)``; stats: the mini-batch's normalizers.
        norm_length: the constant ``L``, or None for ``stats.max_length``.
    """
    length = stats.max_length if norm_length is None else norm_length
    return _divide(token_sum(loss, mask, stats), stats.num_sequences * length)


class SeqMeanTokenSumNormOptions(Options):
    """Options of ``seq-mean-token-sum-norm``."""

    norm_length: int | None = Field(
        None,
        description="The constant L each sequence's summed loss is divided by, a positive integer, or "
        "null (default) for the rollout's max_new_tokens, Dr. GRPO's choice.",
    )

    @field_validator("norm_length")
    @classmethod
    def _check_norm_length(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(
                f"norm_length must be a positive integer (a token count) or null for the "
                f"rollout's max_new_tokens; got {value!r}"
            )
        return value


class SeqMeanTokenSumNorm:
    """Dr. GRPO: summed token losses divided by num_sequences * a constant length (https://arxiv.org/abs/2503.20783)."""

    def __init__(self, options: SeqMeanTokenSumNormOptions):
        self.options = options

    def __call__(self, loss: Tensor, mask: Tensor, stats: BatchStats) -> Tensor:
        return seq_mean_token_sum_norm(loss, mask, stats, norm_length=self.options.norm_length)


@hookimpl
def register_loss_aggregators(register):
    register.add(
        "token-mean", token_mean, description="sum of token losses / tokens in the mini-batch"
    )
    register.add(
        "seq-mean-token-mean",
        seq_mean_token_mean,
        description="mean over sequences of each sequence's token mean (DeepSeekMath's GRPO)",
    )
    register.add(
        "seq-mean-token-sum",
        seq_mean_token_sum,
        description="sum of token losses / sequences in the mini-batch",
    )
    register.add("seq-mean-token-sum-norm", SeqMeanTokenSumNorm, options=SeqMeanTokenSumNormOptions)
    register.add("token-sum", token_sum, description="plain sum of token losses")
