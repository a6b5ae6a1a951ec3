"""The learner packed against padded, and against its floor, on SmolLM2-135M-Instruct.

    python bench/packing.py [--reps 5] [--threads 1] [--shapes quickstart long-tail] [--limit 512]
                            [--out bench/runs/packing/RESULT.json] [--attention] [--compile]

A smoke run at a small size: ``--reps 1 --shapes long-tail --limit 64`` (6 minutes on the 2-core
machine under load; both batches at one repetition took 24 minutes there).

Two batches, each ``P`` arithmetic prompts (the quickstart's chat-formatted prompts) with
``G = 8`` completions:

- ``quickstart``: the quickstart's shapes, P=2, G=8, completions sampled by the ``hf`` backend
  from the model itself with 32 new tokens (their real length spread);
- ``long-tail``: P=2, G=8, one completion per group at the limit (``--limit``, 512 tokens by
  default) and the others short (``16 + Exponential(mean 48)`` tokens, at most the limit),
  random token ids.

For each, the learner's forward and backward of the batch (``grpo_core.train.learner.update``'s
micro-batches under the default ``train.micro_batch_tokens: 2048``, ``micro_batch_loss`` with
the ``clip`` loss and ``token-mean``, backward; no optimizer step) three ways: padded
(``train.packing: false``), packed (``true``), and packed one group per forward (the padded
side's micro-batches here: the same rows per forward); and the no-grad log-prob forward of
the batch (what the old-policy and reference log-probs cost), each way. The sides run
interleaved in this one process, the order reversed every repetition, and the script reports
medians of CPU seconds on one thread (``--threads 1``, the default): on a shared machine the
CPU time of a one-thread process leaves out the time spent waiting for a core, and wall
seconds are reported beside it.

Memory, per side (in passes of their own, untimed): the bytes autograd saves for backward in
the largest micro-batch (``torch.autograd.graph.saved_tensors_hooks``, each storage once, the
weights left out: deterministic, the activation memory that grows with the padded width), and
the peak resident memory above the level before the forward and backward (sampled every
2 ms; the script re-executes itself with ``MALLOC_MMAP_THRESHOLD_`` fixed so that freed
tensors leave the resident set).

The floor: the model FLOPs of a step (:func:`model_flops`, from the config and the packed
token counts) divided by the fp32 matmul rate of a 2048x576x1536 matmul (GFLOP per CPU
second) measured in the same repetitions on the same threads. For every token position run
through the decoder, per layer, ``2 * (H*q + 2*H*kv + q*H + 3*H*I)`` (the q, k, v, o and
gated-MLP matmuls; ``q`` = heads x head size, ``kv`` = key/value heads x head size, ``I`` the
MLP width); for every query, ``4 * q * k`` for attention over the ``k`` keys it sees (``QK^T``
and ``PV``; a prompt token at position ``i`` sees ``i + 1`` keys, a completion token its prompt
and its own tokens so far); for every predicted completion token ``2 * H * V`` for the output
layer. Backward is twice forward, so a step's forward+backward is 3x that sum. Norms, rotary
embeddings and activations are not counted (memory-bound, no matmul). Padding, and the output
layer's logits recomputed in backward (the chunked log-probs keep no ``(N, V)`` tensor), are
work the floor does not count.

``--attention`` adds a forward+backward of the packed batch with a dense ``N x N`` block mask
passed to the model as a 4D attention mask (transformers' own path for a custom mask,
through ``sdpa``) against the segment attention the engine uses. ``--compile`` adds the
packed forward with each decoder layer's MLP and norms compiled by ``torch.compile``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

MMAP_THRESHOLD = "131072"  # bytes: larger allocations are mmapped and returned on free


# ---------------------------------------------------------------------------- measurement
class Clock:
    """Wall and CPU seconds of a block (``wall``, ``cpu``). On a shared machine the CPU time
    of a one-thread process is the steadier figure: it leaves out the time spent waiting for a
    core (with several threads it would count their spin-waits)."""

    def __enter__(self):
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self._wall, time.process_time() - self._cpu


def matmul_gflops(reps: int = 5) -> dict[str, float]:
    """fp32 GFLOP/s of a 2048x576 @ 576x1536 matmul (median of ``reps``), by wall and CPU time."""
    a, b = torch.randn(2048, 576), torch.randn(576, 1536)
    a @ b
    walls, cpus = [], []
    for _ in range(reps):
        with Clock() as clock:
            a @ b
        walls.append(clock.wall)
        cpus.append(clock.cpu)
    flops = 2 * 2048 * 576 * 1536 / 1e9
    return {"wall": flops / statistics.median(walls), "cpu": flops / statistics.median(cpus)}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def peak_rss(result: dict):
    """``result["peak"]``: the highest resident bytes above the level at entry."""
    base, peak, stop = rss(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss() - base)
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        result["peak"] = max(peak[0], rss() - base)


@contextmanager
def saved_bytes(result: dict, model):
    """``result["bytes"]``: bytes of the distinct storages autograd saves for backward, the
    model's parameters left out (they are held anyway)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield
    result["bytes"] = sum(seen.values())


# ---------------------------------------------------------------------------- the batches
def build_batch(name: str, model, tokenizer, prompts: list[list[int]], group: int, seed: int, limit: int = 512):
    """A ``TrainBatch`` of ``name``'s shapes with random non-zero advantages."""
    from grpo_core.train.learner.batch import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    P = len(prompts)
    width = max(map(len, prompts))
    p_ids = torch.full((P, width), tokenizer.pad_token_id, dtype=torch.long)
    p_mask = torch.zeros((P, width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        p_ids[i, width - len(p):] = torch.tensor(p)
        p_mask[i, width - len(p):] = True
    if name == "quickstart":
        from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions

        from grpo_core.contracts import SamplingParams

        backend = HFRollout(HFRolloutOptions(dtype=None))
        from grpo_core.contracts import RolloutSetup

        backend.setup(RolloutSetup(model, tokenizer))
        rollout = backend.generate(prompts, group, SamplingParams(max_new_tokens=32, seed=seed))
        p_ids, p_mask = rollout.prompt_ids, rollout.prompt_mask.bool()
        c_ids, c_mask = rollout.completion_ids, rollout.completion_mask.bool()
        model.train()
    else:
        lengths = (16 + torch.empty(P * group).exponential_(1 / 48, generator=gen)).long().clamp(max=limit)
        lengths[::group] = limit
        steps = int(lengths.max())
        c_mask = torch.arange(steps)[None, :] < lengths[:, None]
        c_ids = torch.randint(10, tokenizer.vocab_size, (P * group, steps), generator=gen) * c_mask
    advantages = torch.randn(P * group, 1, generator=gen).expand(-1, c_ids.shape[1]) * c_mask
    return TrainBatch(p_ids, p_mask, c_ids, c_mask, advantages.contiguous())


def model_flops(config, batch) -> dict[str, float]:
    """The model FLOPs of one forward+backward of ``batch`` (the module doc's formula)."""
    from grpo_core.train.learner.packing import needed_lengths

    hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_token = 2 * (hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * config.intermediate_size)
    need = needed_lengths(batch.mask)
    G = batch.group_size
    positions = keys = 0
    for p in range(batch.prompt_ids.shape[0]):
        rows = need[p * G:(p + 1) * G]
        if not bool((rows > 0).any()):
            continue
        lp = int(batch.prompt_mask[p].sum())
        positions += lp
        keys += lp * (lp + 1) // 2
        for n in (rows - 1).clamp(min=0).tolist():  # completion tokens run (the last is a target only)
            positions += n
            keys += n * lp + n * (n + 1) // 2
    targets = int(batch.mask.sum())
    forward = layers * (per_token * positions + 4 * q * keys) + 2 * hidden * vocab * targets
    return {"positions": positions, "targets": targets, "flops": 3.0 * forward}


def padded_positions(batch) -> int:
    """Positions the padded path runs without length buckets: prompts once per group, every
    row to the longest needed completion."""
    from grpo_core.train.learner.packing import needed_lengths

    need = needed_lengths(batch.mask)
    return batch.prompt_ids.shape[0] * batch.prompt_ids.shape[1] + len(need) * int(need.max())


# ---------------------------------------------------------------------------- the sides
def objective():
    from grpo_core.plugin_manager import load_plugins
    from grpo_core.train.learner.update import Objective

    registry = load_plugins(external=False).registry
    return Objective(policy_loss=registry.get("policy_loss", "clip").build(),
                     aggregator=registry.get("loss_aggregator", "token-mean").build(), kl=None,
                     entropy_coef=0.0, early_stop_imp_ratio=None, max_length=512)


def micros(batch, packed: bool, tokens: int):
    """The learner's micro-batches of the whole batch under ``train.micro_batch_tokens``."""
    from grpo_core.train.learner.batch import micro_batches

    return micro_batches(batch, torch.arange(len(batch.mask)), None, tokens, packed)


def forward_backward(model, batch, packed: bool, tokens: int = 2048, loss_of=None) -> Clock:
    """The learner's forward and backward of every micro-batch (what ``update`` does before the
    optimizer step: ``micro_batch_loss`` then backward), gradients freed after."""
    from grpo_core.contracts import BatchStats
    from grpo_core.train.learner.parallel import forward_of
    from grpo_core.train.learner.update import micro_batch_loss

    loss_of = loss_of or objective()
    stats = BatchStats(int(batch.mask.sum()), len(batch.mask), 512)
    with Clock() as clock:
        for rows in micros(batch, packed, tokens):
            loss = micro_batch_loss(forward_of(model), batch, rows, loss_of, stats, packed=packed)[0]
            loss.backward()
        model.zero_grad(set_to_none=True)
    return clock


def nograd_forward(model, batch, packed: bool, tokens: int = 2048) -> Clock:
    """The no-grad log-probs of the whole batch (old policy, reference)."""
    from grpo_core.train.learner.batch import batch_logprobs
    from grpo_core.train.learner.parallel import forward_of

    with Clock() as clock:
        batch_logprobs(forward_of(model), batch, micros(batch, packed, tokens), 1.0, nullcontext, packed=packed)
    return clock


def memory(model, batch, packed: bool, tokens: int = 2048) -> dict[str, float]:
    """Saved activation bytes of the largest micro-batch and the peak RSS above the start of a
    forward and backward of the batch."""
    from grpo_core.train.learner.batch import forward_logprobs
    from grpo_core.train.learner.parallel import forward_of

    largest = 0
    for rows in micros(batch, packed, tokens):
        saved: dict = {}
        with saved_bytes(saved, model):
            logp, _ = forward_logprobs(forward_of(model), batch, rows, with_entropy=False, temperature=1.0,
                                       packed=packed)
        logp.sum().backward()
        model.zero_grad(set_to_none=True)
        largest = max(largest, saved["bytes"])
    peak: dict = {}
    with peak_rss(peak):
        forward_backward(model, batch, packed, tokens)
    return {"saved_activation_mb": largest / 2**20, "peak_rss_delta_mb": peak["peak"] / 2**20,
            "micro_batches": len(micros(batch, packed, tokens))}


def dense_mask_seconds(model, batch, reps: int) -> dict[str, float]:
    """CPU seconds of a forward+backward of the whole batch as one packed sequence: the
    engine's segment attention against a dense ``N x N`` block mask given to the model as its
    4D attention mask (transformers passes it to ``sdpa`` as it is); the same output layer
    after both; and their largest log-prob difference."""
    from grpo_core.train.learner.logprobs import token_logprobs
    from grpo_core.train.learner.packing import pack_rows, packed_decoder_call

    G = batch.group_size
    index = torch.arange(batch.prompt_ids.shape[0]).repeat_interleave(G)
    layout = pack_rows(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.mask, index)
    segment_of = torch.zeros(layout.tokens, dtype=torch.long)
    group_of = torch.zeros(layout.tokens, dtype=torch.long)
    prompt = torch.zeros(layout.tokens, dtype=torch.bool)
    start, group = 0, -1
    for i, (length, context) in enumerate(layout.segments):
        group += not context
        end = start + length
        segment_of[start:end], group_of[start:end], prompt[start:end] = i, group, not context
        start = end
    pos = torch.arange(layout.tokens)
    dense = ((group_of[:, None] == group_of[None, :]) & (pos[None, :] <= pos[:, None])
             & ((segment_of[:, None] == segment_of[None, :]) | prompt[None, :]))
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    c_mask = batch.mask[:, : layout.hidden_index.shape[1]]
    targets = batch.completion_ids[:, : c_mask.shape[1]][c_mask]

    def run(dense_mask: bool):
        if dense_mask:
            hidden = decoder(input_ids=layout.input_ids, position_ids=layout.position_ids,
                             attention_mask=dense[None, None], use_cache=False).last_hidden_state[0]
        else:
            hidden = packed_decoder_call(decoder, layout)
        logp, _ = token_logprobs(hidden[layout.hidden_index[c_mask]], head, targets)
        logp.sum().backward()
        model.zero_grad(set_to_none=True)
        return logp.detach()

    diff = float((run(True) - run(False)).abs().max())
    times: dict[str, list[float]] = {"dense_mask": [], "segments": []}
    for rep in range(reps):
        for name in (("dense_mask", "segments") if rep % 2 == 0 else ("segments", "dense_mask")):
            with Clock() as clock:
                run(name == "dense_mask")
            times[name].append(clock.cpu)
    return {"tokens": layout.tokens, "max_abs_diff": diff,
            **{f"{k}_cpu_s": statistics.median(v) for k, v in times.items()}}


def compiled_mlps(model) -> None:
    """Each decoder layer's MLP and norms compiled by ``torch.compile`` (dynamic shapes); the
    attention stays eager (its loop over the packed rows would recompile for every layout)."""
    for layer in model.get_decoder().layers:
        for part in ("mlp", "input_layernorm", "post_attention_layernorm"):
            setattr(layer, part, torch.compile(getattr(layer, part), dynamic=True))


# ---------------------------------------------------------------------------- main
def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_shape(name, model, tokenizer, prompts, args, variants) -> dict:
    log(f"{name}: building the batch")
    batch = build_batch(name, model, tokenizer, prompts, 8, args.seed, args.limit)
    flops = model_flops(model.config, batch)
    # (model, packed, micro_batch_tokens): the default budget; and 1, one group per forward
    sides = {"padded": (model, False, 2048), "packed": (model, True, 2048),
             "packed, one group per forward": (model, True, 1), **variants}
    for side, (m, packed, tokens) in sides.items():  # warm-up (and compilation)
        log(f"{name}: warm-up {side}")
        forward_backward(m, batch, packed, tokens)
        nograd_forward(m, batch, packed, tokens)
    runs: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": [], "nograd_cpu": []} for k in sides}
    rates = []
    for rep in range(args.reps):
        rates.append(matmul_gflops())
        for side in (list(sides) if rep % 2 == 0 else list(reversed(sides))):
            m, packed, tokens = sides[side]
            clock = forward_backward(m, batch, packed, tokens)
            runs[side]["wall"].append(clock.wall)
            runs[side]["cpu"].append(clock.cpu)
            runs[side]["nograd_cpu"].append(nograd_forward(m, batch, packed, tokens).cpu)
        log(f"{name} rep {rep + 1}/{args.reps}: " + ", ".join(
            f"{s} {runs[s]['cpu'][-1]:.2f} s" for s in sides) + f" (CPU), matmul {rates[-1]['cpu']:.0f} GFLOP/s")
    rate = statistics.median(r["cpu"] for r in rates)
    out = {
        "completion_lengths": batch.mask.sum(1).tolist(),
        "packed_positions": flops["positions"],
        "padded_positions_unbucketed": padded_positions(batch),
        "target_tokens": flops["targets"],
        "model_gflops": flops["flops"] / 1e9,
        "matmul_gflops_per_cpu_s": rate,
        "matmul_gflops_per_wall_s": statistics.median(r["wall"] for r in rates),
        "floor_s": flops["flops"] / (rate * 1e9),
        "sides": {},
    }
    log(f"{name}: memory passes")
    for side, (m, packed, tokens) in sides.items():
        cpu = statistics.median(runs[side]["cpu"])
        out["sides"][side] = {
            "forward_backward_cpu_s": cpu,
            "forward_backward_wall_s": statistics.median(runs[side]["wall"]),
            "runs_cpu_s": runs[side]["cpu"],
            "nograd_forward_cpu_s": statistics.median(runs[side]["nograd_cpu"]),
            "over_floor": cpu / out["floor_s"],
            **memory(m, batch, packed, tokens),
        }
    if args.attention:
        log(f"{name}: dense mask against segments")
        out["attention"] = dense_mask_seconds(model, batch, args.reps)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=512, help="the long-tail batch's longest completion")
    parser.add_argument("--shapes", nargs="+", default=["quickstart", "long-tail"],
                        choices=["quickstart", "long-tail"])
    parser.add_argument("--attention", action="store_true", help="also time a dense 4D block mask")
    parser.add_argument("--compile", action="store_true", help="also the packed update with compiled MLPs")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "grpo-bench-smollm2"))
    parser.add_argument("--tiny", action="store_true", help="grpo_core.testing's tiny random model (a smoke run)")
    args = parser.parse_args(argv)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD})
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vs_trl import bench_model, task_rows

    folder = bench_model(Path(args.model_dir), args.tiny)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    variants = {}
    if args.compile:
        import copy

        compiled = copy.deepcopy(model)
        compiled_mlps(compiled)
        variants["packed, compiled MLPs and norms"] = (compiled, True, 2048)
    rows, _ = task_rows(10)
    prompts = [tokenizer(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)["input_ids"] for r in rows[:2]]
    results = {
        "machine": {"cpu": platform.processor() or _cpu_name(), "threads": args.threads,
                    "load_average_at_start": os.getloadavg(), "shared": True},
        "torch": torch.__version__,
        "long_tail_limit": args.limit,
        "command": " ".join(["python", "bench/packing.py", *sys.argv[1:]]),
        "shapes": {},
    }
    for name in args.shapes:
        results["shapes"][name] = run_shape(name, model, tokenizer, prompts, args, variants)
    results["machine"]["load_average_at_end"] = os.getloadavg()
    print(table(results))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")


def table(results: dict) -> str:
    lines = ["| shape | side | micro-batches | fwd+bwd CPU s | x floor | (wall s) | no-grad fwd CPU s | "
             "saved activations MB | peak RSS delta MB |", "|---|---|---|---|---|---|---|---|---|"]
    for name, shape in results["shapes"].items():
        for side, r in shape["sides"].items():
            lines.append(f"| {name} | {side} | {r['micro_batches']} | {r['forward_backward_cpu_s']:.2f} | "
                         f"{r['over_floor']:.2f} | {r['forward_backward_wall_s']:.2f} | "
                         f"{r['nograd_forward_cpu_s']:.2f} | {r['saved_activation_mb']:.0f} | "
                         f"{r['peak_rss_delta_mb']:.0f} |")
    for name, shape in results["shapes"].items():
        lines.append(f"\n{name}: {shape['packed_positions']} packed positions ({shape['padded_positions_unbucketed']} "
                     f"padded without length buckets), {shape['model_gflops']:.0f} model GFLOP, matmul "
                     f"{shape['matmul_gflops_per_cpu_s']:.0f} GFLOP per CPU s "
                     f"({shape['matmul_gflops_per_wall_s']:.0f} per wall s), floor {shape['floor_s']:.2f} s")
        if "attention" in shape:
            a = shape["attention"]
            lines.append(f"  the batch as one packed sequence of {a['tokens']} tokens, fwd+bwd CPU s: dense 4D mask "
                         f"{a['dense_mask_cpu_s']:.2f}, segments {a['segments_cpu_s']:.2f} "
                         f"(max |log-prob diff| {a['max_abs_diff']:.1e})")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
