"""Every script of ``bench/`` runs at its tiniest settings, so that a benchmark a user is
pointed to cannot rot: a tiny random model (``--tiny`` where a script loads SmolLM2), one step,
a repetition, a few tokens. Timings are printed by the scripts and never asserted here.

Scripts run in this process (``runpy``, as ``python bench/X.py`` runs them: torch and
transformers are imported once for all of them); those that start processes of their own start
them as they always do. A script that needs TRL, vLLM or a GPU is only asked for its ``--help``,
which imports it and parses its arguments (:data:`HELP_ONLY` says why for each); ``bench/gpu``'s
check runs in its CPU mode in ``test_gpu_check.py``.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
#: Stands for the tiny model's folder, the scratch folder and the spec in the argument lists.
MODEL, SCRATCH, SPEC = "{model}", "{scratch}", "{spec}"

#: script -> its arguments at its tiniest settings (run to the end, exit code 0).
RUNS: dict[str, list[str]] = {
    "agents.py": ["--prompts", "1", "--group", "2", "--repeats", "1", "--client", "urllib"],
    "code_tests.py": ["--completions", "2", "--workers", "1", "--repeats", "1", "--timeout", "2"],
    "ddp_overlap.py": ["--tiny", "--prompts", "1", "--group", "2", "--repeats", "1", "--port", "29581"],
    "distillation.py": ["--tiny", "--steps", "1", "--prompts", "1", "--group", "2", "--tokens", "4", "--threads", "1",
                        "--configs", "opd-fp32", "--out", SCRATCH],
    "floor.py": ["--tiny", "--model-dir", SCRATCH, "--precision", "bf16", "--prompts", "1", "--group", "2",
                 "--tokens", "4", "--reps", "1", "--threads", "1"],
    "memory.py": ["--tiny", "--model-dir", SCRATCH, "--steps", "1", "--precision", "fp32", "--trim"],
    "memory_model.py": ["--tokens", "1024"],
    "optimizer.py": ["--params", "4096", "--reps", "1"],
    "packing.py": ["--tiny", "--model-dir", SCRATCH, "--reps", "1", "--shapes", "long-tail", "--limit", "8"],
    "plot_curves.py": [SCRATCH, "--out", f"{SCRATCH}/curves.png"],
    "push_memory.py": ["--tiny", "--nproc", "1", "--train", "--out", f"{SCRATCH}/push.json"],
    "qlora.py": ["--one", MODEL, "nf4", "--repeats", "1"],
    "ref_dtype.py": ["--tiny", "--model-dir", SCRATCH, "--prompts", "1", "--group", "2", "--tokens", "4",
                     "--reps", "1"],
    "sequence_parallel.py": ["--tiny"],
    "run_spec.py": [SPEC, "--steps", "1", "--set", f"model.path={MODEL}", "--set", "train.threads=1",
                    "--set", "rollout.max_new_tokens=4", "--set", f"train.output_dir={SCRATCH}/run"],
    "sharded_checkpoint.py": ["--tiny"],
    "tinker_serve.py": ["--mode", "all", "--tiny", "--steps", "1", "--rows", "1", "--tokens", "4", "--groups", "1",
                        "--group-size", "2", "--max-tokens", "2", "--rank", "2"],
    "vllm_vs_hf.py": ["--backend", "hf", "--model", MODEL, "--prompts", "1", "--group-size", "2",
                      "--max-new-tokens", "4", "--repeats", "1", "--threads", "1"],
}
#: script -> why it is only asked for its --help here.
HELP_ONLY: dict[str, str] = {
    "async_vs_sync.py": "starts two grpo-run processes per seed (minutes); tests/core/test_async.py runs the loop",
    "long_vs_trl.py": "trains against TRL's GRPOTrainer (TRL is the bench extra, not a test dependency)",
    "overlap.py": "drives a vLLM rollout server (vLLM's venv)",
    "parallel_memory.py": "starts torchrun with SmolLM2-135M (tests/core/test_fsdp2.py runs the strategies)",
    "push_soak.py": "pushes to a vLLM rollout server (vLLM's venv)",
    "server_soak.py": "trains against one vLLM rollout server for hundreds of steps (vLLM's venv)",
    "vllm_check.py": "needs vLLM (tests/vllm runs the backend)",
    "vs_trl.py": "runs TRL's GRPOTrainer beside grpo-core (TRL is the bench extra, not a test dependency)",
}


def test_every_script_is_run_or_asked_for_its_help():
    scripts = sorted(p.name for p in BENCH.glob("*.py"))
    assert sorted([*RUNS, *HELP_ONLY]) == scripts
    assert not set(RUNS) & set(HELP_ONLY)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from grpo_core.testing import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("bench-model") / "model")


@pytest.fixture
def isolated(monkeypatch):
    """The process as a fresh ``python bench/X.py`` would leave it: the environment, torch's
    thread count and ``sys.path`` restored after the script."""
    import torch

    threads, environ = torch.get_num_threads(), dict(os.environ)
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")  # packing.py re-executes itself without it
    yield
    torch.set_num_threads(threads)
    os.environ.clear()
    os.environ.update(environ)


def run_script(name: str, argv: list[str], monkeypatch) -> int:
    """``python bench/<name> argv`` in this process: its exit code."""
    path = BENCH / name
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    return 0


def _learning_curves(folder: Path) -> None:
    """What long_vs_trl.py writes: one metrics.jsonl per tool and seed."""
    for tool in ("grpo-core", "trl"):
        for seed in (0, 1):
            rows = [{"tool": tool, "seed": seed, "step": s, "reward": 0.1 * s + seed, "eval/accuracy": 0.2,
                     "completions/mean_length": 10.0, "completions/clipped_ratio": 0.0} for s in (1, 2, 3)]
            run = folder / f"{tool}-seed{seed}"
            run.mkdir(parents=True)
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_script_runs_at_its_tiniest(name, tiny_model_dir, tmp_path, isolated, monkeypatch, capfd):
    if name == "plot_curves.py":
        _learning_curves(tmp_path)
    if name == "qlora.py":  # the script's own model writer, at its tiny shape; the 4-bit setting measured
        runpy.run_path(str(BENCH / name))["write_model"](tmp_path / "qlora-model", tiny=True)
        tiny_model_dir = tmp_path / "qlora-model"
    values = {MODEL: str(tiny_model_dir), SCRATCH: str(tmp_path), SPEC: str(ROOT / "specs" / "tiny.yaml")}
    argv = [arg.replace(MODEL, values[MODEL]).replace(SCRATCH, values[SCRATCH]).replace(SPEC, values[SPEC])
            for arg in RUNS[name]]
    code = run_script(name, argv, monkeypatch)
    out = capfd.readouterr()  # at the descriptors: what the processes a script starts print too
    assert code == 0, (out.out + out.err)[-4000:]
    assert out.out.strip(), "the script printed no result"
    if name == "plot_curves.py":
        assert (tmp_path / "curves.png").stat().st_size > 0


@pytest.mark.parametrize("name", sorted(HELP_ONLY))
def test_the_script_imports_and_parses_its_arguments(name, isolated, monkeypatch, capsys):
    assert run_script(name, ["--help"], monkeypatch) == 0
    assert "usage:" in capsys.readouterr().out


def test_the_server_soaks_added_load_runs_from_its_step_to_the_runs_end(tmp_path):
    """``server_soak.py --load RUN:STEP:PROCS`` (the rest of the script needs vLLM): the load is
    PROCS busy processes, started once the run has logged STEP steps and all gone at its end;
    a malformed value is refused naming the form."""
    soak = runpy.run_path(str(BENCH / "server_soak.py"))
    assert soak["parse_load"]("1:10:2") == (1, 10, 2) and soak["parse_load"](None) is None
    with pytest.raises(SystemExit, match="expected RUN:STEP:PROCS"):
        soak["parse_load"]("1:ten:2")
    metrics = tmp_path / "metrics.jsonl"
    assert soak["_steps_done"](metrics) == 0  # no file yet
    metrics.write_text('{"step": 0, "loss": 0.1}\n{"step": 0, "eval/reward": 0.5}\n{"step": 1, "loss": 0.2}\n')
    assert soak["_steps_done"](metrics) == 2  # training rows only
    load = soak["Load"](2, None)
    load.start(3.0)
    try:
        assert len(load.children) == 2 and all(child.poll() is None for child in load.children)
        children = list(load.children)
    finally:
        load.stop(7.5)
    assert all(child.poll() is not None for child in children) and load.children == []
    assert load.window == [3.0, 7.5]
