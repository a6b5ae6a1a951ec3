"""``grpo-run serve``, the command the vLLM plugins register: vLLM's server with the weight channel,
what follows ``--`` passed to vLLM (except the flags serve sets itself), ``--dry-run``, the port."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from grpo_plugins.vllm.serve import WORKER_EXTENSION, serve_command

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
                              python="py")
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.launchers.api_server.entry"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--model"] == "m" and flags["--port"] == "8011" and flags["--dtype"] == "float32"
    assert flags["--worker-extension-cls"] == WORKER_EXTENSION
    assert json.loads(flags["--weight-transfer-config"]) == {"backend": "grpo_torch"}
    assert flags["--logprobs-mode"] == "processed_logprobs"
    assert argv[-2:] == ["--max-num-seqs", "8"]
    assert env == {"VLLM_SERVER_DEV_MODE": "1"}


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
