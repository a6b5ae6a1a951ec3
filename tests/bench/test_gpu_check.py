"""``bench/gpu/run.py``, the GPU check, in its CPU mode on tiny models: every part runs (with the
packages the GPU machine lacks made unimportable for the engine's parts) and its JSON holds the
correctness results; the dry run lists what a GPU run would send within its 64 MiB; a part over
its time limit is killed and the parts after it run in a fresh process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "run.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
PARTS = ["correctness", "nccl", "fsdp2", "sequence", "throughput", "onegpu", "routing", "checkpoint", "trl"]


def _check(args: list, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_the_gpu_check_runs_in_its_cpu_mode(tmp_path):
    # The budget is the GPU lease's; on a loaded CPU the tiny parts take longer than a GPU's real ones.
    # Every part but onegpu, which the next test runs alone (the test run's time).
    parts = [p for p in PARTS if p != "onegpu"]
    done = _check(["--out", tmp_path / "out", "--work", tmp_path / "work", "--device", "cpu", "--tiny",
                   "--simulate-missing", "--budget-s", "3600", "--parts", ",".join(parts)], timeout=1800)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(result["parts"]) == parts and result["status"] == "ok"
    env = result["environment"]
    assert env["device"] == "cpu" and {"mlflow", "datasets", "math_verify"} <= set(env["blocked_modules"])

    checks = {part: record.get("checks", {}) for part, record in result["parts"].items()}
    fp32 = [c for name, c in checks["correctness"].items() if name.startswith("gradient")]
    bf16 = [c for name, c in checks["correctness"].items() if name.startswith("bf16_autocast")]
    assert fp32 and bf16 and all(c["status"] == "ok" for c in fp32 + bf16)
    for c in fp32:  # the engine's float32 update is the float64 textbook gradient
        assert c["rel_error_token-mean"] < 1e-4 and c["rel_error_seq-mean-token-mean"] < 1e-4
    for c in bf16:  # bf16 autocast moved it, within bf16 rounding
        assert 1e-6 < c["rel_error_vs_fp32_token-mean"] and c["rel_error_token-mean"] < 3e-2
    sampler = checks["correctness"]["sampler_logprobs"]
    assert sampler["self_logp_diff_max"] < 1e-3 and 0 < sampler["bf16_logp_diff_max"] < 0.5
    resumed = checks["correctness"]["checkpoint_to_cpu"]
    assert resumed["cpu_resume_bit_exact"] and resumed["steps_logged"] == [1, 2, 3] and not resumed["cpu_sees_cuda"]
    assert checks["nccl"]["two_members"]["bit_exact"] and checks["nccl"]["one_member"]["backend"] == "gloo"
    assert checks["fsdp2"]["update_float32"]["rel_error_vs_unsharded"] < 1e-5
    assert checks["fsdp2"]["generate_gathered"]["dtensor_parameters"]
    split = checks["sequence"]  # each sequence split over two processes: the same log-probs, half the activations
    assert split["split_exact"]["status"] == "ok" and split["split_exact"]["packed_grad_rel_error"] < 1e-5
    assert split["long_sequence_memory"]["saved_ratio"] < 0.75 and split["long_sequence_memory"]["logp_sum_diff"] < 1e-2

    routing = checks["routing"]  # routing replay: recorded while generating, forced in the learner's forwards
    assert routing["record"]["same_tokens"] and routing["record"]["routes_bytes"] > 0
    assert routing["replay"]["status"] == "ok" and routing["replay"]["mismatch_tokens_padded"] < 0.05  # same weights

    throughput = result["parts"]["throughput"]
    assert checks["throughput"]["generation"]["tokens_per_s"] > 0
    learners = [c for name, c in checks["throughput"].items() if name.startswith("learner_")]
    assert len(learners) == 4 and all(c["tokens_per_s"] > 0 and c["model_tflop"] > 0 for c in learners)
    assert throughput["packing"] == "available"  # train.packing, the learner's real switch
    assert checks["throughput"]["build_padded"]["packs"] is False and checks["throughput"]["build_packed"]["packs"]
    assert set(throughput["padded_vs_packed"]) == {"generated", "long_tailed"}
    for name, compared in throughput["padded_vs_packed"].items():  # the same weights, the same first update
        assert compared["speedup"] > 0 and compared["loss_difference"] < 1e-2, (name, compared)
    saved = checks["checkpoint"]["sharded_vs_gathered"]  # the sharded save's time and memory, against gathered
    assert saved["sharded_load_bit_exact"] and saved["sharded_save_seconds"] > 0 and saved["gathered_save_seconds"] > 0
    trl = result["parts"]["trl"]
    if trl["status"] == "skipped" or checks["trl"].get("import", {}).get("status") == "skipped":
        assert "TRL cannot be imported" in json.dumps(trl)
    else:
        assert checks["trl"]["steps"]["step_seconds"] > 0

    table = (tmp_path / "out" / "table.md").read_text()
    assert all(f"| {part} |" in table for part in parts)
    assert "correctness  gradient" in done.stdout  # the table printed at the end


def test_the_onegpu_part_answers_its_questions_in_the_cpu_mode(tmp_path):
    """The one-GPU practitioner's part alone (what the first GPU run answers, here on the tiny
    Qwen2): adapter against merged push bytes and seconds, a delta push after an AdamW step at
    1e-6 rebuilt bitwise and a corrupted copy caught, a streamed push bitwise the whole one, the
    4-bit base's step against bf16's
    (bitsandbytes' CPU backend here; skipped, saying why, where it cannot be imported)."""
    done = _check(["--out", tmp_path / "out", "--work", tmp_path / "work", "--device", "cpu", "--tiny",
                   "--simulate-missing", "--parts", "onegpu"])
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    checks = json.loads((tmp_path / "out" / "results.json").read_text())["parts"]["onegpu"]["checks"]
    pushes = checks["push_adapter_vs_merged"]
    assert 0 < pushes["adapter_bytes"] < pushes["merged_bytes"] and pushes["merged_prepare_s"] > 0
    delta = checks["push_delta_vs_full"]
    assert delta["status"] == "ok" and delta["bitwise_equal"] and delta["corrupted_copy_caught"]
    assert 0 < delta["delta_bytes"] < delta["full_bytes"] and 0 < delta["elements_sent"] < 1
    streamed = checks["push_streamed_vs_whole"]  # the tiny model fits one bucket: the figures are a GPU's
    assert streamed["status"] == "ok" and streamed["bitwise_equal"] and streamed["streamed_64_s"] > 0
    qlora = checks["qlora_vs_bf16_lora"]
    if qlora["status"] == "skipped":
        assert "bitsandbytes cannot be imported" in qlora["reason"]
    else:
        assert qlora["status"] == "ok" and qlora["qlora_nf4"]["step_s"] > 0 and qlora["bf16_lora"]["step_s"] > 0
    assert "push_delta_vs_full" in (tmp_path / "out" / "table.md").read_text()


def test_the_dry_run_lists_every_file_sent_and_the_command():
    done = _check(["--dry-run"], timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    listed = re.findall(r"^\s*[\d,]+  (\S.*)$", out.split("by folder:")[0], re.M)
    total = re.search(r"^total: (\d+) files, ([\d,]+) bytes", out, re.M)
    assert total and int(total.group(1)) == len(listed)
    assert int(total.group(2).replace(",", "")) <= 64 * 2**20 and "fits" in out
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert {name for name in tracked if (ROOT / name).is_file()} <= set(listed)
    assert "bench/gpu/run.py" in listed
    command = re.search(r"^  command: (.*)$", out, re.M).group(1)
    assert "--target /tmp/site .whl/*.whl" in command and "python3 bench/gpu/run.py --out $OUT" in command
    assert len(command) <= 2000  # the device tool's limit
    assert re.search(r"^  carry: \['\.whl'\]$", out, re.M)


@pytest.mark.slow
def test_a_part_over_its_limit_is_killed_and_the_next_runs_in_a_fresh_process(tmp_path):
    done = _check(["--out", tmp_path / "out", "--work", tmp_path / "work", "--device", "cpu", "--tiny",
                   "--parts", "correctness,nccl", "--limit-s", "correctness=5", "--hang", "correctness"])
    assert done.returncode == 1, (done.stdout + done.stderr)[-3000:]
    parts = json.loads((tmp_path / "out" / "results.json").read_text())["parts"]
    assert parts["correctness"]["status"] == "timeout" and "killed after 5 s" in parts["correctness"]["error"]
    assert parts["nccl"]["status"] == "ok"


def test_parts_that_do_not_fit_the_budget_are_skipped_with_the_reason(tmp_path):
    done = _check(["--out", tmp_path / "out", "--work", tmp_path / "work", "--device", "cpu", "--tiny",
                   "--parts", "throughput,trl", "--budget-s", "25"])
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    parts = json.loads((tmp_path / "out" / "results.json").read_text())["parts"]
    for part in ("throughput", "trl"):
        assert parts[part]["status"] == "skipped" and "would not fit" in parts[part]["reason"], parts[part]
