"""tinker-serve's overhead: the same importance-sampling steps (forward_backward + optim_step on
the same batches) through the tinker SDK over loopback HTTP, and on the server's own Service
in-process (grpo-core's code without the wire). Prints steps per second for each.

    python bench/tinker_serve.py --steps 20 --rows 8 --tokens 64
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np


def _batches(steps: int, rows: int, tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield [(rng.integers(10, 300, size=tokens + 1).tolist(), (-5.5 + rng.normal(0, 0.3, tokens)).astype(np.float32),
                rng.normal(0, 1, tokens).astype(np.float32)) for _ in range(rows)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="a local model folder (default: a tiny one)")
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from grpo_plugins.tinker import start
    from grpo_plugins.tinker.wire import Datum
    from tinker import types

    from grpo_core.testing import save_tiny_model

    root = Path(tempfile.mkdtemp())
    model = args.model or str(save_tiny_model(root / "model", hidden_size=64, layers=2))
    server = start(argparse.Namespace(model=model, name=None, api_keys=["tml-bench"], host="127.0.0.1", port=0,
                                      state_dir=str(root / "state"), max_request_bytes=1 << 28, mlflow=None))
    client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-bench")
    training = client.create_lora_training_client(base_model=model, rank=8, seed=0)
    adam = types.AdamParams(learning_rate=1e-4)
    start_t = time.perf_counter()
    for batch in _batches(args.steps, args.rows, args.tokens):
        data = [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                            loss_fn_inputs={"target_tokens": t[1:], "logprobs": q.tolist(), "advantages": a.tolist()})
                for t, q, a in batch]
        fb = training.forward_backward(data, "importance_sampling")
        step = training.optim_step(adam)
        fb.result()
        step.result()
    sdk = args.steps / (time.perf_counter() - start_t)
    service = server.service
    local = service.create_model(service.name, {"rank": 8, "seed": 0}, None, "bench:train:0").model_id
    start_t = time.perf_counter()
    for batch in _batches(args.steps, args.rows, args.tokens):
        data = [Datum(t[:-1], {"target_tokens": np.asarray(t[1:]), "logprobs": q, "advantages": a})
                for t, q, a in batch]
        service.forward_backward(local, "importance_sampling", {}, data, False)
        service.optim_step(local, {"learning_rate": 1e-4})
    direct = args.steps / (time.perf_counter() - start_t)
    print(f"steps/s through the SDK over HTTP: {sdk:.2f}; in-process Service: {direct:.2f} "
          f"({args.rows} rows x {args.tokens} tokens, {args.steps} steps)")
    client.close("success").result()
    server.close()


if __name__ == "__main__":
    main()
