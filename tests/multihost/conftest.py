"""What the multi-host tests share: a network of three hosts (:mod:`.netns`), made for each test
and torn down after it, even when it fails; the tiny model; the environment of the processes
they start; and the guide's multi-node command, run as the guide writes it.

The ``network`` fixture skips, saying why, only where network namespaces cannot be made (not
root, no ``ip``, a container without ``CAP_SYS_ADMIN``); ``GRPO_REQUIRE_NETNS=1`` turns that
skip into a failure, for a machine where these tests must run.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from grpo_core.testing import save_tiny_model

from .netns import Host, made_network

ROOT = Path(__file__).resolve().parents[2]
MULTI_GPU_GUIDE = ROOT / "docs" / "guides" / "multi-gpu.md"

# One torch thread per process: the machine's cores are shared.
CHILD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "PYTHONUNBUFFERED": "1",
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10d's warnings about unresolvable client host names
}


@pytest.fixture
def network():
    """Three hosts, ``10.231.0.1`` to ``10.231.0.3`` (interface ``eth0`` on each), behind one
    switch; skipped where namespaces cannot be made (:func:`.netns.made_network`)."""
    with made_network(3) as net:
        yield net


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("multihost-model") / "model")


@pytest.fixture(scope="session")
def child_env(tmp_path_factory) -> dict[str, str]:
    """The environment of the processes the tests start: one thread each, and ``torchrun``
    first on PATH as this interpreter's ``python -m torch.distributed.run`` (an installed
    ``torchrun`` script may belong to another interpreter, and import another checkout)."""
    shims = tmp_path_factory.mktemp("shims")
    torchrun = shims / "torchrun"
    torchrun.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m torch.distributed.run "$@"\n', encoding="utf-8")
    torchrun.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, **CHILD_ENV, "PATH": f"{shims}{os.pathsep}{env.get('PATH', '')}"}


def made_once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder ``name``, made by ``make(folder)`` once per test session: in the temporary
    folder that the session's xdist workers share, under a lock, so that a reference run two
    workers need is run once (a failed ``make`` is retried by the next worker to ask)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' own folders (popen-gw0, ...) are its children
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            make(folder)
            (folder / ".done").touch()
    return folder


def write_spec(folder: Path, spec: dict) -> Path:
    """``spec`` as ``folder/spec.yaml`` (the guide's command runs ``spec.yaml`` in its folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return path


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)


def guide_command(containing: str) -> str:
    """The one bash block of the multi-GPU guide that launches a node of a multi-node run
    (``--rdzv_endpoint $MAIN_ADDR``) and contains ``containing``."""
    blocks = [b for b in bash_blocks(MULTI_GPU_GUIDE.read_text(encoding="utf-8"))
              if "--rdzv_endpoint $MAIN_ADDR" in b and containing in b]
    assert len(blocks) == 1, f"{MULTI_GPU_GUIDE}: {len(blocks)} multi-node blocks contain {containing!r}"
    return blocks[0]


def node_variables(host: Host, main: Host, nproc: int = 1) -> dict[str, str]:
    """The variables the guide's multi-node command reads, for ``host`` with ``main`` as node 0."""
    return {"MAIN_ADDR": main.address, "THIS_ADDR": host.address, "IFNAME": "eth0",
            "IS_MAIN": "1" if host is main else "0", "NPROC": str(nproc)}


def start_node(host: Host, main: Host, command: str, folder: Path, log: Path, env: dict[str, str],
               extra: str = "") -> subprocess.Popen:
    """The guide's ``command`` (a bash block) on ``host``, in ``folder``, with ``extra``
    appended to its last line (``--resume``)."""
    script = command.rstrip("\n") + (f" {extra}" if extra else "") + "\n"
    return host.start(["bash", "-c", script], log, env={**env, **node_variables(host, main)}, cwd=folder)
