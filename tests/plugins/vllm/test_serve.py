"""``grpo-run serve``, the command the vLLM plugins register: vLLM's server with the weight channel,
what follows ``--`` passed to vLLM (except the flags serve sets itself), ``--dry-run``, the port;
the shared secret that guards its routes (required beyond loopback) and the guard itself."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from grpo_plugins.vllm.serve import GUARD, WORKER_EXTENSION, serve_command

from grpo_core.cli import main
from grpo_core.commands import command_parser, split_passthrough
from grpo_core.plugin_manager import load_plugins


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def _serve_args(*argv):
    """``grpo-run serve ARGV`` parsed as the CLI parses it: the registered command's parser,
    what follows ``--`` left in ``args.passthrough``."""
    command = load_plugins(external=False).commands["serve"]
    own, extra = split_passthrough(list(argv))
    args = command_parser(command).parse_args(own)
    args.passthrough = extra
    return args


def test_serve_starts_vllms_server_ready_for_weight_pushes():
    argv, env = serve_command(_serve_args("m", "--port", "8011", "--dtype", "float32", "--", "--max-num-seqs", "8"),
                              python="py", environ={})
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.launchers.api_server.entry"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--model"] == "m" and flags["--port"] == "8011" and flags["--dtype"] == "float32"
    assert flags["--worker-extension-cls"] == WORKER_EXTENSION
    assert json.loads(flags["--weight-transfer-config"]) == {"backend": "grpo_torch"}
    assert flags["--logprobs-mode"] == "processed_logprobs"
    assert argv[-2:] == ["--max-num-seqs", "8"]
    assert env == {"VLLM_SERVER_DEV_MODE": "1"}


@pytest.mark.parametrize("lora", [["--enable-lora"], ["--enable-lora=true", "--max-lora-rank", "8"]])
def test_serve_with_lora_loads_adapters_at_run_time(lora):
    """vLLM serves /v1/load_lora_adapter (the adapter-only pushes') only with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING; serve sets it with --enable-lora, and only then."""
    argv, env = serve_command(_serve_args("m", "--", *lora), python="py", environ={})
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    assert argv[-len(lora):] == lora


@pytest.mark.parametrize("flag", ["--port", "--worker-extension-cls=x", "--model"])
def test_serve_refuses_vllm_flags_it_sets_itself(flag):
    code, _, err = cli("serve", "m", "--", flag, "1")
    assert code == 2
    assert f"serve: {flag.split('=')[0]} is set by grpo-run serve itself" in err


def test_serve_dry_run_prints_the_command():
    code, out, _ = cli("serve", "some/model", "--port", "8123", "--dry-run", "--", "--max-num-seqs", "4")
    assert code == 0
    assert out.startswith("VLLM_SERVER_DEV_MODE=1 ") and "--port 8123" in out and out.rstrip().endswith("4")


def test_serve_refuses_a_port_out_of_range():
    code, _, err = cli("serve", "some/model", "--port", "70000", "--dry-run")
    assert code == 2 and "serve: --port must be in 1..65535, got 70000" in err


# --------------------------------------------------------------------------- the shared secret (issue 34, item 9)
def test_serve_refuses_to_bind_beyond_loopback_without_a_secret(monkeypatch):
    """Before: ``--host 0.0.0.0`` started with no warning, the weight routes open to anyone who
    reached the port."""
    monkeypatch.delenv("GRPO_SERVE_SECRET", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    code, out, err = cli("serve", "some/model", "--host", "0.0.0.0", "--dry-run")
    assert code == 2 and out == ""
    assert "serve: --host 0.0.0.0 reaches beyond this machine" in err
    assert "export GRPO_SERVE_SECRET=" in err and "--trusted-network" in err
    code, out, _ = cli("serve", "some/model", "--host", "0.0.0.0", "--trusted-network", "--dry-run")
    assert code == 0 and "--middleware" not in out  # the user says only the learner reaches it


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_serve_on_loopback_needs_no_secret(host):
    argv, env = serve_command(_serve_args("m", "--host", host), environ={})
    assert "--middleware" not in argv and env == {"VLLM_SERVER_DEV_MODE": "1"}


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "gpu-node-3"])
def test_serve_with_a_secret_guards_every_route(host):
    argv, env = serve_command(_serve_args("m", "--host", host), environ={"GRPO_SERVE_SECRET": "s3cret"})
    assert argv[argv.index("--middleware") + 1] == GUARD == "grpo_plugins.vllm.guard.SharedSecret"
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "GRPO_SERVE_SECRET": "s3cret"}


def test_vllms_own_api_key_is_the_secret_the_learner_sends():
    """vLLM's ``--api-key`` checks only /v1 and a few other prefixes: it becomes the secret that
    guards every route, and one value serves both checks."""
    argv, env = serve_command(_serve_args("m", "--host", "0.0.0.0", "--", "--api-key", "k1"), environ={})
    assert env["GRPO_SERVE_SECRET"] == "k1" and GUARD in argv and argv[-2:] == ["--api-key", "k1"]
    _, env = serve_command(_serve_args("m", "--host", "0.0.0.0"), environ={"VLLM_API_KEY": "k2"})
    assert env["GRPO_SERVE_SECRET"] == "k2"
    same = {"GRPO_SERVE_SECRET": "k3"}
    assert serve_command(_serve_args("m", "--", "--api-key=k3"), environ=same)[1]["GRPO_SERVE_SECRET"] == "k3"
    with pytest.raises(ValueError, match="GRPO_SERVE_SECRET and vLLM's API key .* differ"):
        serve_command(_serve_args("m", "--", "--api-key", "other"), environ=same)
    with pytest.raises(ValueError, match="vLLM got 2 API keys; set GRPO_SERVE_SECRET"):
        serve_command(_serve_args("m", "--", "--api-key", "a", "b"), environ={})


def test_serve_dry_run_never_prints_the_secret(monkeypatch):
    monkeypatch.setenv("GRPO_SERVE_SECRET", "do-not-print-me")
    code, out, _ = cli("serve", "some/model", "--host", "0.0.0.0", "--dry-run", "--", "--api-key", "do-not-print-me")
    assert code == 0 and "do-not-print-me" not in out
    assert "GRPO_SERVE_SECRET=<secret>" in out and "--api-key '<secret>'" in out


def _asgi(guard, scope: dict) -> list[dict]:
    """The messages ``guard`` sends for one request of ``scope``, its app answering 200 "ok"."""
    import asyncio

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    asyncio.run(guard(scope, receive, send))
    return sent


async def _app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize(("path", "method", "header", "status"), [
    ("/update_weights", "POST", None, 401),
    ("/init_weight_transfer_engine", "POST", b"Bearer wrong", 401),
    ("/collective_rpc", "POST", b"Basic s3cret", 401),
    ("/v1/completions", "POST", None, 401),
    ("/metrics", "GET", None, 401),
    ("/update_weights", "POST", b"Bearer s3cret", 200),
    ("/v1/completions", "POST", b"bearer s3cret", 200),
    ("/health", "GET", None, 200),
    ("/update_weights", "OPTIONS", None, 200),  # a CORS pre-flight: the request itself is checked
])
def test_the_guard_lets_through_only_requests_with_the_secret(path, method, header, status):
    from grpo_plugins.vllm.guard import SharedSecret

    headers = [(b"authorization", header)] if header is not None else []
    sent = _asgi(SharedSecret(_app, secret="s3cret"), {"type": "http", "path": path, "method": method,
                                                        "headers": headers})
    assert sent[0]["status"] == status
    if status == 401:
        assert b"shared secret" in sent[1]["body"]


def test_the_guard_closes_a_websocket_without_the_secret_and_needs_a_secret_to_start(monkeypatch):
    from grpo_plugins.vllm.guard import SharedSecret

    sent = _asgi(SharedSecret(_app, secret="s"), {"type": "websocket", "path": "/v1/realtime", "headers": []})
    assert sent == [{"type": "websocket.close", "code": 1008}]
    monkeypatch.delenv("GRPO_SERVE_SECRET", raising=False)
    with pytest.raises(RuntimeError, match="needs GRPO_SERVE_SECRET to be set"):
        SharedSecret(_app)
    monkeypatch.setenv("GRPO_SERVE_SECRET", "from-env")
    assert _asgi(SharedSecret(_app), {"type": "http", "path": "/x", "method": "GET",
                                      "headers": [(b"authorization", b"Bearer from-env")]})[0]["status"] == 200
