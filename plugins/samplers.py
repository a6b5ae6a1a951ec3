"""Built-in prompt samplers: ``mixture`` (sources drawn by weight; see :class:`Mixture`) and
``curriculum``: draw the training rows whose pass rate is in a band
(not yet solved, not hopeless), learning each row's pass rate from its groups' rewards.

Each row's pass rate is an exponential moving average of its groups' mean total reward:
the first observation sets it, each next one ``r <- decay * r + (1 - decay) * mean`` (a
group with no scorable completion changes nothing). With a 0/1 verifier as the reward the
rate is a pass rate; otherwise it is in the units of the total reward, and so is the band.

Each draw picks one row, with replacement: with probability ``explore`` uniformly among all
rows (so rows outside the band are measured again as the policy changes), otherwise
uniformly among the rows in the band ``low <= r <= high``, rows never seen counting as in
the band; when the band is empty, uniformly among all rows. So one row's probability is
``explore / N + (1 - explore) * [in band] / |band|``. Draw ``k`` of the run uses a
generator seeded with ``(train.seed, k)``, and the state is the draw count and the rates:
a resumed run draws exactly what the uninterrupted one did.

Curriculum sampling by pass rate follows the balanced online difficulty filtering of Bae et
al., "Online Difficulty Filtering for Reasoning Oriented Reinforcement Learning" (EACL 2026,
https://arxiv.org/abs/2504.03380): prompts of intermediate pass rate carry the most signal.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import Field, field_validator, model_validator

from grpo_core import hookimpl
from grpo_core.errors import RunError
from grpo_core.options import Options

__all__ = ["CurriculumOptions", "Curriculum", "MixtureOptions", "Mixture"]


class CurriculumOptions(Options):
    """Options of the ``curriculum`` prompt sampler."""

    low: float = Field(0.05, allow_inf_nan=False, description="Lowest pass rate of the band (rows below it are "
                       "hopeless for now).")
    high: float = Field(0.95, allow_inf_nan=False, description="Highest pass rate of the band (rows above it are "
                        "solved).")
    decay: float = Field(0.5, ge=0.0, lt=1.0, description="EMA decay of a row's pass rate: r <- decay * r + "
                         "(1 - decay) * its group's mean reward (0: the last group's mean alone).")
    explore: float = Field(0.1, ge=0.0, le=1.0, description="Fraction of draws taken uniformly from all rows, so "
                           "that rows outside the band are measured again.")

    @model_validator(mode="after")
    def _band(self):
        if self.low > self.high:
            raise ValueError(f"the band needs low <= high, got low={self.low}, high={self.high}")
        return self


class Curriculum:
    """Rows drawn by their pass rate; see the module doc."""

    def __init__(self, options: CurriculumOptions):
        self.options = options
        self.size = 0
        self.seed = 0
        self.draws = 0
        self.rates: dict[int, float] = {}

    def __repr__(self) -> str:
        o = self.options
        return f"curriculum(band=[{o.low}, {o.high}], decay={o.decay}, explore={o.explore})"

    def start(self, rows: list[dict[str, Any]], seed: int) -> None:
        self.size, self.seed = len(rows), seed

    def in_band(self) -> np.ndarray:
        """Indices of the rows in the band (never-seen rows included)."""
        o = self.options
        keep = [i for i in range(self.size) if i not in self.rates or o.low <= self.rates[i] <= o.high]
        return np.asarray(keep, dtype=np.int64)

    def draw(self, n: int) -> list[int]:
        band = self.in_band()
        out = []
        for _ in range(n):
            rng = np.random.default_rng([self.seed, self.draws])
            self.draws += 1
            explore = rng.random() < self.options.explore
            pool_size = self.size if explore or band.size == 0 else band.size
            pick = int(rng.integers(pool_size))
            out.append(pick if explore or band.size == 0 else int(band[pick]))
        return out

    def observe(self, rows: list[int], rewards: list[float]) -> None:
        decay = self.options.decay
        for row, mean in zip(rows, rewards):
            if math.isnan(mean):
                continue
            old = self.rates.get(row)
            self.rates[row] = mean if old is None else decay * old + (1.0 - decay) * mean

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self.draws, "rates": [[row, rate] for row, rate in sorted(self.rates.items())]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.draws = int(state["draws"])
        self.rates = {int(row): float(rate) for row, rate in state["rates"]}


class MixtureOptions(Options):
    """Options of the ``mixture`` prompt sampler."""

    column: str = Field("source", min_length=1, description="Column naming each row's source (usually "
                        "data.source_column).")
    weights: dict[str, float] = Field(min_length=1, description="Source -> its share of the draws (normalized), "
                                      "e.g. {math: 3, code: 1}; every source of the rows must be listed.")

    @field_validator("weights")
    @classmethod
    def _drawable(cls, weights: dict[str, float]) -> dict[str, float]:
        bad = {k: v for k, v in weights.items() if not (v > 0 and math.isfinite(v))}
        if bad:
            raise ValueError(f"weights must be finite and > 0, got {bad}")
        total = sum(weights.values())
        if not math.isfinite(total):
            raise ValueError(f"weights sum to {total} (each is finite, but float64 cannot hold their sum); only "
                             "their ratios matter, so scale them down, e.g. {math: 3, code: 1}")
        never = {k: v for k, v in weights.items() if v / total == 0}
        if never:
            name, value = next(iter(never.items()))
            raise ValueError(f"weights: '{name}' ({value:g}) is drawn with probability 0 beside a total of {total:g} "
                             "(its share underflows float64): give weights whose ratios float64 can hold, "
                             "e.g. {math: 3, code: 1}")
        return weights


class Mixture:
    """Rows drawn source by source: a draw picks a source with probability its weight's share,
    then that source's next row in its own seeded shuffle (a new shuffle each time the source
    runs out), so each source's rows come round equally often whatever its weight. Draw ``k``
    uses a generator seeded with ``(train.seed, k)``; the state is the draw count and each
    source's epoch and position, so a resumed run draws what the uninterrupted one did."""

    def __init__(self, options: MixtureOptions):
        self.options = options
        self.names = sorted(options.weights)
        total = sum(options.weights.values())
        self.probs = np.array([options.weights[n] / total for n in self.names])
        self.rows: dict[str, list[int]] = {}
        self.seed = self.draws = 0
        self.epoch = dict.fromkeys(self.names, 0)
        self.position = dict.fromkeys(self.names, 0)
        self._orders: dict[str, tuple[tuple[str, int], np.ndarray]] = {}  # source -> ((source, epoch), shuffle)

    def __repr__(self) -> str:
        return f"mixture({self.options.column}: {dict(self.options.weights)})"

    def start(self, rows: list[dict[str, Any]], seed: int) -> None:
        column, self.seed = self.options.column, seed
        found: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            if column not in row:
                raise RunError(f"data.sampler 'mixture': row {i} has no column '{column}'; its columns are: "
                               f"{', '.join(row)}")
            found.setdefault(str(row[column]), []).append(i)
        self._orders = {}
        unknown, empty = sorted(set(found) - set(self.names)), [n for n in self.names if n not in found]
        if unknown or empty:
            raise RunError(f"data.sampler 'mixture': weights name the sources {self.names}; the rows' column "
                           f"'{column}' holds {sorted(found)}" + (f" (no weight for {unknown})" if unknown else "")
                           + (f" (no rows for {empty})" if empty else ""))
        self.rows = found

    def _order(self, name: str) -> np.ndarray:
        """The source's shuffle for its current epoch, made once per epoch (a function of the
        seed, the source and the epoch: a resumed run makes the same one)."""
        key = (name, self.epoch[name])
        if self._orders.get(name, (None,))[0] != key:
            index = self.names.index(name)
            order = np.random.default_rng([self.seed, index, self.epoch[name]]).permutation(len(self.rows[name]))
            self._orders[name] = (key, order)
        return self._orders[name][1]

    def draw(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            rng = np.random.default_rng([self.seed, self.draws])
            self.draws += 1
            name = self.names[int(rng.choice(len(self.names), p=self.probs))]
            if self.position[name] >= len(self.rows[name]):
                self.epoch[name] += 1
                self.position[name] = 0
            out.append(self.rows[name][int(self._order(name)[self.position[name]])])
            self.position[name] += 1
        return out

    def observe(self, rows: list[int], rewards: list[float]) -> None:
        pass  # the mixture does not depend on the rewards

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self.draws, "epoch": dict(self.epoch), "position": dict(self.position)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.draws = int(state["draws"])
        self.epoch.update({k: int(v) for k, v in state["epoch"].items() if k in self.epoch})
        self.position.update({k: int(v) for k, v in state["position"].items() if k in self.position})


@hookimpl
def register_prompt_samplers(register) -> None:
    register.add("curriculum", Curriculum, options=CurriculumOptions)
    register.add("mixture", Mixture, options=MixtureOptions)
