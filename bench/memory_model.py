"""The memory model on paper: what each process of a run holds, term by term, for a 7B, a 32B and
a 70B policy on 1, 8 and 32 GPUs, full fine-tuning sharded with FSDP2 or a LoRA adapter; and the
check of its terms against what ``bench/push_memory.py`` measured on the CPU at small sizes.

    python bench/memory_model.py                                  # the table (markdown)
    python bench/memory_model.py --check small.json [half_b.json]  # formula against measurement

The terms, per process, in bytes (``P`` the policy's parameters, ``N`` the processes, ``L`` its
layers, ``d`` hidden, ``f`` intermediate, ``V`` vocabulary, ``T`` tokens of one micro-batch):

- **weights**: FSDP2 ``4P/N`` (float32 shards; the unit being computed is gathered in
  ``param_dtype`` bfloat16, ``2 x 2 P/L``: one layer and the next, prefetched); LoRA ``2P``, the
  whole bfloat16 base in every process (LoRA is not sharded: data parallel), plus the adapter
  ``4A`` (float32, ``A`` its parameters).
- **gradients**: FSDP2 ``4P/N`` (reduce-scattered, float32); LoRA ``4A``. Freed after each update.
- **optimizer**: AdamW's two float32 moments, FSDP2 ``8P/N``; LoRA ``8A``.
- **activations**: with gradient checkpointing (the layer inputs kept, one layer recomputed at a
  time): ``2 L T d + 2 T (7d + 2 kv + 3f)`` (bfloat16; ``kv`` the key/value width), plus the
  output layer on completion tokens in chunks (grpo-core never holds ``T x V`` log-probs).
  Not sharded: it depends on ``T``, not on ``N``.
- **reference**: the KL term's reference model when ``beta > 0``: FSDP2 ``4P/N`` (sharded like the
  policy); LoRA ``0`` (the base with the adapter off). 0 with ``beta = 0``.
- **push buffer** (the process that pushes, rank 0): a streamed push holds one bucket
  (``push_bucket_mb``, 512 MiB) and the tensor being made: the largest tensor (the embedding,
  ``V d`` elements, for these models), which under FSDP2 its gather makes twice in float32 (the
  all-gather's output and the whole tensor cut from it: ``8 V d`` bytes, measured), on one process
  only its bfloat16 cast (``2 V d``); a LoRA policy's adapter push holds the adapter alone
  (``2A``, bfloat16). Before streaming, a merged push held the whole policy in bfloat16 (``2P``)
  and, under FSDP2, its gathered float32 tensors too (``6P``).
- **checkpoint buffer**: a sharded checkpoint (``torch.distributed.checkpoint``) writes each
  process's shards as they are: about one tensor's staging (``0`` here); a checkpoint gathered on
  one process held the whole weights and moments there: ``16P`` (float32 weights and AdamW) in
  its CPU memory. LoRA checkpoints hold the adapter and its moments (``12A``).

What was measured (the CPU, gloo, ``bench/push_memory.py``) and what is derived: the sharded terms
(weights, gradients, optimizer) and the push buffer are measured at small sizes and checked here
(``--check``); the activation formula, the bfloat16 gathered unit and the GPU sizes are derived,
not measured (``bench/gpu/`` measures a push's time and peak GPU memory at 0.5B on its first run).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

GiB = 2**30


@dataclass(frozen=True)
class Shape:
    """A decoder's shape: hidden ``d``, layers ``L``, intermediate ``f``, vocabulary ``V``, key/value
    width ``kv`` (key/value heads x head dim), whether the output layer is the embedding and
whether the query, key and value projections have biases."""

    name: str
    d: int
    L: int
    f: int
    V: int
    kv: int
    tied: bool = False
    qkv_bias: bool = True  # Qwen2's; Llama has none

    @property
    def params(self) -> int:
        layer = self.d * (self.d + 2 * self.kv) + self.d * self.d + 3 * self.d * self.f + 2 * self.d
        layer += (self.d + 2 * self.kv) if self.qkv_bias else 0
        return self.L * layer + self.V * self.d * (1 if self.tied else 2) + self.d

    def lora_params(self, r: int) -> int:
        """A rank-``r`` adapter on the seven projections of every layer."""
        pairs = [(self.d, self.d), (self.d, self.kv), (self.d, self.kv), (self.d, self.d),
                 (self.d, self.f), (self.d, self.f), (self.f, self.d)]
        return self.L * sum(r * (i + o) for i, o in pairs)


#: Qwen2.5-7B, Qwen2.5-32B and Llama-3-70B (their config.json shapes).
SHAPES = {
    "7B": Shape("Qwen2.5-7B", d=3584, L=28, f=18944, V=152064, kv=512),
    "32B": Shape("Qwen2.5-32B", d=5120, L=64, f=27648, V=152064, kv=1024),
    "70B": Shape("Llama-3-70B", d=8192, L=80, f=28672, V=128256, kv=1024, qkv_bias=False),
}
BUCKET = 512 * 2**20  # push_bucket_mb's default


def push_buffer(pushed: int, largest: int, n: int, bucket: int, streamed: bool = True) -> float:
    """Bytes a merged bfloat16 push of ``pushed`` elements holds beyond the model on the process
    that pushes. Streamed, at most a bucket and the largest tensor being made (gathered twice in
    float32 under FSDP2, ``n > 1``; its bfloat16 cast on one process): a bound, reached when the
    largest tensor is made while a bucket is full (made first, it goes alone). Whole, the
    bfloat16 policy, and under FSDP2 its gathered float32 tensors too."""
    if streamed:
        return min(bucket, 2 * pushed) + (8 * largest if n > 1 else 2 * largest)
    return 2 * pushed if n == 1 else 6 * pushed


def per_process(shape: Shape, n: int, mode: str, *, tokens: int = 8192, beta: float = 0.04, rank: int = 64,
                bucket: int = BUCKET, streamed: bool = True, sharded_checkpoint: bool = True) -> dict[str, float]:
    """Bytes each term takes in one process (the push and checkpoint buffers: the process that
    pushes or writes, rank 0). ``mode``: ``fsdp2`` (full fine-tuning, sharded over ``n``) or
    ``lora`` (a rank-``rank`` adapter, data parallel)."""
    P, A = shape.params, shape.lora_params(rank)
    largest = shape.V * shape.d
    acts = 2 * shape.L * tokens * shape.d + 2 * tokens * (7 * shape.d + 2 * shape.kv + 3 * shape.f)
    if mode == "fsdp2":
        unit = 2 * 2 * P / shape.L if n > 1 else 0.0
        terms = {"weights": 4 * P / n + unit, "gradients": 4 * P / n, "optimizer": 8 * P / n,
                 "activations": acts, "reference": 4 * P / n if beta > 0 else 0.0,
                 "push": push_buffer(P, largest, n, bucket, streamed),
                 "checkpoint": 0.0 if sharded_checkpoint else 16 * P}
    elif mode == "lora":
        terms = {"weights": 2 * P + 4 * A, "gradients": 4 * A, "optimizer": 8 * A, "activations": acts,
                 "reference": 0.0, "push": min(bucket, 2 * A) if streamed else 2 * A, "checkpoint": 12 * A}
    else:
        raise ValueError(f"mode must be fsdp2 or lora, got {mode!r}")
    terms["total"] = sum(terms.values())
    return terms


def table(tokens: int = 8192, beta: float = 0.04) -> str:
    """The markdown table: GiB per process for each policy, GPU count and mode."""
    cols = ["weights", "gradients", "optimizer", "activations", "reference", "push", "checkpoint", "total"]
    lines = ["| policy | GPUs | mode | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
    for key, shape in SHAPES.items():
        for n in (1, 8, 32):
            for mode in ("fsdp2", "lora"):
                terms = per_process(shape, n, mode, tokens=tokens, beta=beta)
                lines.append(f"| {key} ({shape.params / 1e9:.1f}B) | {n} | {mode} | "
                             + " | ".join(f"{terms[c] / GiB:.1f}" for c in cols) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the check
def _small_shape(size: str) -> Shape:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from push_memory import SIZES

    c = SIZES[size]
    kv = c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
    return Shape(size, d=c["hidden_size"], L=c["num_hidden_layers"], f=c["intermediate_size"], V=c["vocab_size"],
                 kv=kv, tied=True)


def check(paths: list[Path]) -> list[str]:
    """Each measured configuration against the formula: the state per process (weights,
    gradients, AdamW; the largest process) and rank 0's push, streamed and whole, in MiB. A tied
    output layer is pushed under its own name too (the state dict lists it), as measured."""
    out = [f"{'size':>6} {'N':>2} {'term':<16} {'formula MiB':>12} {'measured MiB':>13} {'ratio':>6}",
           "(push streamed: the formula is a bound, measured/formula <= 1 within it)"]
    for path in paths:
        for config in json.loads(Path(path).read_text()):
            shape, n, rows = _small_shape(config["size"]), config["nproc"], config["rows"]
            assert rows[0]["params"] == shape.params, (rows[0]["params"], shape.params)  # the shape's count is exact
            terms = per_process(shape, n, "fsdp2", beta=0.0, bucket=int(config["bucket_mb"] * 2**20))
            pushed = shape.params + (shape.V * shape.d if shape.tied else 0)  # a tied output layer goes twice
            state = terms["weights"] - (2 * 2 * shape.params / shape.L if n > 1 else 0.0)  # shards only
            if config["train"]:
                state += terms["gradients"] + terms["optimizer"]
            pairs = [("state/process", state, max(r["state_MB"] for r in rows) * 2**20)]
            main = rows[0]
            largest = shape.V * shape.d
            bucket = int(config["bucket_mb"] * 2**20)
            for mode in ("streamed", "whole"):
                if f"{mode}_push_MB" in main:
                    formula = push_buffer(pushed, largest, n, bucket, mode == "streamed")
                    pairs.append((f"push {mode}", formula, main[f"{mode}_push_MB"] * 2**20))
            for name, formula, measured in pairs:
                out.append(f"{config['size']:>6} {n:>2} {name:<16} {formula / 2**20:>12.1f} {measured / 2**20:>13.1f} "
                           f"{measured / formula if formula else math.nan:>6.2f}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="T: tokens of one micro-batch (activations)")
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient (0: no reference model)")
    parser.add_argument("--check", type=Path, nargs="+", help="bench/push_memory.py --out files to check against")
    args = parser.parse_args(argv)
    print(f"GiB per process; T = {args.tokens} tokens per micro-batch, beta = {args.beta}, bucket 512 MiB, "
          "LoRA rank 64 on the seven projections")
    print(table(args.tokens, args.beta))
    if args.check:
        print("\n".join(check(args.check)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
