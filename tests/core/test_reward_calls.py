"""How reward functions are called (grpo_core.train.actor.scoring): async functions awaited
together, synchronous ones in threads with `concurrency`, `call_timeout`, infinite scores
and batches nobody could score; and, end to end, an infinite score stopping a run with the
last completed step checkpointed."""

from __future__ import annotations

import asyncio
import logging
import math
import threading

import pytest
import torch

from grpo_core import checkpoint as ckpt
from grpo_core.cli import main
from grpo_core.errors import RunError, SpecError
from grpo_core.train.actor.scoring import RewardFn, score

PROMPTS = [f"p{i}" for i in range(6)]
COMPLETIONS = [f"c{i}" for i in range(6)]


def _score(fns, on_error="raise", completions=COMPLETIONS):
    ids = [[1] for _ in completions]
    return score(fns, PROMPTS[: len(completions)], list(completions), {}, ids, on_error)


def by_index(completions, **kw):
    return [float(c[1:]) for c in completions]


# --------------------------------------------------------------------------- async
def test_async_functions_are_awaited_together():
    """Each function waits for the other's signal: they finish only if run concurrently."""
    state = {}

    async def one(completions, **kw):
        state.setdefault("a", asyncio.Event()).set()
        await asyncio.wait_for(state.setdefault("b", asyncio.Event()).wait(), 5)
        return [1.0] * len(completions)

    async def two(completions, **kw):
        state.setdefault("b", asyncio.Event()).set()
        await asyncio.wait_for(state.setdefault("a", asyncio.Event()).wait(), 5)
        return [2.0] * len(completions)

    out = _score([RewardFn.of("one", 1.0, one), RewardFn.of("two", 0.5, two), RewardFn.of("idx", 1.0, by_index)])
    assert out.per_function[:, 0].tolist() == [1.0] * 6
    assert out.per_function[:, 1].tolist() == [2.0] * 6
    assert out.total.tolist() == [2.0 + i for i in range(6)]


def test_async_callable_object_with_concurrency_chunks_the_batch():
    seen = []

    class Judge:
        async def __call__(self, prompts, completions, **kw):
            seen.append(list(completions))
            await asyncio.sleep(0)
            return [float(c[1:]) * 10 for c in completions]

    fn = RewardFn.of("judge", 1.0, Judge(), concurrency=3)
    assert fn.is_async
    out = _score([fn])
    assert out.total.tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    assert sorted(map(tuple, seen)) == [("c0", "c1"), ("c2", "c3"), ("c4", "c5")]


def test_async_timeout_cancels_the_call_and_scores_none():
    cancelled = threading.Event()

    async def slow(completions, **kw):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return [1.0] * len(completions)

    fns = [RewardFn.of("slow", 1.0, slow, timeout=0.2), RewardFn.of("idx", 1.0, by_index)]
    out = _score(fns, on_error="none")
    assert torch.isnan(out.per_function[:, 0]).all() and out.failed == 6
    assert out.total.tolist() == [float(i) for i in range(6)]  # the other function still counts
    assert cancelled.wait(5)
    with pytest.raises(RunError, match=r"reward function 'slow' did not return within its call_timeout of 0.2 s"):
        _score(fns)


# --------------------------------------------------------------------------- threads
def test_sync_concurrency_runs_chunks_in_parallel_threads():
    barrier = threading.Barrier(2, timeout=5)  # breaks (raises) unless two chunks wait at once
    names = set()

    def blocking(completions, **kw):
        names.add(threading.current_thread().name)
        barrier.wait()
        return [float(c[1:]) for c in completions]

    out = _score([RewardFn.of("blocking", 1.0, blocking, concurrency=2)])
    assert out.total.tolist() == [float(i) for i in range(6)] and out.failed == 0
    assert names == {"reward-blocking-0", "reward-blocking-1"}


def test_hung_sync_function_is_abandoned_after_its_timeout():
    release = threading.Event()

    def hung(completions, **kw):
        release.wait(30)
        return [5.0] * len(completions)

    try:
        fns = [RewardFn.of("hung", 1.0, hung, timeout=0.2), RewardFn.of("idx", 2.0, by_index)]
        out = _score(fns, on_error="none")
        assert torch.isnan(out.per_function[:, 0]).all() and out.failed == 6
        assert out.total.tolist() == [2.0 * i for i in range(6)]
        message = "'hung' did not return within its call_timeout of 0.2 s .*reward_errors: none"
        with pytest.raises(RunError, match=message):
            _score(fns)
    finally:
        release.set()


def test_error_in_a_thread_names_the_completion_as_on_the_main_thread():
    def picky(completions, **kw):
        if "c4" in completions:
            raise ValueError("bad row")
        return [1.0] * len(completions)

    fn = RewardFn.of("picky", 1.0, picky, concurrency=2)
    with pytest.raises(RunError, match="'picky' raised ValueError: bad row on completion 1 .*prompt: 'p4'"):
        _score([fn])  # completion 1 of the chunk c3..c5 (prompt p4)
    out = _score([fn], on_error="none")
    assert out.failed == 1 and torch.isnan(out.total).tolist() == [False] * 4 + [True, False]


def test_run_error_fails_the_whole_batch_without_per_row_retries():
    calls = []

    def down(completions, **kw):
        calls.append(len(completions))
        raise RunError("reward function 'down': server unreachable")

    with pytest.raises(RunError, match="^reward function 'down': server unreachable$"):
        _score([RewardFn.of("down", 1.0, down)])
    assert calls == [6]
    out = _score([RewardFn.of("down", 1.0, down), RewardFn.of("idx", 1.0, by_index)], on_error="none")
    assert out.failed == 6 and calls == [6, 6]


# --------------------------------------------------------------------------- infinite / unscorable
@pytest.mark.parametrize("bad", [math.inf, -math.inf])
def test_infinite_score_names_the_function_and_completion(bad):
    def blowup(completions, **kw):
        return [bad if c == "c3" else 1.0 for c in completions]

    with pytest.raises(RunError, match=rf"reward function 'blowup' returned {bad} for completion 3 \(prompt: 'p3'\)"):
        _score([RewardFn.of("blowup", 1.0, blowup)])
    out = _score([RewardFn.of("blowup", 1.0, blowup)], on_error="none")
    assert out.failed == 1 and math.isnan(out.total[3]) and torch.isfinite(out.total[[0, 1, 2, 4, 5]]).all()


def test_a_batch_nobody_can_score_is_a_warning_naming_the_functions(caplog):
    def nothing(completions, **kw):
        return [None] * len(completions)

    with caplog.at_level(logging.WARNING, logger="grpo.scoring"):
        out = _score([RewardFn.of("nothing", 1.0, nothing), RewardFn.of("neither", 1.0, nothing)])
    assert torch.isnan(out.total).all()
    assert "no completion of this batch of 6 could be scored: reward function(s) 'nothing', 'neither'" in caplog.text


# --------------------------------------------------------------------------- spec
def test_reward_slot_call_options_are_validated(tmp_path):
    from grpo_core.spec import load_spec

    path = tmp_path / "spec.yaml"
    path.write_text(
        "model: {path: m}\nrewards:\n  - {name: accuracy, timeout: 3, concurrency: 4, call_timeout: 2.5}\n"
        "  - {name: format, concurrency: 0, call_timeout: -1}\n"
    )
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    text = str(info.value)
    assert "rewards.1.concurrency" in text and "rewards.1.call_timeout" in text and "rewards.0" not in text
    path.write_text("model: {path: m}\nrewards:\n  - {name: accuracy, timeout: 3, concurrency: 4, call_timeout: 2.5}\n")
    slot = load_spec(str(path)).spec.rewards[0]
    assert (slot.concurrency, slot.call_timeout, slot.options.timeout) == (4, 2.5, 3)


# --------------------------------------------------------------------------- end to end
INFINITE = '''
from grpo_core import hookimpl

def blowup(prompts, completions, **kwargs):
    """1.0 everywhere, but inf on the poisoned prompt."""
    return [float("inf") if "Poisoned" in p else 1.0 for p in prompts]

@hookimpl
def register_reward_functions(register):
    register.add("blowup", blowup)
'''


def test_infinite_reward_stops_the_run_with_the_last_step_checkpointed(tmp_path, write_spec, kit, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "blowup.py").write_text(INFINITE)
    rows = [{"prompt": f"What is {i} + {i}?"} for i in range(8)]
    rows[5] = {"prompt": "Poisoned question: what is 1 + 1?"}  # step 3 takes rows 4 and 5
    (tmp_path / "rows.jsonl").write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    spec = write_spec(
        tmp_path, plugins=["blowup.py"], rewards=[{"name": "blowup"}],
        data={"name": "file", "train": "rows.jsonl", "shuffle": False, "train_size": None, "eval_size": None},
    )
    assert main([str(spec)]) == 1
    err = capsys.readouterr().err
    assert "reward function 'blowup' returned inf for completion 4 (prompt: 'Poisoned question" in err
    assert "Traceback" not in err and "step 3 failed before its update; checkpoint of step 2" in err
    folders = ckpt.list_checkpoints(tmp_path / "out" / "checkpoints")
    assert [f.name for f in folders] == ["step-000002"] and ckpt.verify(folders[-1]) is None
    assert [r["step"] for r in kit.read_metrics(tmp_path / "out" / "metrics.jsonl")] == [1, 2]
