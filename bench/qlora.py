"""A 4-bit base (``model.quantization``, QLoRA) against float32 and bfloat16, on the CPU.

    python bench/qlora.py [--threads 1] [--repeats 3] [--out FILE.json]

A model of SmolLM2-135M's shape (random weights, built from its config: nothing downloaded) is
written once to a scratch folder; then each setting runs in a process of its own, loaded as
grpo-core loads it (``grpo_core.train.model.load_policy``: bitsandbytes NF4 with double
quantization, its CPU repacking off, peft's k-bit preparation, a rank-16 adapter on every
linear layer), and reports:

- ``weights_mb``: transformers' ``get_memory_footprint()`` of the base (before the adapter);
- ``rss_after_load_mb``, ``peak_rss_mb``: the process's resident memory after loading and its
  peak (``ru_maxrss``) over loading and the forward and backward passes;
- ``step_cpu_s``: CPU seconds of one forward and backward of 4 x 64 tokens, best of
  ``--repeats``.

The figures in ``docs/guides/memory.md`` (A 4-bit base) come from it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "nf4": {"dtype": "float32", "quantization": {"quant_type": "nf4", "double_quant": True}},
}


def write_model(folder: Path, tiny: bool = False) -> None:
    """SmolLM2-135M's shape with random weights; ``tiny``: two layers of width 64 (a smoke run)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_core.testing import build_tokenizer

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2) if tiny else dict(hidden_size=576, intermediate_size=1536,
                                                           num_hidden_layers=30, num_attention_heads=9,
                                                           num_key_value_heads=3)
    config = LlamaConfig(vocab_size=49152, tie_word_embeddings=True, **shape)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)


def measure(folder: Path, setting: str, threads: int, repeats: int) -> dict:
    import torch

    from grpo_core.spec.models import ModelSection
    from grpo_core.testing import build_tokenizer
    from grpo_core.train.model import load_policy

    torch.set_num_threads(threads)
    section = ModelSection(path=str(folder), lora={"r": 16, "alpha": 32}, **SETTINGS[setting])
    model = load_policy(section, folder, build_tokenizer())
    page = os.sysconf("SC_PAGE_SIZE")
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * page / 2**20
    weights = model.get_base_model().get_memory_footprint() / 1e6
    ids = torch.randint(0, 49152, (4, 64), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(repeats):
        start = time.process_time()
        model(ids).logits.float().logsumexp(-1).mean().backward()
        times.append(time.process_time() - start)
        model.zero_grad(set_to_none=True)
    return {"setting": setting, "weights_mb": round(weights, 1), "rss_after_load_mb": round(rss),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "step_cpu_s": round(min(times), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description="QLoRA's 4-bit base against float32 and bfloat16 (CPU)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    parser.add_argument("--tiny", action="store_true", help="a two-layer model of width 64 (a smoke run)")
    parser.add_argument("--one", nargs=2, metavar=("FOLDER", "SETTING"), help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.one:
        print(json.dumps(measure(Path(a.one[0]), a.one[1], a.threads, a.repeats)))
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="grpo-qlora-bench-") as scratch:
        folder = Path(scratch) / "model"
        write_model(folder, a.tiny)
        for setting in SETTINGS:
            done = subprocess.run([sys.executable, __file__, "--one", str(folder), setting, "--threads",
                                   str(a.threads), "--repeats", str(a.repeats)], capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                return 1
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(results[-1])
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
