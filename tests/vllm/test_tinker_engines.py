"""tinker-serve sampling through vLLM (``--rollout vllm``, an engine in the server's process, and
``--rollout vllm-server``, a real ``grpo-run serve`` server with LoRA on 127.0.0.1), driven by
the official tinker SDK on a tiny model.

What each test pins, for both engines: a sampler snapshot is sampled as a LoRA adapter pushed to
the engine (the adapter's bytes, not the model's), and the log-probs the engine returns for the
tokens it sampled are the snapshot's (tinker-serve's ``compute_logprobs``, a forward pass of the
served model, within 1e-4) and not the base model's; several snapshots stay loaded at once and
each samples with its own weights; one pushed out by ``--max-loras`` is pushed again when
sampled again; the base model samples with no adapter; a client whose rank the engine cannot
load is refused by name. (Bad engine flags: tests/plugins/test_tinker.py.)
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import pytest

from grpo_core.testing import save_tiny_model

from .conftest import HIDDEN
from .test_servers import SECRET, START_S, Server

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.vllm

KEY = "tml-grpo-test"
NAME = "tiny-base"
TOL = 1e-4
RANK = 8
LORA_ARGS = ("--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "3")
ENGINE_OPTIONS = ["dtype=float32", "enforce_eager=true", "max_model_len=256", "max_num_seqs=16"]


def _args(root, rollout: str, servers: list[str] = (), options: list[str] = ()) -> argparse.Namespace:
    from grpo_plugins.tinker import configure

    parser = argparse.ArgumentParser()
    configure(parser)
    argv = ["--model", str(root / "model"), "--name", NAME, "--api-key", KEY, "--port", "0",
            "--state-dir", str(root / f"state-{rollout}"), "--rollout", rollout, "--max-lora-rank", str(RANK),
            "--max-loras", "3"]
    for url in servers:
        argv += ["--server", url]
    for option in options:
        argv += ["--rollout-option", option]
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinker-engines")
    save_tiny_model(root / "model", hidden_size=HIDDEN)
    return root


@pytest.fixture(scope="module", params=["vllm", "vllm-server"])
def served(request, root):
    """A tinker-serve sampling with the engine named by the parameter, a ServiceClient, and the
    tracked events (client id, event, values)."""
    from grpo_plugins.tinker import start

    saved = {k: os.environ.get(k) for k in ("TINKER_TELEMETRY", "GRPO_SERVE_SECRET")}
    os.environ.update(TINKER_TELEMETRY="0", GRPO_SERVE_SECRET=SECRET)
    server_proc = None
    try:
        if request.param == "vllm-server":
            server_proc = Server(root / "model", root / "server.log", extra=LORA_ARGS)
            server_proc.wait(time.monotonic() + START_S)
            args = _args(root, "vllm-server", servers=[server_proc.url])
        else:
            args = _args(root, "vllm", options=ENGINE_OPTIONS)
        server = start(args)
        events: list[tuple] = []
        server.service.tracker = lambda model_id, event, step, values: events.append((model_id, event, values))
        client = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
        yield server, client, events
        client.close("success").result()
        server.close()
    finally:
        if server_proc is not None:
            server_proc.stop()
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def _trained_snapshot(client, seed: int, name: str):
    """A training client stepped away from the base (its own data and seed) and its snapshot."""
    training = client.create_lora_training_client(base_model=NAME, rank=RANK, seed=seed)
    tokens = list(range(40 + 10 * seed, 60 + 10 * seed))
    for _ in range(2):
        training.forward_backward([_datum(tokens)], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return training, training.save_weights_and_get_sampling_client(name=name)


def _sampled_and_scored(sampler, prompt: list[int], seed: int):
    """The engine's log-probs of the tokens it sampled, and compute_logprobs' of the same."""
    result = sampler.sample(types.ModelInput.from_ints(prompt), 2,
                            types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed)).result()
    got, want = [], []
    for seq in result.sequences:
        assert 1 <= len(seq.tokens) <= 6 and len(seq.logprobs) == len(seq.tokens)
        full = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + seq.tokens)).result()
        got += seq.logprobs
        want += full[len(prompt):]
    return np.array(got), np.array(want), result


def _pushes(events) -> list[dict]:
    return [values for _, event, values in events if event == "sampler_push"]


def test_snapshots_sample_as_adapters_with_their_own_weights(served):
    server, client, events = served
    engine = server.service.engine
    (reserved,) = engine.backend.loaded_versions()  # the reserved adapter's version, pushed at start
    prompt = list(range(30, 38))
    first, first_sampler = _trained_snapshot(client, 1, "a")
    got, want, _ = _sampled_and_scored(first_sampler, prompt, 3)
    np.testing.assert_allclose(got, want, atol=TOL)
    base = client.create_sampling_client(base_model=NAME)
    base_got, base_want, base_result = _sampled_and_scored(base, prompt, 3)
    np.testing.assert_allclose(base_got, base_want, atol=TOL)
    # the snapshot's log-probs are not the base model's (the engine sampled with the adapter)
    tokens = base_result.sequences[0].tokens
    on_snapshot = first_sampler.compute_logprobs(types.ModelInput.from_ints(prompt + tokens)).result()
    on_base = base.compute_logprobs(types.ModelInput.from_ints(prompt + tokens)).result()
    assert np.abs(np.array(on_snapshot[len(prompt):]) - np.array(on_base[len(prompt):])).max() > 1e-2

    # the push was the adapter alone: a small part of the model's bytes
    pushes = _pushes(events)
    assert len(pushes) == 1
    model_bytes = sum(p.numel() * 4 for n, p in server.service.model.named_parameters() if "lora_" not in n)
    adapter_bytes = sum(t.numel() * 4 for t in server.service._adapter_state(first.model_id).values())
    assert pushes[0]["push_bytes"] == pytest.approx(adapter_bytes, rel=0.05)
    assert pushes[0]["push_bytes"] < model_bytes / 8  # 145,408 of 1,509,888 bytes

    # a second snapshot: both loaded (3 slots: the reserved one and these two), each its own
    _, second_sampler = _trained_snapshot(client, 2, "b")
    for sampler in (second_sampler, first_sampler, second_sampler):
        got, want, _ = _sampled_and_scored(sampler, prompt, 5)
        np.testing.assert_allclose(got, want, atol=TOL)
    assert len(_pushes(events)) == 2  # the first was still loaded

    # slots: the reserved adapter (r), a (r + 1), b (r + 2); c pushes out the reserved one, d then a
    for seed, name in ((3, "c"), (4, "d")):
        _, sampler = _trained_snapshot(client, seed, name)
        got, want, _ = _sampled_and_scored(sampler, prompt, 7)
        np.testing.assert_allclose(got, want, atol=TOL)
    assert engine.backend.loaded_versions() == [reserved + k for k in (2, 3, 4)] and len(_pushes(events)) == 4
    # a, pushed out, is pushed again when sampled again (pushing out b) and samples as before
    got, want, _ = _sampled_and_scored(first_sampler, prompt, 9)
    np.testing.assert_allclose(got, want, atol=TOL)
    assert engine.backend.loaded_versions() == [reserved + k for k in (3, 4, 5)] and len(_pushes(events)) == 5


def test_a_rank_the_engine_cannot_load_is_refused(served):
    _, client, _ = served
    with pytest.raises(Exception, match=r"LoRA rank 16 is above the sampling engine's --max-lora-rank 8"):
        client.create_lora_training_client(base_model=NAME, rank=16).result()
