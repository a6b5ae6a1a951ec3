"""The rest of the ecosystem fit: models from the Hugging Face cache by Hub id (policy and
reward model, HF_HUB_OFFLINE=1), ``data.chat_template_kwargs``, the GSM8K example spec
validated without the network, ``grpo-run init`` / ``runs`` / ``--dry-run``, and several
trackers at once with one of them failing."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import shutil
import socket
import textwrap
from pathlib import Path

import pytest

from grpo_core.cli import main
from grpo_core.spec.data import DataSlot
from grpo_core.testing import build_tokenizer, save_tiny_model
from grpo_core.train.actor.data import PromptSource

SPECS = Path(__file__).resolve().parents[2] / "specs"


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def put_in_hub_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """``folder`` laid out as the Hub cache holds a downloaded model repository:
    ``models--org--name/refs/main`` naming a commit, ``snapshots/<commit>/`` its files."""
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit, encoding="utf-8")
    return repo


def _table_rows(text: str, first_header: str) -> list[dict[str, str]]:
    """The rows of every plain table in ``text`` whose header starts with ``first_header``."""
    rows, header, lines = [], None, text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(first_header + " ") and i + 1 < len(lines) and lines[i + 1].startswith("-"):
            header = line.split()
            continue
        if header and line.strip() and not line.startswith("-"):
            if line.startswith(("prompt ", "summary")):
                header = None
                continue
            rows.append(dict(zip(header, line.split(maxsplit=len(header) - 1))))
        elif not line.strip():
            header = None
    return rows


# --------------------------------------------------------------------------- Hub cache
@pytest.mark.slow
def test_policy_and_reward_model_load_by_hub_id_from_the_hf_cache_offline(tmp_path, write_spec, child, tiny_model_dir):
    cache = tmp_path / "hf-home" / "hub"
    put_in_hub_cache(cache, "grpo-test/tiny-policy", tiny_model_dir)
    put_in_hub_cache(cache, "grpo-test/tiny-rm", save_tiny_model(tmp_path / "rm", kind="sequence-classification"))
    spec = write_spec(
        tmp_path / "spec", model={"path": "grpo-test/tiny-policy"},
        rewards=[{"name": "reward_model", "path": "grpo-test/tiny-rm"}, {"name": "accuracy"}],
    )
    env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = child(["run", spec, "--dry-run"], cwd=tmp_path, env=env)
    assert proc.wait(180) == 0, proc.output()
    rows = _table_rows(proc.output(), "#")
    assert len(rows) == 2 * 4  # prompts_per_step x group_size
    for row in rows:
        assert float(row["reward"]) == pytest.approx(float(row["reward_model"]) + float(row["accuracy"]), abs=2e-3)
    assert len({row["reward_model"] for row in rows}) > 1  # real scores, not one constant


# --------------------------------------------------------------------------- chat template kwargs
THINKING_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_apply_chat_template():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}]}]

    def render(**data) -> str:
        slot = DataSlot.model_validate({"name": "file", **data})
        return PromptSource(rows, tokenizer, slot, seed=0, max_tokens=512).next(1)[0].text

    assert render().endswith("<|assistant|>")
    assert render(chat_template_kwargs={"enable_thinking": False}).endswith("<|assistant|><think></think>")
    assert render(chat_template_kwargs={"enable_thinking": True}).endswith("<|assistant|>")


def test_as_user_message_puts_string_prompts_through_the_chat_template():
    tokenizer = build_tokenizer()
    rows = [{"question": "What is 2 + 3?"}]
    slot = DataSlot.model_validate({"name": "file", "prompt_column": "question", "as_user_message": True,
                                    "system_prompt": "Be brief."})
    prompt = PromptSource(rows, tokenizer, slot, seed=0, max_tokens=512).next(1)[0]
    assert prompt.text == "<|system|>Be brief.<|end|>\n<|user|>What is 2 + 3?<|end|>\n<|assistant|>"
    assert prompt.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    plain = DataSlot.model_validate({"name": "file", "prompt_column": "question"})
    assert PromptSource(rows, tokenizer, plain, seed=0, max_tokens=512).next(1)[0].text == "What is 2 + 3?"


# --------------------------------------------------------------------------- GSM8K example
@pytest.fixture
def no_network(monkeypatch):
    """Every attempt to open a connection or resolve a name is recorded and refused."""
    attempts: list[str] = []

    def refuse(what):
        def blocked(*args, **kwargs):
            attempts.append(f"{what}{args[1:2] if what == 'connect' else args[:1]}")
            raise OSError(f"network disabled in this test ({what})")
        return blocked

    monkeypatch.setattr(socket.socket, "connect", refuse("connect"))
    monkeypatch.setattr(socket, "create_connection", refuse("create_connection"))
    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    return attempts


def test_gsm8k_example_spec_validates_without_touching_the_network(no_network):
    import yaml

    code, out, err = cli("validate", SPECS / "gsm8k-qwen.yaml")
    assert (code, err) == (0, "")
    assert no_network == []
    resolved = yaml.safe_load(out)
    assert resolved["model"]["path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    expected = {"name": "hf", "path": "openai/gsm8k", "config": "main", "eval_split": "test",
                "prompt_column": "question", "as_user_message": True}
    assert expected.items() <= resolved["data"].items()
    assert resolved["export"]["merged"] is True and resolved["tracking"][0]["log_model"] is True


# --------------------------------------------------------------------------- init
@pytest.mark.parametrize("task", ["math", "tools", "custom"])
def test_init_writes_a_starter_spec_that_validates(task, tmp_path, no_network):
    spec = tmp_path / f"{task}.yaml"
    code, out, _ = cli("init", "--task", task, spec)
    assert code == 0 and f"grpo-run validate {spec}" in out
    text = spec.read_text(encoding="utf-8")
    assert text.startswith("# ") and text.count("#") > 10  # commented
    code, _, err = cli("validate", spec)
    assert (code, err) == (0, "")
    assert no_network == []
    code, _, err = cli("init", "--task", task, spec)
    assert code == 2 and "already exist" in err and "--force" in err


def test_init_custom_starter_dry_runs_with_its_own_reward(tmp_path, tiny_model_dir, capsys):
    spec = tmp_path / "mine.yaml"
    assert cli("init", "--task", "custom", spec)[0] == 0
    code = main([str(spec), "--dry-run", "--set", f"model.path={tiny_model_dir}", "--set", "rollout.group_size=2",
                 "--set", "rollout.max_new_tokens=4", "--set", "train.prompts_per_step=1",
                 "--set", f"train.output_dir={tmp_path / 'out'}"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = _table_rows(out, "#")
    assert len(rows) == 2 and all(0.0 <= float(r["my_reward"]) <= 1.0 for r in rows)


# --------------------------------------------------------------------------- dry run
def test_dry_run_prints_completions_with_their_rewards_and_trains_nothing(tmp_path, write_spec, capsys, kit):
    spec = write_spec(tmp_path, train={"output_dir": str(tmp_path / "out")})
    code = main([str(spec), "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    assert "\x1b[" not in out  # no colour codes when stdout is not a terminal
    rows = _table_rows(out, "#")
    assert len(rows) == 2 * 4 and [r["#"] for r in rows] == ["0", "1", "2", "3"] * 2
    for row in rows:  # the total is the weighted sum the spec asks for (format has weight 0.5)
        assert float(row["reward"]) == pytest.approx(float(row["accuracy"]) + 0.5 * float(row["format"]), abs=2e-3)
    assert "summary (nothing was trained)" in out and "groups with equal rewards" in out
    produced = {p.name for p in (tmp_path / "out").iterdir()} if (tmp_path / "out").exists() else set()
    assert not produced & {"final", "checkpoints", "spec.resolved.yaml"}
    assert kit.read_metrics(tmp_path / "out" / "metrics.jsonl") == []


def test_dry_run_refuses_resume_and_nproc(tmp_path, write_spec):
    spec = write_spec(tmp_path)
    code, _, err = cli(spec, "--dry-run", "--resume")
    assert code == 2 and "--dry-run runs one process from scratch" in err


# --------------------------------------------------------------------------- terminal tables
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_tables_use_rich_on_a_terminal_and_plain_text_elsewhere(monkeypatch):
    from grpo_core.textout import print_table

    monkeypatch.delenv("NO_COLOR", raising=False)
    rows = [["eval/reward", "0.2500"], ["eval/rewards/accuracy", "0.5000"]]
    plain = io.StringIO()
    print_table(["metric", "value"], rows, stream=plain)
    assert plain.getvalue().splitlines() == [
        "metric                 value", "---------------------  ------",
        "eval/reward            0.2500", "eval/rewards/accuracy  0.5000"]
    tty = _Terminal()
    print_table(["metric", "value"], rows, stream=tty)
    assert "│" in tty.getvalue() and "0.5000" in tty.getvalue()  # drawn by rich
    monkeypatch.setenv("NO_COLOR", "1")
    again = _Terminal()
    print_table(["metric", "value"], rows, stream=again)
    assert again.getvalue() == plain.getvalue()


# --------------------------------------------------------------------------- trackers together
TRACKERS_PLUGIN = '''
import json
from grpo_core import hookimpl


class Broken:
    def __init__(self, options=None):
        pass
    def start(self, run_name, resume_id=None):
        return None
    def log_params(self, params):
        pass
    def log_metrics(self, metrics, step):
        raise ConnectionError("backend down")
    def log_artifact(self, path):
        pass
    def log_table(self, name, rows, step):
        pass
    def finish(self, status):
        pass


class Recorder:
    def __init__(self, options=None):
        self.path = "recorded.jsonl"
    def _write(self, row):
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row) + "\\n")
    def start(self, run_name, resume_id=None):
        self._write({"event": "start"})
    def log_params(self, params):
        pass
    def log_metrics(self, metrics, step):
        self._write({"event": "metrics", "step": step})
    def log_artifact(self, path):
        pass
    def log_table(self, name, rows, step):
        pass
    def finish(self, status):
        self._write({"event": "finish", "status": status})


@hookimpl
def register_trackers(register):
    register.add("broken", Broken())  # a component without options is used as registered
    register.add("recorder", Recorder())
'''


def test_one_failing_tracker_leaves_the_others_and_the_run_whole(tmp_path, write_spec, caplog, monkeypatch, kit):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tmp_path / "trackers.py").write_text(textwrap.dedent(TRACKERS_PLUGIN), encoding="utf-8")
    spec = write_spec(tmp_path, plugins=["trackers.py"], run_name="together",
                      tracking=[{"name": "broken"}, {"name": "tensorboard", "log_dir": "tb"}, {"name": "recorder"}])
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="grpo.tracking"):
        code = main([str(spec)])
    assert code == 0
    failures = [r.getMessage() for r in caplog.records if "tracker 'broken' failed" in r.getMessage()]
    assert failures == ["tracker 'broken' failed in log_metrics: ConnectionError: backend down"]  # once
    recorded = [json.loads(line) for line in (tmp_path / "recorded.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recorded if r["event"] == "metrics"] == [1, 2, 3, 4]
    assert recorded[-1] == {"event": "finish", "status": "FINISHED"}
    acc = EventAccumulator(str(tmp_path / "tb" / "together"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward")] == [1, 2, 3, 4]
    assert [r["step"] for r in kit.read_metrics(tmp_path / "out" / "metrics.jsonl")] == [1, 2, 3, 4]

    # grpo-run runs lists it, with a hand-made stopped run beside it.
    stopped = tmp_path / "stopped"
    (stopped / "checkpoints" / "step-000002").mkdir(parents=True)
    (stopped / "spec.resolved.yaml").write_text("train:\n  steps: 10\n", encoding="utf-8")
    (stopped / "metrics.jsonl").write_text('{"step": 0, "eval/reward": 0.25}\n{"step": 2, "reward": 1}\n{"step"',
                                           encoding="utf-8")
    code, out, _ = cli("runs", tmp_path)
    assert code == 0
    listed = {r["run"]: r for r in _table_rows(out, "run")}
    assert listed["out"]["status"] == "finished" and listed["out"]["step"] == "4/4"
    assert listed["stopped"]["status"] == "stopped" and listed["stopped"]["step"] == "2/10"
    assert listed["stopped"]["held-out"] == "0.2500" and listed["out"]["held-out"] == "-"
