"""The Python door (``grpo_core.Trainer``): the same run as ``grpo-run``, in-memory rewards and
datasets through the registry, callbacks, Ctrl-C, and a notebook's second run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch

from grpo_core import Callback, Trainer
from grpo_core.cli import main
from grpo_core.errors import GrpoError, PluginError, SpecError, UsageError

from .conftest import BASE_SPEC, merge, read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

REWARD_FILE = """
from grpo_core import hookimpl


def digits(prompts, completions, **columns):
    return [float(sum(ch.isdigit() for ch in str(c)) % 3) for c in completions]


@hookimpl
def register_reward_functions(register):
    register.add("digits", digits)
"""


def digits(prompts, completions, **columns):
    """The same reward as REWARD_FILE's, defined here (a notebook's function)."""
    return [float(sum(ch.isdigit() for ch in str(c)) % 3) for c in completions]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _same_run(a: Path, b: Path) -> None:
    """Bit-identical final weights and the same per-step metrics (times aside)."""
    wa, wb = _weights(a / "final"), _weights(b / "final")
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name

    def rows(folder):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/tokens_per_second"))}
                for r in read_metrics(folder / "metrics.jsonl")]

    assert rows(a) == rows(b)


def test_the_trainer_runs_the_spec_exactly_as_grpo_run_does(tmp_path, write_spec):
    spec = write_spec(tmp_path, eval={"at_start": True, "at_end": True}, data={"eval_size": 4})
    assert main([str(spec), "--set", f"train.output_dir={tmp_path / 'cli'}"]) == 0
    result = Trainer(spec, {"train.output_dir": str(tmp_path / "py")}).train()
    _same_run(tmp_path / "cli", tmp_path / "py")
    assert result.status == "finished" and result.step == 4
    assert [r["step"] for r in result.history] == [1, 2, 3, 4]
    assert [e["step"] for e in result.evaluations] == [0, 4]
    assert result.final_model == tmp_path / "py" / "final"
    assert "eval/reward" in result.metrics and "loss" in result.metrics


def test_a_python_reward_trains_as_the_same_reward_from_a_plugin_file(tmp_path, write_spec):
    (tmp_path / "rewards.py").write_text(REWARD_FILE)
    from_file = write_spec(tmp_path, name="file.yaml", plugins=["rewards.py"], rewards=[{"name": "digits"}])
    assert main([str(from_file), "--set", f"train.output_dir={tmp_path / 'file'}"]) == 0
    bare = write_spec(tmp_path, name="bare.yaml", rewards=None)
    result = Trainer(bare, {"train.output_dir": str(tmp_path / "python")}, reward_funcs=[digits]).train()
    assert result.status == "finished"
    _same_run(tmp_path / "file", tmp_path / "python")
    record = json.loads((tmp_path / "python" / "python_objects.json").read_text())
    assert record["reward function"]["digits"]["object"].endswith("test_trainer.digits")


def test_rows_in_memory_train_as_the_same_rows_from_a_file(tmp_path, write_spec):
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from_file = write_spec(tmp_path, name="file.yaml",
                           data={"name": "file", "train": "rows.jsonl", "train_size": None, "eval_size": None})
    assert main([str(from_file), "--set", f"train.output_dir={tmp_path / 'file'}"]) == 0
    import datasets

    result = Trainer(from_file, {"train.output_dir": str(tmp_path / "memory")},
                     train_dataset=datasets.Dataset.from_list(rows)).train()
    assert result.status == "finished"
    _same_run(tmp_path / "file", tmp_path / "memory")


def test_named_eval_sets_from_memory_are_evaluated_and_logged(tmp_path, write_spec):
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(6)]
    spec = write_spec(tmp_path, eval={"at_start": False, "at_end": True})
    result = Trainer(spec, eval_dataset={"doubles": rows}).train()
    assert result.evaluations[-1]["eval/doubles/prompts"] == 6.0


def test_a_callback_sees_every_step_and_can_stop_the_run(tmp_path, write_spec):
    seen, saved = [], []

    class StopAtTwo(Callback):
        def on_step(self, step, metrics):
            seen.append((step, "loss" in metrics))
            return step == 2

        def on_save(self, step, folder):
            saved.append((step, folder.name))

    spec = write_spec(tmp_path, checkpoint={"every": 1})
    result = Trainer(spec, callbacks=[StopAtTwo()]).train()
    assert seen == [(1, True), (2, True)]
    assert result.status == "stopped" and result.step == 2 and result.final_model is not None
    assert [s for s, _ in saved] == [1, 2]
    assert [p.name for p in result.checkpoints][-1] == saved[-1][1]


@pytest.mark.parametrize("how", ["sigint", "keyboardinterrupt"])
def test_ctrl_c_checkpoints_returns_and_grpo_run_resume_finishes_the_same_run(tmp_path, write_spec, how):
    """Ctrl-C in a notebook: SIGINT stops after the step (the first Ctrl-C), a
    KeyboardInterrupt raised mid-run (the second) checkpoints the last completed step; either
    way ``train`` returns, and ``grpo-run --resume`` continues to the uninterrupted weights."""
    spec = write_spec(tmp_path)
    assert main([str(spec), "--set", f"train.output_dir={tmp_path / 'whole'}"]) == 0

    def interrupt(step, metrics):
        if step == 2:
            if how == "sigint":
                os.kill(os.getpid(), signal.SIGINT)
            else:
                raise KeyboardInterrupt

    result = Trainer(spec, {"train.output_dir": str(tmp_path / "cut")}, callbacks=interrupt).train()
    assert result.status == "interrupted" and result.step == 2 and result.final_model is None
    assert [p.name for p in result.checkpoints] == ["step-000002"]
    assert main([str(spec), "--set", f"train.output_dir={tmp_path / 'cut'}", "--resume"]) == 0
    whole, cut = _weights(tmp_path / "whole" / "final"), _weights(tmp_path / "cut" / "final")
    for name in whole:
        assert torch.equal(whole[name], cut[name]), name


def test_two_runs_in_one_process_leave_no_thread_or_process_group_behind(tmp_path, write_spec):
    spec = write_spec(tmp_path, rollout={"max_staleness": 1}, train={"steps": 2})
    threads = threading.active_count()
    trainer = Trainer(spec)
    first = trainer.train()
    with pytest.raises(UsageError, match="holds another run"):
        trainer.train()
    second = trainer.train(overwrite=True)
    assert first.status == second.status == "finished"
    assert threading.active_count() == threads
    assert not torch.distributed.is_initialized()


def test_evaluate_and_save(tmp_path, write_spec):
    spec = write_spec(tmp_path, data={"eval_size": 4}, train={"steps": 1})
    trainer = Trainer(spec)
    before = trainer.evaluate()
    assert before["eval/prompts"] == 4.0
    trainer.train()
    folder = trainer.save(tmp_path / "saved")
    assert (folder / "config.json").is_file() and _weights(folder).keys() == _weights(tmp_path / "out" / "final").keys()


# ----------------------------------------------------------------------------- errors
def test_a_bad_reward_is_refused_by_name(tmp_path, write_spec):
    """Objects go through the plugins' validation: a reward that is not callable is refused
    naming it, an unknown name lists what is registered, a lambda needs a name."""
    with pytest.raises(PluginError, match=r"reward function 'broken' \(plugin 'grpo_core.Trainer'\) does not follow"):
        Trainer(write_spec(tmp_path), reward_funcs=[("broken", 42)]).train()
    with pytest.raises(SpecError, match="unknown reward function 'acuracy'.*did you mean 'accuracy'"):
        Trainer(write_spec(tmp_path, rewards=None), reward_funcs=["acuracy"])
    with pytest.raises(UsageError, match="no usable name"):
        Trainer(write_spec(tmp_path), reward_funcs=[lambda prompts, completions, **kw: [0.0] * len(completions)])


def test_sys_exit_in_a_reward_is_an_error_not_the_end_of_the_notebook(tmp_path, write_spec):
    def exits(prompts, completions, **columns):
        raise SystemExit(3)

    with pytest.raises((PluginError, GrpoError), match="sys.exit"):
        Trainer(write_spec(tmp_path), reward_funcs=[exits], overrides=["train.reward_errors=raise"]).train()


def test_bad_data_names_the_argument(tmp_path, write_spec):
    with pytest.raises(UsageError, match="train_dataset: row 1 is a str"):
        Trainer(write_spec(tmp_path), train_dataset=[{"prompt": "1+1="}, "2+2="])
    with pytest.raises(SpecError, match="unknown key"):
        Trainer(write_spec(tmp_path), {"train.nope": 1})


def test_grpo_run_resume_of_a_python_run_says_what_it_needs(tmp_path, write_spec, capsys):
    spec = write_spec(tmp_path, rewards=None, train={"steps": 1}, checkpoint={"every": 1})
    Trainer(spec, reward_funcs=[digits], train_dataset=[{"prompt": "1+1=", "answer": "2"}] * 4).train()
    resolved = tmp_path / "out" / "spec.resolved.yaml"
    assert main([str(resolved), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "reward function 'digits'" in err and "test_trainer.digits" in err
    assert "dataset 'python' (4 rows in memory" in err and "train(resume='latest')" in err


def test_a_run_from_a_mapping_names_its_resolved_spec_as_the_resume_command(tmp_path, tiny_model_dir):
    spec = merge({"model": {"path": str(tiny_model_dir)}, **BASE_SPEC}, {"train": {"output_dir": str(tmp_path / "o")}})
    trainer = Trainer(spec)
    assert trainer.loaded.command("--resume") == f"grpo-run {tmp_path / 'o' / 'spec.resolved.yaml'} --resume"
    trainer.train()
    assert main([str(tmp_path / "o" / "spec.resolved.yaml"), "--set", "train.steps=5", "--resume"]) == 0
    assert max(r["step"] for r in read_metrics(tmp_path / "o" / "metrics.jsonl")) == 5


def test_the_readmes_python_example_runs(tmp_path, write_spec, monkeypatch, capsys):
    """The README's Python block, run as written but for the spec (the tiny model for the
    quickstart's SmolLM2, a short run): every name and argument it uses exists and works."""
    import re

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## From Python"):]
    (code,) = re.findall(r"```python\n(.*?)```", section[: section.index("\n## ", 3)], re.S)
    spec = write_spec(tmp_path, train={"steps": 1}, eval={"at_start": False, "at_end": False})
    assert '"specs/quickstart.yaml"' in code and '{"train.steps": 20}' in code
    code = code.replace('"specs/quickstart.yaml"', repr(str(spec))).replace('{"train.steps": 20}', "{}")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.startswith("finished ")


class Echo:
    """A two-turn environment: it answers the model's first turn with a user message, and its
    reward is whether that turn held a digit."""

    tools: list = []
    stop = ()

    def reset(self, row):
        return {"turn": 0}

    def step(self, state, text):
        from grpo_core.contracts import Observation

        state["turn"] += 1
        if state["turn"] == 1:
            return Observation([{"role": "user", "content": "again"}], reward=float(any(c.isdigit() for c in text)))
        return Observation(done=True)


def test_an_environment_object_runs_multi_turn_episodes(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 1024  # room for the second turn's chat template
    (model / "config.json").write_text(json.dumps(config))
    spec = merge({"model": {"path": str(model)}, **BASE_SPEC},
                 {"rollout": {"environment": {"max_turns": 2, "max_total_tokens": 24}}, "train": {"steps": 2}})
    result = Trainer(spec, {"train.output_dir": str(tmp_path / "o")}, environment=Echo()).train()
    assert result.status == "finished"
    assert all(row["env/turns_per_episode"] >= 1 for row in result.history)
    record = json.loads((tmp_path / "o" / "python_objects.json").read_text())
    assert record["environment"]["Echo"]["object"].endswith("test_trainer.Echo")
