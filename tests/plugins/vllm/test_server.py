"""The ``vllm-server`` rollout backend's pure pieces, in the main environment (no vLLM):
registration and options, and a server that is not a ``grpo-run serve`` one (the split of a
step's prompts over servers and the failover bookkeeping: tests/plugins/rollout/test_servers.py).

The servers themselves (vLLM, the weight push, failover of a real server, a run) are tested in
``tests/vllm/test_servers.py`` (marker ``vllm``)."""

from __future__ import annotations

import contextlib
import http.server
import io
import sys
import threading

import pytest
from grpo_plugins.vllm.client import ServerClient, ServerFault
from grpo_plugins.vllm.server import VLLMServerOptions, VLLMServerRollout
from pydantic import ValidationError

from grpo_core.cli import main
from grpo_core.contracts import RolloutBackend, RolloutSetup
from grpo_core.errors import RunError
from grpo_core.plugin_manager import load_plugins
from grpo_core.testing import build_model, build_tokenizer

from .conftest import PlainOpenAIServer


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def test_registered_as_a_builtin_without_importing_vllm():
    plugins = load_plugins(external=False)
    component = plugins.registry.get("rollout_backend", "vllm-server")
    assert component.plugin == "grpo_plugins.vllm.server"
    assert component.impl is VLLMServerRollout and component.options is VLLMServerOptions
    assert isinstance(VLLMServerRollout(VLLMServerOptions(urls=["http://127.0.0.1:1"])), RolloutBackend)
    assert "vllm" not in sys.modules  # the learner's side needs requests and torch only


def test_option_defaults():
    options = VLLMServerOptions(urls=["http://10.0.0.2:8000/"])
    assert options.urls == ["http://10.0.0.2:8000"]
    assert (options.timeout_s, options.retries, options.push_every) == (120.0, 2, 1)
    assert (options.weight_backend, options.weight_host, options.weight_port) == ("auto", None, 0)
    assert options.lora_push == "auto" and options.push_bucket_mb == 512.0


@pytest.mark.parametrize(
    ("values", "field", "says"),
    [
        ({"urls": []}, "urls", "no rollout server: list each one's URL here"),
        ({}, "urls", "or let the launcher place them: grpo-run run SPEC --launcher ray --launcher-option servers=N"),
        ({"urls": ["localhost:8000"]}, "urls", "write http://HOST:PORT"),
        ({"urls": ["http://127.0.0.1"]}, "urls", "write http://HOST:PORT"),
        ({"urls": ["ftp://127.0.0.1:21"]}, "urls", "write http://HOST:PORT"),
        ({"urls": ["http://a:1", "http://a:1/"]}, "urls", "http://a:1 is listed more than once"),
        ({"urls": ["http://a:1"], "push_every": 0}, "push_every", "greater than or equal to 1"),
        ({"urls": ["http://a:1"], "timeout_s": 0}, "timeout_s", "greater than 0"),
        ({"urls": ["http://a:1"], "timeout_s": float("inf")}, "timeout_s", "finite"),
        ({"urls": ["http://a:1"], "timeout_s": 1e30}, "timeout_s", "at most 31536000 seconds (365 days), got 1e+30"),
        ({"urls": ["http://a:1"], "secret_env": ""}, "secret_env", "at least 1 character"),
        ({"urls": ["http://a:1"], "retries": -1}, "retries", "greater than or equal to 0"),
        ({"urls": ["http://a:1"], "weight_backend": "mpi"}, "weight_backend", "'auto', 'gloo' or 'nccl'"),
        ({"urls": ["http://a:1"], "weight_port": 70000}, "weight_port", "less than or equal to 65535"),
        ({"urls": ["http://a:1"], "url": "http://b:2"}, "url", "Extra inputs are not permitted"),
    ],
)
def test_invalid_option_names_its_field_and_what_is_valid(values, field, says):
    with pytest.raises(ValidationError) as info:
        VLLMServerOptions(**values)
    (error,) = info.value.errors()
    assert error["loc"][0] == field
    assert says in error["msg"], error["msg"]


def test_every_bad_url_is_reported():
    with pytest.raises(ValidationError) as info:
        VLLMServerOptions(urls=["localhost:8000", "http://ok:1", "ftp://x:21"])
    assert [(e["loc"], "write http://HOST:PORT" in e["msg"]) for e in info.value.errors()] == [
        (("urls", 0), True), (("urls", 2), True)]


def test_cli_validate_reports_the_yaml_path(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {path: some/model}\nrewards: [{name: accuracy}]\n"
                    "rollout: {name: vllm-server, urls: [localhost]}\n")
    code, out, err = cli("validate", spec)
    assert code == 2 and out == ""
    assert "spec.rollout.urls" in err and "write http://HOST:PORT" in err, err


def test_the_servers_a_launcher_places_stand_for_rollout_urls(tmp_path):
    """With a launcher that places rollout servers (ray's servers=N) the spec names no URL, and
    the ranks get theirs (with the secret's variable and the weight host) as overrides, which
    the ranks' own validation (no launcher) accepts; URLs in the spec as well are refused, and
    so, before any process starts, is a backend that takes no server URLs."""
    from grpo_plugins.launchers.placement import Node, plan
    from grpo_plugins.launchers.ray import _check_rank_spec

    from grpo_core.contracts import RunArguments
    from grpo_core.errors import SpecError
    from grpo_core.launching import build_launcher
    from grpo_core.spec import load_spec

    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {path: some/model}\nrewards: [{name: accuracy}]\nrollout: {name: vllm-server}\n")
    code, _, err = cli("validate", spec)
    assert code == 2 and "spec.rollout.urls" in err and "--launcher-option servers=N" in err, err
    with pytest.raises(SpecError, match="no rollout server"):  # local places none
        load_spec(spec, launcher=lambda registry: build_launcher(registry, "local", {}))
    loaded = load_spec(spec, launcher=lambda registry: build_launcher(registry, "ray", {"servers": 2}))
    assert loaded.launcher.rollout_servers == 2 and loaded.spec.rollout.options.urls == []
    with pytest.raises(SpecError, match="the launcher places 2 rollout server.s. of its own"):
        load_spec(spec, ['rollout.urls=["http://a:1"]'],
                  launcher=lambda registry: build_launcher(registry, "ray", {"servers": 2}))
    ports = iter(range(8000, 8010))
    placed = plan(2, [Node("10.0.0.1", 2), Node("10.0.0.2", 2)], servers=2, port_on=lambda _: next(ports), secret="s")
    run = RunArguments(spec=str(spec), overrides=(), resume=None, nproc=2, run_folder=str(tmp_path / "out"))
    _check_rank_spec(run, placed)  # what every rank will validate
    ranks = load_spec(spec, placed.overrides()).spec.rollout.options
    assert ranks.urls == ["http://10.0.0.2:8001", "http://10.0.0.2:8002"]  # 8000: the rendezvous
    assert (ranks.secret_env, ranks.weight_host) == ("GRPO_SERVE_SECRET", "10.0.0.1")
    spec.write_text("model: {path: some/model}\nrewards: [{name: accuracy}]\nrollout: {name: hf}\n")
    with pytest.raises(RunError, match="servers=2: the ranks' spec, with the servers handed to its rollout backend"):
        _check_rank_spec(run, placed)


def test_a_plain_openai_server_is_refused_with_what_to_start():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), PlainOpenAIServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(ServerFault) as info:
            ServerClient(url, timeout_s=5, retries=0).connect()
        assert f"POST {url}/collective_rpc answered HTTP 404" in str(info.value)
        assert "is it a grpo-run serve server?" in str(info.value)
        rollout = VLLMServerRollout(VLLMServerOptions(urls=[url], retries=0, timeout_s=5))
        with pytest.raises(RunError, match=f"no rollout server is left \\({url}: did not answer as a grpo-run"):
            tokenizer = build_tokenizer()
            rollout.setup(RolloutSetup(build_model(tokenizer), tokenizer))
    finally:
        server.shutdown()
        server.server_close()
