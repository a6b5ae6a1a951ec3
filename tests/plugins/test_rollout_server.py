"""The ``vllm-server`` rollout backend's pure pieces, in the main environment (no vLLM):
registration and option validation (spec paths, what is valid), the split of a step's
prompts over servers, the failover bookkeeping and its error, the ``/v1/completions``
request and answer conversion, the weight channel (a real gloo group of two members in this
process), request bounds against real sockets on 127.0.0.1 (refused, never answering), and
``grpo-run serve``'s command line.

The servers themselves (vLLM, the weight push, failover of a real server, a run) are tested
in ``tests/vllm/test_servers.py`` (marker ``vllm``).
"""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import socket
import sys
import threading
import time

import pytest
import torch
from grpo_plugins.rollout_server import Failover, VLLMServerOptions, VLLMServerRollout, assign_prompts, check_url
from grpo_plugins.server_client import ServerClient, ServerFault, completion_body, to_outputs
from grpo_plugins.vllm_io import outputs_to_batch, sampling_kwargs
from grpo_plugins.vllm_serve import WORKER_EXTENSION, serve_command
from grpo_plugins.weight_channel import open_group, receive_tensors, send_tensors, update_info
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_core.cli import main
from grpo_core.commands import command_parser, split_passthrough
from grpo_core.contracts import RolloutBackend, SamplingParams
from grpo_core.errors import RunError
from grpo_core.plugin_manager import load_plugins
from grpo_core.testing import build_model, build_tokenizer


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------- registration, options
def test_registered_as_a_builtin_without_importing_vllm():
    plugins = load_plugins(external=False)
    component = plugins.registry.get("rollout_backend", "vllm-server")
    assert component.plugin == "grpo_plugins.rollout_server"
    assert component.impl is VLLMServerRollout and component.options is VLLMServerOptions
    assert isinstance(VLLMServerRollout(VLLMServerOptions(urls=["http://127.0.0.1:1"])), RolloutBackend)
    assert "vllm" not in sys.modules  # the learner's side needs requests and torch only


def test_option_defaults():
    options = VLLMServerOptions(urls=["http://10.0.0.2:8000/"])
    assert options.urls == ["http://10.0.0.2:8000"]
    assert (options.timeout_s, options.retries, options.push_every) == (120.0, 2, 1)
    assert (options.weight_backend, options.weight_host, options.weight_port) == ("auto", None, 0)


@pytest.mark.parametrize(
    ("values", "field", "says"),
    [
        ({"urls": []}, "urls", "at least 1"),
        ({"urls": ["localhost:8000"]}, "urls", "write http://HOST:PORT"),
        ({"urls": ["http://127.0.0.1"]}, "urls", "write http://HOST:PORT"),
        ({"urls": ["ftp://127.0.0.1:21"]}, "urls", "write http://HOST:PORT"),
        ({"urls": ["http://a:1", "http://a:1/"]}, "urls", "http://a:1 is listed more than once"),
        ({"urls": ["http://a:1"], "push_every": 0}, "push_every", "greater than or equal to 1"),
        ({"urls": ["http://a:1"], "timeout_s": 0}, "timeout_s", "greater than 0"),
        ({"urls": ["http://a:1"], "timeout_s": float("inf")}, "timeout_s", "finite"),
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


def test_check_url_keeps_a_path_prefix_and_refuses_a_query():
    assert check_url("https://h.example:443/vllm/") == "https://h.example:443/vllm"
    with pytest.raises(ValueError, match="write http://HOST:PORT"):
        check_url("http://h:80/?x=1")


def test_cli_validate_reports_the_yaml_path(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {path: some/model}\nrewards: [{name: accuracy}]\n"
                    "rollout: {name: vllm-server, urls: [localhost]}\n")
    code, out, err = cli("validate", spec)
    assert code == 2 and out == ""
    assert "spec.rollout.urls" in err and "write http://HOST:PORT" in err, err


# --------------------------------------------------------------------------- splitting, failover
@given(st.integers(0, 200), st.integers(1, 17))
def test_assign_prompts_gives_contiguous_near_equal_parts(n_prompts, n_servers):
    owners = assign_prompts(n_prompts, n_servers)
    assert len(owners) == n_prompts
    assert owners == sorted(owners)  # contiguous, in server order
    sizes = [owners.count(s) for s in range(n_servers)]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the larger parts first


def test_assign_prompts_exact_case():
    assert assign_prompts(7, 3) == [0, 0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="at least one server"):
        assign_prompts(3, 0)


def test_failover_moves_a_dropped_servers_prompts_to_the_live_ones_in_turn():
    urls = ["http://a:1", "http://b:2", "http://c:3"]
    failover = Failover(urls)
    failover.drop("http://b:2", "ConnectTimeout: refused")
    failover.drop("http://b:2", "a second reason is not recorded")
    assert failover.live() == ["http://a:1", "http://c:3"]
    assert failover.reassign([4, 5, 6]) == {4: "http://a:1", 5: "http://c:3", 6: "http://a:1"}
    failover.drop("http://a:1", "HTTP 500")
    failover.drop("http://c:3", "timed out")
    with pytest.raises(RunError) as info:
        failover.reassign([4])
    message = str(info.value)
    assert message == ("vllm-server rollout: no rollout server is left (http://a:1: HTTP 500; "
                       "http://b:2: ConnectTimeout: refused; http://c:3: timed out)")


# --------------------------------------------------------------------------- requests and answers
def test_completion_body_is_the_colocated_backends_sampling_plus_token_ids():
    sampling = SamplingParams(max_new_tokens=5, temperature=0.7, top_k=4, stop=("\n",), seed=3)
    body = completion_body([1, 2, 3], 4, sampling, [0], 99, "m")
    expected = sampling_kwargs(sampling, 4, [0], 99)
    assert {k: body[k] for k in expected} == expected
    assert body["prompt"] == [1, 2, 3] and body["model"] == "m" and body["return_token_ids"] is True
    assert body["n"] == 4 and body["seed"] == 99 and body["logprobs"] == 0
    json.dumps(body)  # it travels as JSON


def test_an_answer_becomes_the_batch_outputs_to_batch_makes():
    answer = {"choices": [
        {"index": 1, "text": "b", "token_ids": [7, 0], "finish_reason": "stop",
         "logprobs": {"token_logprobs": [-0.5, -0.25]}},
        {"index": 0, "text": "a", "token_ids": [5, 6, 8], "finish_reason": "length",
         "logprobs": {"token_logprobs": [-1.0, -2.0, -3.0]}},
    ]}
    batch = outputs_to_batch([to_outputs(answer, "x")], [[1, 2]], 2, pad_id=9, eos_ids=[0], max_new_tokens=3)
    assert batch.completion_ids.tolist() == [[5, 6, 8], [7, 0, 9]]
    assert batch.completion_mask.tolist() == [[True, True, True], [True, True, False]]
    assert batch.truncated.tolist() == [True, False]
    assert batch.sampling_logp.tolist() == [[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0]]


def test_an_answer_without_token_ids_names_the_server():
    with pytest.raises(ServerFault, match="http://a:1: the answer has no token_ids"):
        to_outputs({"choices": [{"index": 0, "text": "x"}]}, "http://a:1")


# --------------------------------------------------------------------------- faults on real sockets
def test_a_refused_server_fails_after_its_retries_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = ServerClient(url, timeout_s=2, retries=2, backoff_s=0.05)
    start = time.monotonic()
    with pytest.raises(ServerFault) as info:
        client.call("GET", "/health")
    assert f"GET {url}/health failed after 3 attempt(s): ConnectionRefusedError" in str(info.value)
    assert time.monotonic() - start < 10


def test_a_server_that_never_answers_times_out_within_the_bound():
    """A socket that accepts connections and never answers (a hung server)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        client = ServerClient(url, timeout_s=0.5, retries=1, backoff_s=0.05)
        start = time.monotonic()
        with pytest.raises(ServerFault, match="failed after 2 attempt.s.: TimeoutError: timed out"):
            client.call("POST", "/v1/completions", {"prompt": [1]})
        assert time.monotonic() - start < 5


class _PlainOpenAIServer(http.server.BaseHTTPRequestHandler):
    """An OpenAI-style server without vLLM's development routes (as a plain ``vllm serve``)."""

    answers = {"/v1/models": {"data": [{"id": "m"}]}, "/weight_info": {"weight_version": "run/3"}}

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = json.dumps(self.answers[self.path]).encode() if self.path in self.answers else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_server_without_the_weight_channel_is_refused_with_what_to_start():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PlainOpenAIServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(ServerFault) as info:
            ServerClient(url, timeout_s=5, retries=0).connect()
        assert f"POST {url}/collective_rpc failed after 1 attempt(s): HTTP 404" in str(info.value)
        assert "is it a grpo-run serve server?" in str(info.value)
        rollout = VLLMServerRollout(VLLMServerOptions(urls=[url], retries=0, timeout_s=5))
        with pytest.raises(RunError, match=f"no rollout server is left \\({url}: did not answer as a grpo-run"):
            tokenizer = build_tokenizer()
            rollout.setup(build_model(tokenizer), tokenizer)
    finally:
        server.shutdown()
        server.server_close()


def test_another_process_waits_for_the_pushed_weight_version_within_the_bound():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PlainOpenAIServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = ServerClient(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=5, retries=0)
        client.wait_for_version("run/3", timeout_s=1)
        start = time.monotonic()
        with pytest.raises(ServerFault, match="still holds weight version 'run/3', not 'run/4', after 0.3 s"):
            client.wait_for_version("run/4", timeout_s=0.3)
        assert time.monotonic() - start < 3
    finally:
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------- weight channel
def test_the_weight_channel_carries_every_tensor_exactly():
    """A real gloo group of two members (the learner, rank 0, and one receiver), as a server's
    worker joins it: the payload describes the tensors, the receiver gets them bit for bit."""
    weights = [("a.weight", torch.randn(3, 4)), ("b.bias", torch.arange(5, dtype=torch.float64)),
               ("c.idx", torch.tensor([1, 2], dtype=torch.int64)), ("d", torch.randn(2, 3).T)]
    info = update_info(weights)
    assert info == {"names": ["a.weight", "b.bias", "c.idx", "d"],
                    "dtype_names": ["float32", "float64", "int64", "float32"],
                    "shapes": [[3, 4], [5], [2], [3, 2]]}
    port, got, errors = free_port(), [], []

    def receiver():
        try:
            group = open_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=30)
            got.extend(receive_tensors(group, json.loads(json.dumps(info)), "cpu"))
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=receiver)
    thread.start()
    group = open_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=30)
    send_tensors(group, (t for _, t in weights))
    thread.join(30)
    assert not errors and not thread.is_alive()
    assert [n for n, _ in got] == info["names"]
    for (_, sent), (_, received) in zip(weights, got, strict=True):
        assert received.dtype == sent.dtype and torch.equal(received, sent)


def test_the_weight_channel_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of gloo, nccl, got 'mpi'"):
        open_group("127.0.0.1", 1, 0, 2, "mpi")


# --------------------------------------------------------------------------- grpo-run serve
def _serve_args(*argv):
    """``grpo-run serve ARGV`` parsed as the CLI parses it: the registered command's parser,
    what follows ``--`` left in ``args.passthrough``."""
    command = load_plugins(external=False).commands["serve"]
    own, extra = split_passthrough(list(argv))
    args = command_parser(command).parse_args(own)
    args.passthrough = extra
    return args


def test_serve_starts_vllms_server_with_the_weight_channel():
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
