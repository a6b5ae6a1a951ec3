"""Hostile input refused, never run or expanded: YAML built to exhaust the loader (an alias
cycle, a billion-laughs alias bomb, 5,000-deep nesting) exits 2 fast with bounded memory and
no traceback; a checkpoint whose ``state.pt`` carries a pickle payload is refused without
running it."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_core import checkpoint as ckpt
from grpo_core.cli import main
from grpo_core.errors import RunError

from .conftest import CHILD_ENV


def _bomb(levels: int = 9, fanout: int = 10) -> str:
    lines = ["a0: &a0 [lol]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * fanout) + "]")
    return "\n".join(lines) + "\n"


HOSTILE = {
    "alias-cycle": ("a: &x [*x]\n", "a cycle"),
    "alias-cycle-in-a-mapping": ("train: &t\n  steps: 1\n  again: *t\n", "a cycle"),
    "billion-laughs": (_bomb(), "an alias bomb"),
    "deep-nesting": ("train: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 100 levels deep"),
    "deep-mappings": ("".join("  " * i + f"k{i}:\n" for i in range(5000)) + "  " * 5000 + "v: 1\n",
                      "nested more than 100 levels deep"),
}


# The peak RSS of ``grpo-run`` alone. ``os.wait4`` on a direct child is not it: on Linux the child's
# ``ru_maxrss`` starts at the high-water mark of the process that spawned it (exec keeps the old
# memory map's peak), so a pytest worker that once held 1.2 GB reports every child at 1.2 GB (it
# failed CI that way). A small Python process in between spawns ``grpo-run`` from a fresh memory map
# and reports the grandchild's own peak.
_MEASURE = (
    "import os, subprocess, sys, threading\n"
    "proc = subprocess.Popen(sys.argv[2:], stdout=subprocess.DEVNULL)\n"
    "killer = threading.Timer(float(sys.argv[1]), proc.kill)\n"
    "killer.start()\n"
    "_, status, usage = os.wait4(proc.pid, 0)\n"
    "killer.cancel()\n"
    "print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)\n"
)


def _run_measured(args: list[str], cwd: Path, timeout: float) -> tuple[int, str, float, int]:
    """``grpo-run ARGS`` in a subprocess: (exit code, stderr, seconds, its own peak RSS in KiB)."""
    err = cwd / "stderr.txt"
    started = time.monotonic()
    with err.open("wb") as fh:
        try:
            out = subprocess.run(
                [sys.executable, "-c", _MEASURE, str(timeout), sys.executable, "-m", "grpo_core.cli", *args],
                cwd=cwd, stdout=subprocess.PIPE, stderr=fh, env={**os.environ, **CHILD_ENV},
                timeout=timeout + 30, check=True,
            ).stdout
        except subprocess.TimeoutExpired:
            pytest.fail(f"grpo-run {args} still running after {timeout}s")
    seconds = time.monotonic() - started
    code, peak_kib = (int(word) for word in out.split())
    return code, err.read_text(errors="replace"), seconds, peak_kib


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_hostile_yaml_exits_2_fast_with_bounded_memory(tmp_path, case):
    text, message = HOSTILE[case]
    (tmp_path / "spec.yaml").write_text(text, encoding="utf-8")
    code, err, seconds, peak_kib = _run_measured(["validate", "spec.yaml"], tmp_path, timeout=60)
    assert code == 2, err
    assert "Traceback" not in err and "RecursionError" not in err, err
    assert "invalid spec spec.yaml" in err and message in err, err
    assert seconds < 60
    assert peak_kib < 1024 * 1024, peak_kib


def test_hostile_set_value_is_refused(tmp_path, capsys):
    (tmp_path / "spec.yaml").write_text("train: {steps: 1}\n", encoding="utf-8")
    assert main(["validate", str(tmp_path / "spec.yaml"), "--set", "train.x=&x [*x]"]) == 2
    assert "--set train.x: refusing the value: an alias refers to a node that contains it" in capsys.readouterr().err


def test_ordinary_anchors_and_aliases_still_load():
    from grpo_core.spec.loader import parse_yaml

    data, lines = parse_yaml("a: &f {name: format}\nrewards: [*f, *f]\n", "t")
    assert data["rewards"] == [{"name": "format"}, {"name": "format"}] and lines[("rewards",)] == 2


# --------------------------------------------------------------------------- pickle payloads
class _Payload:
    """Unpickling this writes a marker file: what a crafted checkpoint would run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def _checkpoint_with_payload(tmp_path, write_spec, marker: Path) -> tuple[Path, Path]:
    spec = write_spec(tmp_path, train={"steps": 2}, checkpoint={"every": 1, "keep": 2})
    assert main([str(spec)]) == 0
    folder = ckpt.list_checkpoints(tmp_path / "out" / "checkpoints")[-1]
    state = torch.load(folder / ckpt.STATE, weights_only=False)
    state["components"]["evil"] = _Payload(str(marker))
    torch.save(state, folder / ckpt.STATE)
    # A forger rewrites the manifest too: the checksum is no defence, the loader must be.
    import hashlib
    import json

    manifest = json.loads((folder / ckpt.MANIFEST).read_text())
    data = (folder / ckpt.STATE).read_bytes()
    manifest["files"][ckpt.STATE] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / ckpt.MANIFEST).write_text(json.dumps(manifest))
    assert ckpt.verify(folder) is None
    return spec, folder


def test_a_pickle_payload_in_a_checkpoint_is_refused_not_run(tmp_path, write_spec, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned.txt"
    spec, folder = _checkpoint_with_payload(tmp_path, write_spec, marker)
    capsys.readouterr()
    assert main([str(spec), "--set", "train.steps=3", "--resume"]) == 1
    err = capsys.readouterr().err
    assert f"refusing to load {folder / ckpt.STATE}" in err and "could run code" in err, err
    assert "Traceback" not in err
    assert not marker.exists()  # the payload never ran
    with pytest.raises(RunError, match="refusing to load"):
        ckpt.load_state(folder / ckpt.STATE)
    assert not marker.exists()


def test_checkpoint_state_loads_onto_the_given_device(tmp_path, write_spec, monkeypatch):
    """Optimizer state lands where the run trains (``map_location``), whatever device wrote it;
    numpy's and python's RNG states come back too, under ``weights_only=True``."""
    monkeypatch.chdir(tmp_path)
    spec = write_spec(tmp_path, train={"steps": 2, "schedule": "cosine", "warmup_steps": 1})
    assert main([str(spec)]) == 0
    folder = ckpt.list_checkpoints(tmp_path / "out" / "checkpoints")[-1]
    state = ckpt.load_state(folder / ckpt.STATE, map_location="meta")
    tensors = [v for s in state["optimizer"]["state"].values() for v in s.values() if torch.is_tensor(v)]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    cpu = ckpt.load_state(folder / ckpt.STATE, map_location=torch.device("cpu", 0))  # accelerate's CPU device
    assert cpu["rng"]["numpy"][0] == "MT19937" and len(cpu["rng"]["python"][1]) == 625
    assert cpu["trajectory"] and cpu["scheduler"]["last_epoch"] == 2


def test_pickle_is_not_what_loads_state(tmp_path):
    """``load_state`` refuses a plain pickle of a non-tensor object outright."""
    path = tmp_path / "state.pt"
    with path.open("wb") as fh:
        pickle.dump({"x": _Payload(str(tmp_path / "m"))}, fh, protocol=2)
    with pytest.raises(RunError, match="refusing to load"):
        ckpt.load_state(path)
    assert not (tmp_path / "m").exists()
