"""What a weight push holds beyond the pushing process's own weights, whole against streamed
in buckets, and what each process of a sharded learner holds, on N processes (gloo, CPU).

Each configuration runs ``N`` processes (``torchrun``) that build a random Qwen2-shaped model from
a config (nothing downloaded; ``--size 0.5b`` is Qwen2.5-0.5B's shape, 494M parameters), shard it
with FSDP2 (``fully_shard`` per decoder layer and the root, as ``train.parallel.strategy: fsdp2``
does) when ``N > 1``, optionally take one AdamW step (``--train``), then push the weights to a
real receiver: the weight channel of ``vllm-server`` (:mod:`grpo_plugins.rollout.channel`, a gloo
group over its own store) to a receiver process on this machine, which takes each tensor and
drops it. Two pushes, in bfloat16 (a server's usual dtype):

- ``whole``: as pushes were made before streaming: the whole policy made and cast first
  (``cast_weights(list(policy_weights(model)), bfloat16)``), then sent;
- ``streamed``: :func:`grpo_plugins.rollout.weights.weight_buckets` with ``--bucket-mb``, each
  bucket sent, then dropped.

Every process reports (its largest over the processes for the state, rank 0's for the push):

- ``state_MB``: bytes of the tensors it holds for training, its local shards: weights, and with
  ``--train`` their gradients (read before they are freed) and AdamW's two moments. Under FSDP2
  these fall as ``1/N``.
- ``push_MB``: the peak resident memory during the push above the resident memory just before
  it (Linux's ``VmHWM`` reset through ``/proc/self/clear_refs`` before the push, read after):
  what the push held beyond the model. The other processes take part in the gathers only.
- ``push_s``: the push's seconds (gathers, casts and the transfer to the receiver).

    python bench/push_memory.py --size 0.5b --nproc 1 --bucket-mb 64
    python bench/push_memory.py --size small --nproc 1 2 3 --train
    python bench/push_memory.py --tiny --nproc 1           # the test run's size

``MALLOC_MMAP_THRESHOLD_`` is set low in every process (the script starts itself again with it)
so that freed tensors go back to the system at once and the resident memory tracks what is
held, not what the allocator kept of the training step. One process runs in this process; its
receiver is a process of its own, except at ``--tiny`` (the test run), where it is a thread and
the figures mean little. Nothing here is part of the test run
beyond its tiniest setting.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
MMAP_THRESHOLD = "65536"  # glibc: larger allocations are mapped, and unmapped when freed
#: name -> Qwen2 config (hidden, layers, heads, kv heads, intermediate, vocabulary).
SIZES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=1536, vocab_size=32000),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _hwm_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def build(size: str, seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SIZES[size], tie_word_embeddings=True, max_position_embeddings=512)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        return Qwen2ForCausalLM(config).float()


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def receiver(port: int, info: dict) -> None:
    """The receiving end: joins the channel as rank 1, takes every tensor of the push and drops it."""
    from grpo_plugins.rollout.channel import open_group, receive_tensors

    group = open_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=600, token="bench")
    for _ in receive_tensors(group, info, "cpu"):
        pass


def push(model, mode: str, bucket_mb: float, rank: int, thread: bool = False) -> dict:
    """One push of ``model`` in bfloat16 to a receiver process: rank 0 sends, the others take part
    in the gathers. Rank 0's figures."""
    import torch
    from grpo_plugins.rollout.channel import open_group, send_tensors, update_info
    from grpo_plugins.rollout.weights import cast_weights, pending_weights, policy_weights, take_part, weight_buckets

    pending = pending_weights(model)
    if rank != 0:
        with torch.no_grad():
            if mode == "whole":
                for _ in policy_weights(model):
                    pass
            else:
                take_part(pending)
        return {}
    port = _free_port()
    info = update_info((p.name, torch.empty(p.shape, dtype=torch.bfloat16 if p.dtype.is_floating_point else p.dtype,
                                            device="meta")) for p in pending)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(info, f)
    if thread:  # the test run's tiny setting: the receiver in a thread of this process
        import threading

        child = threading.Thread(target=receiver, args=(port, info))
        child.start()
    else:
        env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0"}
        child = subprocess.Popen([sys.executable, str(HERE), "--receive", "--port", str(port), "--info", f.name],
                                 env=env)
    group = open_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=600, token="bench")  # waits for the receiver
    import gc

    gc.collect()
    before, exact = _rss_mb(), _reset_hwm()
    start = time.perf_counter()
    with torch.no_grad():
        if mode == "whole":
            weights = cast_weights(list(policy_weights(model)), torch.bfloat16)
            send_tensors(group, (t for _, t in weights))
            del weights
        else:
            for bucket in weight_buckets(pending, int(bucket_mb * 2**20), [torch.bfloat16]):
                tensors = bucket.pop(torch.bfloat16)
                send_tensors(group, (t for _, t in tensors))
                tensors.clear()
                del tensors, bucket
    seconds = time.perf_counter() - start
    peak = _hwm_mb() if exact else _rss_mb()
    child.join(600) if thread else child.wait(timeout=600)
    os.unlink(f.name)
    largest = max(p.nbytes(torch.bfloat16) for p in pending) / 2**20
    return {"push_MB": peak - before, "push_s": seconds, "largest_tensor_MB": largest,
            "pushed_MB": sum(p.nbytes(torch.bfloat16) for p in pending) / 2**20}


def worker(args) -> list[dict] | None:
    """One process of one configuration (under torchrun, or alone in this process); rank 0's
    return is every process's row."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args.size)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    params = sum(p.numel() for p in model.parameters())
    state = sum(_local_bytes(p) for p in model.parameters())
    if args.train:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(rank))
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        state += sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        state += sum(_local_bytes(t) for s in optimizer.state.values() for t in s.values()
                     if hasattr(t, "dim") and t.dim() > 0)
        optimizer.zero_grad(set_to_none=True)
    row = {"rank": rank, "params": params, "state_MB": state / 2**20}
    for mode in args.modes:
        figures = push(model, mode, args.bucket_mb, rank, thread=args.size == "tiny")
        row.update({f"{mode}_{k}": v for k, v in figures.items()})
        dist.barrier()
    rows = [None] * world
    dist.all_gather_object(rows, row)
    dist.destroy_process_group()
    if rank == 0 and args.worker:
        print("RESULT " + json.dumps(rows), flush=True)
    return rows if rank == 0 else None


def launch(args, nproc: int) -> list[dict]:
    """The rows of ``nproc`` processes: torchrun's, or, for one process, this one's (a group of one)."""
    if nproc == 1:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo", rank=0, world_size=1)
        return worker(args)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(HERE), "--worker", "--size", args.size, "--bucket-mb", str(args.bucket_mb),
               "--threads", str(args.threads), "--modes", *args.modes, *(["--train"] if args.train else [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD,
           "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(command, capture_output=True, text=True, env=env)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"run failed (nproc {nproc}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--tiny", action="store_true", help="--size tiny (the test run's setting)")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--bucket-mb", type=float, default=16.0, help="push_bucket_mb of the streamed push")
    parser.add_argument("--modes", nargs="+", default=["whole", "streamed"], choices=["whole", "streamed"])
    parser.add_argument("--train", action="store_true", help="one AdamW step first (gradients and moments counted)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--receive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--info", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.size, args.bucket_mb = "tiny", min(args.bucket_mb, 0.05)
    if args.receive:
        receiver(args.port, json.loads(Path(args.info).read_text()))
        return 0
    if args.worker:
        worker(args)
        return 0
    if not args.tiny and os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        # freed tensors back to the system at once, in this process too (N = 1 runs here)
        os.execve(sys.executable, [sys.executable, str(HERE), *(argv if argv is not None else sys.argv[1:])],
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD})
    print(f"size {args.size}, bucket {args.bucket_mb:g} MiB, bfloat16 pushes; largest over processes for the state")
    print(f"{'N':>2} {'params':>8} {'state MB/proc':>13} {'pushed MB':>9} {'largest MB':>10} "
          + " ".join(f"{m + ' MB':>12} {m + ' s':>10}" for m in args.modes))
    results = []
    for nproc in args.nproc:
        rows = launch(args, nproc)
        main_row = rows[0]
        results.append({"nproc": nproc, "size": args.size, "bucket_mb": args.bucket_mb, "train": args.train,
                        "rows": rows})
        state = max(r["state_MB"] for r in rows)
        mode = args.modes[0]
        print(f"{nproc:>2} {main_row['params'] / 1e6:>7.1f}M {state:>13.1f} {main_row[f'{mode}_pushed_MB']:>9.1f} "
              f"{main_row[f'{mode}_largest_tensor_MB']:>10.1f} "
              + " ".join(f"{main_row[f'{m}_push_MB']:>12.1f} {main_row[f'{m}_push_s']:>10.2f}" for m in args.modes),
              flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
