"""Part 4, the collective paths, each in a process group of this one process (one GPU):

- ``nccl`` (:func:`run_channel`): the ``vllm-server`` backend's weight channel
  (``grpo_plugins.rollout.channel``: ``open_group``, ``update_info``, ``send_tensors``) opens its
  own process group over a TCPStore (NCCL on a GPU, gloo on the CPU) and broadcasts the tiny
  policy's weights, as ``sync_weights`` does to a server's workers; vLLM itself is not needed.
  With one member nothing crosses a wire, but NCCL makes its communicator and runs its kernels.
  A second member (a receiver thread on a second GPU, or gloo on the CPU) checks the tensors
  arrive bit for bit; NCCL refuses two members on one GPU, so with one GPU that is skipped.
- ``fsdp2`` (:func:`run_fsdp2`): the engine's FSDP2 strategy (``grpo_core.train.learner.parallel.FSDP2``:
  ``fully_shard`` on each decoder layer and the root, DTensor parameters, all-gather and
  reduce-scatter) in a default process group of one member: one update equals the unsharded
  one (float32, and bf16 gathered weights with ``param_dtype: bfloat16``), the gathered state
  dict equals the trained weights, and the ``hf`` backend generates from the gathered weights
  what the unsharded model generates. ``grpo-run`` treats one process as unsharded (nothing to
  shard), so the strategy is built here directly, as the engine builds it for several. Then the
  engine's ``Dist`` takes the paths of several processes in that group of one
  (``engine_collectives``): its float64 sums on the device, gathers, gradient sum and combined
  metrics, and an FSDP2 update whose strategy makes them.
"""

from __future__ import annotations

import copy
import socket
import threading
from pathlib import Path
from typing import Any

import torch
from common import Record, rel_error


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tiny_policy(device: torch.device):
    from grpo_core.testing import build_model, build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    return build_model(tok).to(device), tok


# --------------------------------------------------------------------------- the channel
def run_channel(record: Record, device: torch.device, work: Path, args: Any) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    record.note(backend=backend)
    record.check("one_member", lambda: _one_member(device, backend))
    record.check("two_members", lambda: _two_members(device, backend))


def _weights(device: torch.device) -> list[tuple[str, torch.Tensor]]:
    from grpo_plugins.rollout.weights import policy_weights

    model, _ = _tiny_policy(device)
    return [(name, t.detach().clone()) for name, t in policy_weights(model)]


def _one_member(device: torch.device, backend: str) -> dict[str, Any]:
    import time

    from grpo_plugins.rollout.channel import open_group, send_tensors, update_info

    weights = _weights(device)
    before = [t.clone() for _, t in weights]
    start = time.perf_counter()
    group = open_group("127.0.0.1", _free_port(), 0, 1, backend, timeout_s=60)
    opened = time.perf_counter() - start
    info = update_info(weights)
    start = time.perf_counter()
    send_tensors(group, (t for _, t in weights))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    sent = time.perf_counter() - start
    unchanged = all(torch.equal(a, b) for a, b in zip(before, (t for _, t in weights)))
    _close(group)
    return {"backend": backend, "tensors": len(info["names"]),
            "bytes": sum(t.numel() * t.element_size() for _, t in weights), "open_seconds": opened,
            "send_seconds": sent, "root_tensors_unchanged": unchanged, "ok": unchanged}


def _two_members(device: torch.device, backend: str) -> dict[str, Any]:
    from grpo_plugins.rollout.channel import open_group, receive_tensors, send_tensors, update_info

    if device.type == "cuda" and torch.cuda.device_count() < 2:
        return {"status": "skipped", "reason": "NCCL needs one GPU per member and this machine has one"}
    receiver_device = torch.device("cuda", 1) if device.type == "cuda" else device
    weights = _weights(device)
    info = update_info(weights)
    port, got, errors = _free_port(), [], []

    def receiver():
        try:
            if receiver_device.type == "cuda":
                torch.cuda.set_device(receiver_device)
            group = open_group("127.0.0.1", port, 1, 2, backend, timeout_s=60)
            got.extend((n, t.cpu()) for n, t in receive_tensors(group, info, receiver_device))
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=receiver, daemon=True)
    thread.start()
    group = open_group("127.0.0.1", port, 0, 2, backend, timeout_s=60)
    send_tensors(group, (t for _, t in weights))
    thread.join(60)
    if errors:
        raise errors[0]
    exact = [n for n, _ in got] == info["names"] and all(
        torch.equal(t.cpu(), r) and t.dtype == r.dtype for (_, t), (_, r) in zip(weights, got))
    _close(group)
    return {"backend": backend, "receiver": str(receiver_device), "tensors": len(got), "bit_exact": exact, "ok": exact}


def _close(group: Any) -> None:
    shutdown = getattr(group, "shutdown", None)
    if callable(shutdown):
        try:
            shutdown()
        except Exception:  # best effort: the process ends soon after
            pass


# --------------------------------------------------------------------------- FSDP2
def run_fsdp2(record: Record, device: torch.device, work: Path, args: Any) -> None:
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, **kwargs)
    record.note(backend=dist.get_backend())
    try:
        record.check("generate_gathered", lambda: _generate_gathered(device))
        record.check("update_float32", lambda: _sharded_update(device, work, None))
        record.check("update_bf16_params", lambda: _sharded_update(device, work, "bfloat16"))
        record.check("engine_collectives", lambda: _engine_collectives(device, work))
    finally:
        dist.destroy_process_group()


def _joined(device: torch.device):
    """The engine's process group (``Dist``) of this one process, taking the paths of several:
    its sums, gathers and gradient sums go through the default group (NCCL on a GPU)."""
    from grpo_core.train.distributed import Dist

    class Joined(Dist):
        @property
        def active(self) -> bool:
            return True

    return Joined(0, 1, device)


def _strategy(device: torch.device, param_dtype: str | None, joined: bool = False):
    from grpo_core.spec.parallel import ParallelSection
    from grpo_core.train.distributed import Dist
    from grpo_core.train.learner.parallel import FSDP2

    dist = _joined(device) if joined else Dist(0, 1, device)
    return FSDP2(dist, ParallelSection(strategy="fsdp2", param_dtype=param_dtype))


def _engine_collectives(device: torch.device, work: Path) -> dict[str, Any]:
    """``Dist``'s collectives as several processes make them (float64 sums on the device under
    NCCL, pickled gathers, a gradient sum, combined metrics), then an FSDP2 update whose
    strategy makes them too, against the unsharded one."""
    dist = _joined(device)
    model, _ = _tiny_policy(device)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    dist.sum_grads(list(model.parameters()))
    dist.barrier()
    out = {"sum_floats": dist.sum_floats([1.5, 2.0]), "any": dist.any(True), "gather": dist.gather({"rank": 0}),
           "combined": dist.combine_metrics({"loss": 1.0, "time/x": 2.0}),
           "grads_kept": all(bool((p.grad == 0.5).all()) for p in model.parameters())}
    update = _sharded_update(device, work, None, joined=True)
    out.update(update_rel_error_vs_unsharded=update["rel_error_vs_unsharded"], update_ok=update["ok"])
    out["ok"] = bool(out["sum_floats"] == [1.5, 2.0] and out["any"] and out["gather"] == [{"rank": 0}]
                     and out["combined"] == {"loss": 1.0, "time/x": 2.0} and out["grads_kept"] and update["ok"])
    return out


def _generate_gathered(device: torch.device) -> dict[str, Any]:
    """The ``hf`` backend on the sharded policy, inside the strategy's rollout phase (weights
    gathered), gives the unsharded model's greedy tokens."""
    from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions

    from grpo_core.contracts import SamplingParams

    plain, tok = _tiny_policy(device)
    sharded = copy.deepcopy(plain)
    strategy = _strategy(device, None)
    strategy.setup(sharded)
    dtensors = all(hasattr(p, "full_tensor") for p in sharded.parameters())
    prompts = [tok(text)["input_ids"] for text in ("What is 3 + 4?", "Hi there")]
    sampling = SamplingParams(max_new_tokens=8, greedy=True)
    outs = []
    for model in (plain, sharded):
        backend = HFRollout(HFRolloutOptions(dtype=None))
        from grpo_core.contracts import RolloutSetup

        backend.setup(RolloutSetup(model, tok))
        with strategy.rollout_weights(backend):  # gathers the sharded policy; nothing for the plain one
            outs.append(backend.generate(prompts, 2, sampling).completion_ids.cpu())
    same = torch.equal(outs[0], outs[1])
    return {"dtensor_parameters": dtensors, "same_tokens": same, "ok": dtensors and same}


def _sharded_update(device: torch.device, work: Path, param_dtype: str | None, joined: bool = False) -> dict[str, Any]:
    """One SGD(lr=1) update through the FSDP2 strategy against the unsharded engine's on the
    same device (float32): the weight change is the gradient."""
    from correctness import engine_gradient, on, spec_learner, textbook_batch

    from grpo_core.train.learner import sharding
    from grpo_core.train.learner.update import update

    model, _ = _tiny_policy(device)
    batch = textbook_batch()
    plain = engine_gradient(model, batch, device, work)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    learner = spec_learner(model, device, work, strategy=_strategy(device, param_dtype, joined))
    metrics = update(learner, on(batch, device))
    dtensors = all(hasattr(p, "full_tensor") for p in model.parameters())
    after = dict(sharding.full_parameters(model))
    sharded = {k: (before[k] - after[k]).cpu() for k in before}
    gathered = sharding.full_state_dict(model)
    err = rel_error(sharded, plain)
    tolerance = 1e-5 if param_dtype is None else 3e-2
    state_ok = all(torch.equal(gathered[k].cpu(), after[k].cpu()) for k in gathered if k in after)
    return {"param_dtype": param_dtype, "dtensor_parameters": dtensors, "updates": metrics["train/updates"],
            "rel_error_vs_unsharded": err, "tolerance": tolerance, "gathered_state_equals_weights": state_ok,
            "ok": bool(err < tolerance and state_ok and dtensors and metrics["train/updates"] == 1)}
