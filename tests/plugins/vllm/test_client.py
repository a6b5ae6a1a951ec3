"""The HTTP client of one rollout server, on real sockets: retries and their bound against a refused
or a hung server, an answer without token ids, a server that is not ``grpo-run serve``'s, and
the wait for another process's push."""

from __future__ import annotations

import http.server
import socket
import threading
import time

import pytest
from grpo_plugins.vllm.client import Expected, InvalidAnswer, ServerClient, ServerFault, to_outputs

from .conftest import PlainOpenAIServer, free_port


def test_an_answer_without_token_ids_says_so():
    with pytest.raises(InvalidAnswer, match=r"completion 0 has no token_ids \(a vLLM older than 0.10.2\?\)"):
        to_outputs({"choices": [{"index": 0, "text": "x"}]}, Expected(n=1, max_tokens=4, vocab_size=10))


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
        with pytest.raises(ServerFault, match=r"failed after 2 attempt\(s\): timed out after 0.5 s"):
            client.call("POST", "/v1/completions", {"prompt": [1]})
        assert time.monotonic() - start < 5


def test_another_process_waits_for_the_pushed_weight_version_within_the_bound():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), PlainOpenAIServer)
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
