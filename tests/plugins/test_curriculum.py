"""The ``curriculum`` prompt sampler: its pass-rate EMA against the formula, its draws against
the distribution the module doc states (a chi-square test, which rejects a wrong one), exact
resume on its own and in a tiny run, and the spec's errors."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from grpo_plugins.samplers import Curriculum, CurriculumOptions
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_core.checkpoint import load_state
from grpo_core.cli import main
from grpo_core.testing import save_tiny_model

# chi2.ppf(0.999, df=19): a test at the 0.1 % level on 20 rows (scipy.stats, computed once)
CHI2_CRITICAL_19 = 43.82


def sampler(size: int = 20, seed: int = 3, **options) -> Curriculum:
    s = Curriculum(CurriculumOptions(**options))
    s.start([{}] * size, seed)
    return s


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.one_of(st.floats(0, 1), st.just(math.nan))), max_size=30),
       st.floats(0, 0.99))
def test_the_rate_is_the_ema_of_the_group_means(events, decay):
    s = sampler(5, decay=decay)
    expected: dict[int, float] = {}
    for row, mean in events:
        s.observe([row], [mean])
        if not math.isnan(mean):
            expected[row] = mean if row not in expected else decay * expected[row] + (1 - decay) * mean
    assert s.rates.keys() == expected.keys()
    assert all(s.rates[k] == pytest.approx(v) for k, v in expected.items())


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


def test_the_draws_follow_the_stated_distribution():
    """Rows 0-4 solved, 5-9 hopeless, 10-14 in the band, 15-19 never seen (in the band too):
    P(row) = explore / N + (1 - explore) * [in band] / |band|."""
    s = sampler(20, explore=0.2, low=0.1, high=0.9)
    s.observe(list(range(15)), [1.0] * 5 + [0.0] * 5 + [0.5] * 5)
    counts = [0] * 20
    for _ in range(1000):
        for row in s.draw(16):
            counts[row] += 1
    stated = [0.2 / 20 + (0.8 / 10 if row >= 10 else 0.0) for row in range(20)]
    assert chi_square(counts, stated) < CHI2_CRITICAL_19
    # the test has power: the distribution without exploration, or a uniform one, is rejected
    no_explore = [0.01 / 20 + (0.99 / 10 if row >= 10 else 0.0) for row in range(20)]
    assert chi_square(counts, no_explore) > 10 * CHI2_CRITICAL_19
    assert chi_square(counts, [1 / 20] * 20) > 10 * CHI2_CRITICAL_19


def test_an_empty_band_draws_from_all_rows_and_rows_come_back_into_it():
    s = sampler(4, explore=0.0, low=0.2, high=0.8)
    s.observe([0, 1, 2, 3], [1.0, 1.0, 0.0, 0.0])
    assert s.in_band().size == 0 and set(s.draw(200)) == {0, 1, 2, 3}
    s.observe([0], [0.0])  # EMA 0.5 * 1 + 0.5 * 0: back in the band
    assert s.rates[0] == 0.5 and set(s.draw(50)) == {0}


def test_a_sampler_restored_from_its_state_draws_what_the_original_does():
    a = sampler(30, explore=0.3)
    for _ in range(5):
        rows = a.draw(4)
        a.observe(rows, [(r % 3) / 2 for r in rows])
    b = sampler(30, explore=0.3)
    b.load_state_dict(yaml.safe_load(yaml.safe_dump(a.state_dict())))  # plain data only
    for _ in range(5):
        rows = a.draw(4)
        assert b.draw(4) == rows
        a.observe(rows, [0.5] * 4)
        b.observe(rows, [0.5] * 4)
    assert a.state_dict() == b.state_dict()


def test_bad_options_say_what_is_valid():
    with pytest.raises(ValidationError, match="low <= high"):
        CurriculumOptions(low=0.9, high=0.1)
    with pytest.raises(ValidationError, match="less than 1"):
        CurriculumOptions(decay=1.0)


def run(folder, model, *args: str, staleness: int = 0) -> int:
    spec = {
        "model": {"path": str(model)},
        "data": {"name": "arithmetic", "train_size": 12, "eval_size": 0,
                 "sampler": {"name": "curriculum", "explore": 0.25, "low": 0.05, "high": 0.95}},
        "rollout": {"group_size": 2, "max_new_tokens": 4, "temperature": 1.0, "max_staleness": staleness},
        "rewards": [{"name": "format", "pattern": "^\\s*\\d"}],
        "train": {"steps": 4, "prompts_per_step": 3, "lr": 1.0e-2, "progress": False, "threads": 1,
                  "log_completions_every": 0, "output_dir": str(folder)},
        "checkpoint": {"every": 1, "keep": 5},
        "eval": {"at_start": False, "at_end": False},
        "tracking": [],
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder.parent / f"{folder.name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return main([str(path), *args])


@pytest.mark.parametrize("staleness", [0, 1], ids=["synchronous", "asynchronous"])
def test_a_tiny_run_resumes_drawing_exactly_what_the_uninterrupted_one_drew(tmp_path, monkeypatch, staleness):
    """Asynchronous too: the actor draws step s + 1 after it scored step s, whatever the
    learner is doing, and a checkpoint rewinds the sampler to its state before the first
    untrained step's draw."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model = save_tiny_model(tmp_path / "model")
    assert run(tmp_path / "a", model, staleness=staleness) == 0
    resume = str(tmp_path / "a" / "checkpoints" / "step-000002")
    assert run(tmp_path / "b", model, "--resume", resume, staleness=staleness) == 0
    a = load_state(tmp_path / "a" / "checkpoints" / "step-000004" / "state.pt")  # weights_only: plain data
    b = load_state(tmp_path / "b" / "checkpoints" / "step-000004" / "state.pt")
    sampler_a, sampler_b = a["data"]["sampler"], b["data"]["sampler"]
    assert sampler_a["draws"] == 12  # 4 steps x 3 prompts
    assert sampler_a["rates"] and sampler_a == sampler_b  # the same rows drawn, scored the same
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "a" / "checkpoints" / "step-000004" / "model" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "checkpoints" / "step-000004" / "model" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
