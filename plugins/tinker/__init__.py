"""tinker-serve: the Tinker API (Thinking Machines' training and sampling service) served on
your own machine by grpo-core, so a loop written against the official ``tinker`` SDK, or a
``tinker-cookbook`` recipe, trains here with only ``base_url`` and the API key changed.

``grpo-run tinker-serve --model PATH --api-key tml-...`` loads one base model (a local
transformers folder; its name for clients is the path unless ``--name`` says otherwise) and
serves, on ``--host``/``--port``, LoRA training clients on it (each its own adapter and AdamW
state, :mod:`~grpo_plugins.tinker.state`), ``forward``/``forward_backward`` with Tinker's losses mapped onto grpo-core's
(:mod:`~grpo_plugins.tinker.objectives`), ``optim_step``, ``save_state``/``load_state``,
``save_weights_for_sampler`` and sampling (``sample``, ``compute_logprobs``) with grpo-core's
``hf`` rollout backend or, with ``--rollout vllm`` or ``vllm-server``, a vLLM engine that gets
each sampler snapshot as a LoRA adapter (:mod:`~grpo_plugins.tinker.sampling`,
:mod:`~grpo_plugins.tinker.engines`); the routes, futures and refusals
are :mod:`~grpo_plugins.tinker.server`, the protobuf schema the SDK's own
(:mod:`~grpo_plugins.tinker.wire`). What each training client does is logged to
MLflow (``--mlflow``; :mod:`~grpo_plugins.tinker.tracking`). Tested with the tinker SDK 0.38.0
and tinker-cookbook 0.6.1; the guide is docs/guides/coming-from-tinker.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

from grpo_plugins.tinker.engines import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    ENGINES,
    EngineSampler,
    engine_plan,
)

from grpo_core import hookimpl
from grpo_core.errors import UsageError

__all__ = ["configure", "register_commands", "run"]

DESCRIPTION = (
    "Serve the Tinker API (the official tinker SDK's routes, protobuf and futures) on one local base model: "
    "LoRA training clients, Tinker's losses, Adam steps, checkpoints and sampling, trained by grpo-core. "
    "Point the SDK at it: ServiceClient(base_url='http://HOST:PORT', api_key=KEY)."
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="PATH", help="the base model: a local transformers folder")
    parser.add_argument("--name", default=None, help="the name clients give as base_model (default: --model as given)")
    parser.add_argument("--api-key", dest="api_keys", action="append", default=[], metavar="KEY",
                        help="an accepted API key (starts with tml-, as the SDK requires); repeatable; default: "
                        "$TINKER_API_KEY")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free one)")
    parser.add_argument("--state-dir", default="tinker-state", help="where checkpoints go (default ./tinker-state)")
    parser.add_argument("--max-request-bytes", type=int, default=64 << 20, help="largest request body (64 MiB)")
    parser.add_argument("--rollout", choices=ENGINES, default="hf",
                        help="what samples: hf (the served model itself; default), vllm (a vLLM engine in this "
                        "process) or vllm-server (grpo-run serve servers, --server); vLLM gets each sampler snapshot "
                        "as a LoRA adapter")
    parser.add_argument("--server", dest="servers", action="append", default=[], metavar="URL",
                        help="a rollout server for --rollout vllm-server (repeatable), started with "
                        "grpo-run serve MODEL -- --enable-lora --max-lora-rank R --max-loras N")
    parser.add_argument("--rollout-option", dest="rollout_options", action="append", default=[],
                        metavar="KEY=VALUE", help="an option of the vllm or vllm-server backend, as the spec's "
                        "rollout section spells it (e.g. max_model_len=4096, dtype=bfloat16); repeatable")
    parser.add_argument("--max-lora-rank", type=int, default=DEFAULT_MAX_LORA_RANK,
                        help="the largest LoRA rank a training client may ask for with a vLLM engine "
                        f"(default {DEFAULT_MAX_LORA_RANK})")
    parser.add_argument("--max-loras", type=int, default=DEFAULT_MAX_LORAS,
                        help="sampler snapshots a vLLM engine holds at once, the reserved base adapter included "
                        f"(default {DEFAULT_MAX_LORAS}); the least recently pushed is dropped first")
    parser.add_argument("--mlflow", default=None, metavar="EXPERIMENT",
                        help="log each training client's calls to this MLflow experiment (MLFLOW_TRACKING_URI "
                        "says where); default: no tracking")


def start(args: argparse.Namespace):
    """The running :class:`~grpo_plugins.tinker.server.TinkerServer` for parsed ``args``."""
    from grpo_plugins.tinker.server import TinkerServer
    from grpo_plugins.tinker.state import Service
    from grpo_plugins.tinker.tracking import MLflowClients

    keys = set(args.api_keys) or ({os.environ["TINKER_API_KEY"]} if os.environ.get("TINKER_API_KEY") else set())
    if not keys:
        raise UsageError("tinker-serve needs an API key: --api-key tml-... (or TINKER_API_KEY)")
    bad = sorted(k for k in keys if not k.startswith("tml-"))
    if bad:
        raise UsageError(f"API keys must start with tml- (the tinker SDK refuses others); got {bad}")
    plan = engine_plan(args)
    tracker = MLflowClients(args.mlflow) if args.mlflow else None
    service = Service(args.model, args.state_dir, name=args.name, tracker=tracker)
    if plan is not None:
        service.engine = EngineSampler(service, plan)
        service.engine.start()
    return TinkerServer(service, keys, args.host, args.port, args.max_request_bytes)


def run(args: argparse.Namespace) -> int:
    try:
        import tinker  # noqa: F401  (its protobuf schema is the wire contract)
    except ImportError:
        raise UsageError("tinker-serve needs the tinker SDK (its protobuf schema): pip install 'grpo-core[tinker]'") \
            from None
    server = start(args)
    print(f"tinker-serve: {server.service.name} on {server.base_url}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.close()
    return 0


@hookimpl
def register_commands(register) -> None:
    register.add("tinker-serve", help="serve the Tinker API (tinker SDK, tinker-cookbook) on a local model, "
                 "trained by grpo-core", description=DESCRIPTION, configure=configure, run=run)
