"""Dataset mixtures: the ``mixture`` sampler's draws against its weights (a chi-square test
that rejects a wrong mixture), each source's rows coming round evenly, exact resume, rewards
routed to sources by ``data.source_column``, the per-source metrics of a tiny run, and the
errors."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from grpo_plugins.samplers import Mixture, MixtureOptions
from pydantic import ValidationError

from grpo_core.cli import main
from grpo_core.errors import RunError
from grpo_core.spec import load_spec
from grpo_core.testing import save_tiny_model
from grpo_core.train.actor.scoring import RewardFn, score

# chi2.ppf(0.999, df=2): a test at the 0.1 % level on three sources (scipy.stats, computed once)
CHI2_CRITICAL_2 = 13.82
ROWS = [{"source": "math"}] * 7 + [{"source": "code"}] * 3 + [{"source": "chat"}] * 5


def mixture(rows=ROWS, seed=1, **weights) -> Mixture:
    m = Mixture(MixtureOptions(weights=weights or {"math": 3, "code": 1, "chat": 1}))
    m.start(rows, seed)
    return m


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


def test_sources_are_drawn_by_weight_and_each_sources_rows_come_round_evenly():
    m = mixture()
    drawn = [row for _ in range(500) for row in m.draw(8)]
    by_source = {name: [r for r in drawn if ROWS[r]["source"] == name] for name in ("math", "code", "chat")}
    counts = [len(by_source[n]) for n in ("math", "code", "chat")]
    assert chi_square(counts, [0.6, 0.2, 0.2]) < CHI2_CRITICAL_2
    assert chi_square(counts, [1 / 3] * 3) > 10 * CHI2_CRITICAL_2  # the test tells a wrong mixture apart
    for name, rows in by_source.items():  # a source's own shuffle: every row once per pass over it
        size = sum(r["source"] == name for r in ROWS)
        for start in range(0, len(rows) - size + 1, size):
            assert len(set(rows[start:start + size])) == size, name


def test_a_mixture_restored_from_its_state_draws_what_the_original_does():
    a = mixture()
    a.draw(13)
    b = mixture()
    b.load_state_dict(yaml.safe_load(yaml.safe_dump(a.state_dict())))
    assert [b.draw(4) for _ in range(6)] == [a.draw(4) for _ in range(6)]


def test_sources_and_weights_must_match():
    with pytest.raises(RunError, match=r"holds \['chat', 'code', 'math'\] \(no weight for \['chat'\]\)"):
        mixture(math=1, code=1)
    with pytest.raises(RunError, match=r"no rows for \['poetry'\]"):
        mixture(math=1, code=1, chat=1, poetry=1)
    with pytest.raises(RunError, match="row 0 has no column 'source'"):
        mixture(rows=[{"prompt": "x"}], math=1)
    with pytest.raises(ValidationError, match="finite and > 0"):
        MixtureOptions(weights={"math": 0})


def test_a_routed_reward_scores_only_its_sources_rows():
    seen = []

    def count_rows(prompts, completions, **kw):
        seen.append(list(kw["source"]))
        return [1.0] * len(completions)

    def length(prompts, completions, **kw):
        return [float(len(c)) for c in completions]

    fns = [RewardFn.of("code_only", 2.0, count_rows, only=("source", frozenset({"code"}))),
           RewardFn.of("math_only", 1.0, length, only=("source", frozenset({"math"})))]
    sources = ["math", "code", "code", "chat"]
    scores = score(fns, ["p"] * 4, ["a", "bb", "ccc", "dddd"], {"source": sources}, [[1]] * 4)
    assert seen == [["code", "code"]]
    table = scores.per_function.tolist()
    assert table[0][1] == 1.0 and math.isnan(table[0][0]) and table[1][0] == 1.0 and math.isnan(table[1][1])
    total = scores.total.tolist()
    assert total[:3] == [1.0, 2.0, 2.0] and math.isnan(total[3])  # chat: no function scores it


def spec(tmp_path, model, **data) -> dict:
    rows = [{"prompt": f"{a} + {a} =", "answer": str(2 * a), "source": "math"} for a in range(6)]
    rows += [{"prompt": f"say {w}:", "answer": w, "source": "words"} for w in ("yes", "no", "maybe")]
    (tmp_path / "mix.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "model": {"path": str(model)},
        "data": {"name": "file", "train": str(tmp_path / "mix.jsonl"), "source_column": "source",
                 "sampler": {"name": "mixture", "weights": {"math": 2, "words": 1}}, **data},
        "rollout": {"group_size": 2, "max_new_tokens": 4},
        "rewards": [{"name": "format", "pattern": "^\\s*\\d", "sources": ["math"]},
                    {"name": "format", "pattern": "[a-z]", "sources": ["words"]}],
        "train": {"steps": 3, "prompts_per_step": 3, "progress": False, "threads": 1, "log_completions_every": 0,
                  "output_dir": str(tmp_path / "out")},
        "eval": {"at_start": False, "at_end": False},
        "tracking": [],
    }


def test_sources_need_a_source_column(tmp_path):
    s = spec(tmp_path, tmp_path / "no-model")
    del s["data"]["source_column"]
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(s))
    with pytest.raises(Exception, match="set data.source_column"):
        load_spec(path, external_plugins=False)


def test_a_tiny_mixture_run_logs_each_source(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec(tmp_path, save_tiny_model(tmp_path / "model"))))
    assert main([str(path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    assert len(steps) == 3
    counts = [r.get("data/source/math/prompts", 0.0) + r.get("data/source/words/prompts", 0.0) for r in steps]
    assert counts == [3.0] * 3  # prompts_per_step
    assert any("reward/source/math" in r for r in steps) and any("reward/source/words" in r for r in steps)


def test_more_sources_join_the_task_labelled_and_routed(tmp_path, monkeypatch):
    """Two datasets with different columns: math rows (answer) and code rows (tests), each
    labelled, drawn half and half, each scored by its own reward (accuracy needs an answer
    column the code rows lack, and the run starts all the same)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    math_rows = [{"prompt": f"{a} + 1 =", "answer": str(a + 1)} for a in range(5)]
    code_rows = [{"prompt": f"def f{a}():", "tests": [f"assert f{a}() == {a}"]} for a in range(3)]
    (tmp_path / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in math_rows))
    (tmp_path / "code.jsonl").write_text("".join(json.dumps(r) + "\n" for r in code_rows))
    s = spec(tmp_path, save_tiny_model(tmp_path / "model"))
    s["data"] = {"name": "file", "train": str(tmp_path / "math.jsonl"), "source_column": "source", "source": "math",
                 "more_sources": [{"name": "file", "train": str(tmp_path / "code.jsonl"), "source": "code"}],
                 "sampler": {"name": "mixture", "weights": {"math": 1, "code": 1}}}
    s["rewards"] = [{"name": "accuracy", "sources": ["math"]},
                    {"name": "code_tests", "sources": ["code"], "workers": 1, "timeout": 5}]
    s["train"]["prompts_per_step"] = 4
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(s))
    assert main([str(path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    shares = {k: v for r in rows for k, v in r.items() if k.startswith("data/source/")}
    assert set(shares) == {"data/source/math/prompts", "data/source/code/prompts"}


def test_per_source_metrics_combine_exactly_over_processes():
    """Process 0 holds a math and a code prompt, process 1 two math prompts (G=2): the code
    share is 1 of 4 prompts, and each source's mean reward is over all its rows, not a mean of
    the processes' means."""
    from grpo_core.train.distributed import combine_metrics

    p0 = {"data/source/math/prompts": 1.0, "data/source/code/prompts": 1.0,
          "reward/source/math": 1.0, "reward/source/math/rows": 2.0,
          "reward/source/code": 0.0, "reward/source/code/rows": 2.0, "reward": 0.5}
    p1 = {"data/source/math/prompts": 2.0, "reward/source/math": 0.25, "reward/source/math/rows": 4.0, "reward": 0.25}
    out = combine_metrics([p0, p1])
    assert out["data/source/math/prompts"] == 3.0 and out["data/source/code/prompts"] == 1.0
    assert out["reward/source/math"] == pytest.approx((1.0 * 2 + 0.25 * 4) / 6)
    assert out["reward/source/code"] == 0.0 and out["reward/source/math/rows"] == 6.0
    assert out["reward"] == pytest.approx(0.375)  # a plain mean is unchanged


@pytest.mark.parametrize(("data", "message"), [
    ({"source": "math"}, "set it"),
    ({"source_column": "source", "more_sources": [{"name": "arithmetic", "source": "b"}]}, "set data.source too"),
    ({"source_column": "source", "source": "a", "more_sources": [{"name": "arithmetic", "source": "a"}]},
     "must differ"),
])
def test_source_labels_say_what_is_missing(tmp_path, data, message):
    s = {"model": {"path": "m"}, "data": {"name": "arithmetic", **data}, "rewards": [{"name": "accuracy"}]}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(s))
    with pytest.raises(Exception, match=message):
        load_spec(path, external_plugins=False)


@pytest.mark.parametrize(("weights", "message"), [
    ({"math": 1e308, "code": 1e308}, r"sum to inf.*\{math: 3, code: 1\}"),
    ({"math": 1e308, "code": 1e-300}, r"'code' \(1e-300\) is drawn with probability 0"),
])
def test_weights_that_float64_cannot_normalize_are_refused_at_validation_with_their_path(tmp_path, weights,
                                                                                          message):
    """Each weight finite and > 0, but their sum overflows (numpy then refused the draw with
    'probabilities do not sum to 1', naming no option), or one share underflows to 0 (a
    source that is never drawn): refused when the spec loads, with the option's path."""
    s = {"model": {"path": "m"}, "rewards": [{"name": "accuracy"}],
         "data": {"name": "arithmetic", "sampler": {"name": "mixture", "column": "source", "weights": weights}}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(s))
    with pytest.raises(Exception, match=r"spec\.data\.sampler\.weights \(line \d+\): .*" + message):
        load_spec(path, external_plugins=False)
    with pytest.raises(ValidationError, match=message):
        MixtureOptions(weights=weights)
