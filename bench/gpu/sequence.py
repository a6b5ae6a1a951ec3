"""Part ``sequence``: sequence parallelism (``train.parallel.sequence``) on the device.

- ``split_exact``: the split forward (:func:`grpo_core.train.learner.sequence_parallel.split_logprobs`)
  in a process group of this one process (NCCL on a GPU: its all-to-all and sum kernels run,
  nothing crosses a wire) against the plain one (``completion_logprobs``) on the tiny policy,
  padded and packed (packed on a GPU: the ``flex_attention`` path, whose backward only a GPU
  runs): log-probs and the gradient of ``sum(logp)`` within 1e-5 (float32).
- ``long_sequence_memory``: ``bench/sequence_parallel.py`` on the device: one row of
  ``--sequence-tokens`` tokens (32768 on a GPU) through a Qwen2.5-0.5B-wide model of 4 layers,
  whole in one process, then split over two processes: each process's activation bytes saved
  for backward and its peak device memory, and their ratio (about 1/2 expected). Two processes
  share one GPU over gloo (NCCL refuses two ranks on one device; gloo stages the all-to-all
  through host memory, so the seconds are not NCCL's); with two GPUs or more, NCCL, one each.
"""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parent / "sequence_parallel.py"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(record: Any, device: torch.device, work: Path, args: Any) -> None:
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, **kwargs)
    record.note(backend=dist.get_backend())
    try:
        record.check("split_exact", lambda: _split_exact(device))
    finally:
        dist.destroy_process_group()
    record.check("long_sequence_memory", lambda: _long_sequence(device, work, args))


def _split_exact(device: torch.device) -> dict[str, Any]:
    from grpo_core.testing import build_model, build_tokenizer
    from grpo_core.train.learner.logprobs import completion_logprobs
    from grpo_core.train.learner.sequence_parallel import SequenceGroup, split_logprobs

    torch.manual_seed(0)
    plain = build_model(build_tokenizer()).to(device)
    group = SequenceGroup.of(0, 1, 1)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, 300, (2, 7), generator=gen).to(device)
    p_mask = torch.ones_like(prompt, dtype=torch.bool)
    p_mask[0, :3] = False
    comp = torch.randint(2, 300, (6, 11), generator=gen).to(device)
    mask = torch.rand(comp.shape, generator=gen).to(device) < 0.8
    out: dict[str, Any] = {}
    for packed in (False, True):
        results = []
        for split in (False, True):
            model = copy.deepcopy(plain)
            if split:
                logp, _ = split_logprobs(model, prompt, p_mask, comp, mask, sequence=group, packed=packed)
            else:
                logp, _ = completion_logprobs(model, prompt, p_mask, comp, mask, packed=packed, share_prompt=False)
            logp.sum().backward()
            results.append((logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
        (a, ga), (b, gb) = results
        name = "packed" if packed else "padded"
        out[f"{name}_logp_diff"] = float((a - b).abs().max())
        out[f"{name}_grad_rel_error"] = float((ga - gb).norm() / gb.norm())
    out["ok"] = all(v < 1e-5 for v in out.values())
    return out


def _long_sequence(device: torch.device, work: Path, args: Any) -> dict[str, Any]:
    """The bench script's two runs (whole, split in two) on the device; its records and ratios."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    tiny = getattr(args, "tiny", False) or device.type != "cuda"
    size = (["--tokens", "256", "--completion", "32", "--hidden", "32"] if tiny
            else ["--tokens", "16384", "--completion", "2048", "--hidden", "896", "--layers", "4"])
    out_json = Path(work) / "sequence_parallel.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(SCRIPT), *size, "--nproc", "1", "2", "--device", device.type,
               "--json", str(out_json)]
    if device.type == "cuda":
        command += ["--backend", "nccl" if gpus >= 2 else "gloo"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode:
        text = done.stdout + done.stderr  # the error lines first: torchrun's summary buries them
        errors = [line for line in text.splitlines() if "Error" in line or "Tried to allocate" in line]
        raise RuntimeError("bench/sequence_parallel.py failed: " + "\n".join(errors[-12:])[-3000:]
                           + "\n---\n" + text[-1500:])
    records = json.loads(out_json.read_text())["records"]
    one, two = records
    out = {"table": done.stdout.strip().splitlines(), "records": records, "gpus": gpus,
           "saved_ratio": two["saved_MB"] / one["saved_MB"], "peak_ratio": two["peak_MB"] / max(one["peak_MB"], 1e-9),
           "logp_sum_diff": abs(one["logp_sum"] - two["logp_sum"])}
    out["ok"] = bool(out["saved_ratio"] < 0.75 and out["logp_sum_diff"] < 1e-2 * max(1.0, abs(one["logp_sum"])))
    return out
