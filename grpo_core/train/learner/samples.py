"""Training samples of split agent episodes.

An agent episode whose history was not append-only (``rollout.agent.history: split``) is one
rollout row holding several training samples one after the other
(:attr:`grpo_core.contracts.Episodes.splits`): each its own prompt (the group's prompt, then
context) and the tokens sampled under it. The learner trains each sample as its own sequence:
:func:`sample_rows` lays the batch out with one row per sample, the ``G`` episodes' samples of a
prompt together and every prompt's rows padded to the same count ``G'`` (rows without an
episode, empty), so that ``row // G'`` is still a row's prompt and a mini-batch holds whole
groups.

Rewards and advantages stay the episode's: the advantage estimator sees one row per episode
(its trained tokens at their places in the episode's row) and its advantages go to every
sample's tokens at the same places (:meth:`SampleRows.expand`); what is computed per sample and
read per episode (the KL in the reward, a teacher's log-probs) comes back the other way
(:meth:`SampleRows.collapse`). The loss aggregator counts each sample as a sequence
(``BatchStats.num_sequences`` counts sample rows, padding rows left out); a token-level
aggregator's loss is the same split or not, since every trained token is in exactly one sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_core.contracts import RolloutBatch


@dataclass
class SampleRows:
    """Where each of ``B'`` sample rows comes from in a rollout of ``B`` episode rows of width
    ``T``: ``episode`` ``long (B',)`` its rollout row, -1 for a padding row; ``start``
    ``long (B',)`` where its completion starts in that row; ``length`` ``long (B',)`` how many
    of that row's positions it holds."""

    episode: Tensor
    start: Tensor
    length: Tensor
    width: int

    def _index(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        positions = torch.arange(int(self.length.max()) if len(self.length) else 0, device=device)
        episode, start, length = (t.to(device) for t in (self.episode, self.start, self.length))
        valid = (positions[None, :] < length[:, None]) & (episode[:, None] >= 0)
        return episode[:, None].clamp(min=0).expand(-1, len(positions)), (start[:, None] + positions), valid

    def expand(self, t: Tensor, fill: float | bool | int = 0) -> Tensor:
        """``(B', T')``: each sample row's positions of the episode-row tensor ``t (B, T)``,
        ``fill`` elsewhere."""
        rows, cols, valid = self._index(t.device)
        taken = t[rows, cols.clamp(max=max(t.shape[1] - 1, 0))] if t.shape[1] else t.new_zeros(rows.shape)
        return torch.where(valid, taken, torch.full((), fill, dtype=t.dtype, device=t.device))

    def collapse(self, t: Tensor, fill: float | bool | int = 0) -> Tensor:
        """``(B, T)``: the sample-row tensor ``t (B', T')`` put back at its episodes' places,
        ``fill`` where no sample holds a position."""
        rows, cols, valid = self._index(t.device)
        out = torch.full((int(self.episode.max()) + 1 if len(self.episode) else 0, self.width), fill,
                         dtype=t.dtype, device=t.device)
        out[rows[valid], cols[valid]] = t[:, : valid.shape[1]][valid]
        return out

    def real(self, rows: Tensor) -> int:
        """How many of ``rows`` hold a sample (not padding)."""
        return int((self.episode[rows.cpu()] >= 0).sum())


def sample_rows(rollout: RolloutBatch) -> SampleRows | None:
    """The sample layout of ``rollout`` (see the module doc), or None when no episode of it was
    split (one row per episode, as the rollout is)."""
    episodes = rollout.episodes
    if episodes is None or episodes.splits is None or not any(episodes.splits):
        return None
    groups, g = rollout.prompt_ids.shape[0], rollout.group_size
    lengths = episodes.lengths.tolist()
    per_group: list[list[tuple[int, int, int]]] = []
    for p in range(groups):
        rows = []
        for i in range(p * g, (p + 1) * g):
            edges = [0, *episodes.splits[i], lengths[i]]
            rows += [(i, a, b - a) for a, b in zip(edges, edges[1:])]
        per_group.append(rows)
    size = max(len(rows) for rows in per_group)
    table = [row for rows in per_group for row in rows + [(-1, 0, 0)] * (size - len(rows))]
    episode, start, length = (torch.tensor(column, dtype=torch.long) for column in zip(*table))
    return SampleRows(episode, start, length, rollout.completion_ids.shape[1])
