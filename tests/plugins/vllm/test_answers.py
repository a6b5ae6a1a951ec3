"""A rollout server is not trusted (issue 34, items 1-7): every answer is checked against its
request before it enters a batch, and every read is bounded. Imitation ``grpo-run serve``
servers on 127.0.0.1 (``FakeServe``: the real weight channel, answers made by each test), the
real ``vllm-server`` backend, each test bounded in time.

What a user saw before: a wrong number of completions was a ``ValueError`` naming no server, out
of vocabulary ids an ``IndexError`` steps later, NaN or positive log-probs trained on silently, a
short log-prob list a ``zip()`` error, a redirect followed (another server's answer trained on), a
400 MB answer read whole, a dripping answer holding the run for ever."""

from __future__ import annotations

import json
import math
import time

import pytest
from grpo_plugins.vllm.server import VLLMServerOptions, VLLMServerRollout

from grpo_core.contracts import RolloutSetup, SamplingParams
from grpo_core.errors import RunError

from .conftest import good_answer

SAMPLING = SamplingParams(max_new_tokens=4, seed=5)
G = 2


def rollout_on(urls: list[str], model, tokenizer, **options) -> VLLMServerRollout:
    defaults = {"timeout_s": 5, "retries": 1}
    rollout = VLLMServerRollout(VLLMServerOptions(urls=urls, **{**defaults, **options}))
    for client in rollout.clients.values():
        client.backoff_s = 0.01
    rollout.setup(RolloutSetup(model, tokenizer))
    return rollout


def corrupted(change):
    """A handler answering :func:`good_answer` changed by ``change(answer)``."""

    def handle(handler, body):
        answer = good_answer(body)
        change(answer)
        data = json.dumps(answer).encode()  # NaN and Infinity as Python writes them
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    return handle


def _set(path, value):
    def change(answer):
        target = answer["choices"]
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


BAD_ANSWERS = {
    "fewer completions": (lambda a: a["choices"].pop(), "1 completion(s) for a request of n=2"),
    "more completions": (lambda a: a["choices"].append(a["choices"][0]), "3 completion(s) for a request of n=2"),
    "id above the vocabulary": (_set((0, "token_ids", 1), 5320), "completion 0 has token id 5320 at position 1, "
                                "outside the policy's vocabulary (0 .. 319)"),
    "negative id": (_set((1, "token_ids", 0), -3), "completion 1 has token id -3 at position 0"),
    "NaN log-prob": (_set((0, "logprobs", "token_logprobs", 2), math.nan), "completion 0 has log-prob nan at "
                     "position 2; a log-prob is a finite number <= 0"),
    "infinite log-prob": (_set((0, "logprobs", "token_logprobs", 0), math.inf), "log-prob inf at position 0"),
    "positive log-prob": (_set((1, "logprobs", "token_logprobs", 3), 0.5), "completion 1 has log-prob 0.5"),
    "short log-prob list": (_set((0, "logprobs", "token_logprobs"), [-0.5]), "completion 0 has 1 log-probs for "
                            "4 tokens"),
    "no log-probs": (_set((0, "logprobs"), None), "completion 0 has no token_logprobs"),
    "more tokens than asked": (_set((0, "token_ids"), [2] * 9), "completion 0 has 9 tokens, more than the 4 asked"),
    "an index twice": (_set((1, "index"), 0), "completion indices [0, 0]; expected 0 .. 1 once each"),
    "not JSON": (None, "answered a body that is not JSON: 'not json'"),
}


def _handler(kind):
    change, _ = BAD_ANSWERS[kind]
    if change is None:
        def handle(handler, body):
            handler.send_response(200)
            handler.send_header("Content-Length", "8")
            handler.end_headers()
            handler.wfile.write(b"not json")
        return handle
    return corrupted(change)


@pytest.mark.parametrize("kind", sorted(BAD_ANSWERS))
def test_a_bad_answer_is_retried_then_a_run_error_naming_the_server_and_what_was_wrong(
        serve, model, tokenizer, prompts, kind):
    bad = serve(_handler(kind))
    rollout = rollout_on([bad.url], model, tokenizer, retries=1)
    with pytest.raises(RunError) as info:
        rollout.generate(prompts[:1], G, SAMPLING)
    message = str(info.value)
    assert message.startswith(f"vllm-server rollout: no rollout server is left ({bad.url}: POST "
                              f"{bad.url}/v1/completions failed after 2 attempt(s): "), message
    assert BAD_ANSWERS[kind][1] in message, message
    assert bad.completions_asked() == 2  # retried once, as any failure of that server


def test_a_bad_answer_moves_the_servers_prompts_to_a_live_one(serve, model, tokenizer, prompts):
    bad, good = serve(_handler("id above the vocabulary")), serve()
    rollout = rollout_on([bad.url, good.url], model, tokenizer, retries=0)
    batch = rollout.generate(prompts, G, SAMPLING)
    assert batch.completion_ids.shape == (len(prompts) * G, SAMPLING.max_new_tokens)
    assert int(batch.completion_ids.max()) < 320
    assert bool((batch.sampling_logp < 0).all())
    assert list(rollout.failover.dropped) == [bad.url]
    assert "token id 5320" in rollout.failover.dropped[bad.url]
    assert good.completions_asked() == len(prompts)  # its own prompts and the bad server's


def _redirect_to(target):
    def handle(handler, body):
        handler.send_response(302)
        handler.send_header("Location", target.url + "/v1/completions")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return handle


def test_a_redirect_is_not_followed(serve, model, tokenizer, prompts):
    elsewhere = serve()  # another server (another port) that would answer
    home = serve(_redirect_to(elsewhere))
    rollout = rollout_on([home.url], model, tokenizer, retries=2)
    with pytest.raises(RunError) as info:
        rollout.generate(prompts[:1], G, SAMPLING)
    assert (f"POST {home.url}/v1/completions answered HTTP 302 Found, a redirect to "
            f"'{elsewhere.url}/v1/completions'; redirects are not followed") in str(info.value)
    assert elsewhere.completions_asked() == 0
    assert home.completions_asked() == 1  # not retried: asking again cannot help


def _declares(size: int):
    def handle(handler, body):
        handler.send_response(200)
        handler.send_header("Content-Length", str(size))
        handler.end_headers()
        handler.wfile.write(b'{"choices": [')
        time.sleep(5)  # the rest never comes: a client that waits for it is stuck

    return handle


def _endless(handler, body):
    handler.send_response(200)
    handler.end_headers()  # no Content-Length: read until the server closes, which it does not
    handler.wfile.write(b'{"choices": [' + b" " * 4096)
    chunk = b" " * (1 << 16)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        handler.wfile.write(chunk)


def test_an_answer_declared_too_long_is_refused_before_reading_it(serve, model, tokenizer, prompts):
    big = serve(_declares(400_000_000))
    rollout = rollout_on([big.url], model, tokenizer, retries=0)
    started = time.monotonic()
    with pytest.raises(RunError, match=r"answered a body of 400000000 bytes \(Content-Length\); at most \d+ bytes "
                                       "are read"):
        rollout.generate(prompts[:1], G, SAMPLING)
    assert time.monotonic() - started < 3


def test_an_endless_answer_is_cut_at_the_cap(serve, model, tokenizer, prompts):
    endless = serve(_endless)
    rollout = rollout_on([endless.url], model, tokenizer, retries=0, timeout_s=15)
    started = time.monotonic()
    with pytest.raises(RunError, match=r"answered a body of more than (\d+) bytes; at most \1 bytes are read"):
        rollout.generate(prompts[:1], G, SAMPLING)
    assert time.monotonic() - started < 10


def _drip(handler, body):
    data = json.dumps(good_answer(body)).encode()
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    for byte in data:  # one byte every 0.2 s: each read is quick, the answer never ends in time
        handler.wfile.write(bytes([byte]))
        handler.wfile.flush()
        time.sleep(0.2)


def test_timeout_s_is_a_deadline_for_the_whole_answer(serve, model, tokenizer, prompts):
    slow = serve(_drip)
    rollout = rollout_on([slow.url], model, tokenizer, retries=1, timeout_s=1)
    started = time.monotonic()
    with pytest.raises(RunError, match=r"failed after 2 attempt\(s\): timed out after 1 s"):
        rollout.generate(prompts[:1], G, SAMPLING)
    took = time.monotonic() - started
    assert took < 4, took  # two attempts of at most 1 s each


def test_a_good_answer_is_the_batch(serve, model, tokenizer, prompts):
    good = serve()
    rollout = rollout_on([good.url], model, tokenizer)
    batch = rollout.generate(prompts, G, SAMPLING)
    expected = good_answer({"n": G, "max_tokens": SAMPLING.max_new_tokens})["choices"]
    assert batch.completion_ids[:G].tolist() == [c["token_ids"] for c in expected]
    assert batch.sampling_logp[0].tolist() == pytest.approx(expected[0]["logprobs"]["token_logprobs"])
    assert good.received > 0 and good.version is not None  # the weights came over the channel


WEIGHT_ROUTES = {"/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
                 "/reset_prefix_cache", "/collective_rpc"}


def test_the_learner_sends_the_shared_secret_with_every_request(serve, model, tokenizer, prompts, monkeypatch):
    """Item 9, the learner's side: a server started with a secret refuses a learner without
    it, naming the variable to set; with it, every request (the weight routes included)
    carries it."""
    guarded = serve(secret="s3cret")
    monkeypatch.delenv("GRPO_SERVE_SECRET", raising=False)
    with pytest.raises(RunError) as info:
        rollout_on([guarded.url], model, tokenizer, retries=0)
    assert f"GET {guarded.url}/v1/models answered HTTP 401 Unauthorized" in str(info.value)
    assert "the server wants a shared secret: set GRPO_SERVE_SECRET in the learner's environment" in str(info.value)
    monkeypatch.setenv("GRPO_SERVE_SECRET", "wrong")
    with pytest.raises(RunError, match="the secret in GRPO_SERVE_SECRET is not the one this server was started"):
        rollout_on([guarded.url], model, tokenizer, retries=0)
    monkeypatch.setenv("GRPO_SERVE_SECRET", "s3cret")
    before = len(guarded.requests)
    rollout = rollout_on([guarded.url], model, tokenizer, retries=0)
    rollout.generate(prompts, G, SAMPLING)
    sent = guarded.requests[before:]
    assert {path for path, _ in sent} >= WEIGHT_ROUTES | {"/v1/models", "/v1/completions"}
    assert {headers.get("Authorization") for _, headers in sent} == {"Bearer s3cret"}


def test_secret_env_names_another_variable(serve, model, tokenizer, monkeypatch):
    guarded = serve(secret="k")
    monkeypatch.setenv("RM_SERVER_KEY", "k")
    rollout_on([guarded.url], model, tokenizer, secret_env="RM_SERVER_KEY")
    assert guarded.version is not None
