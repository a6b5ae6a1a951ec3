"""What the vLLM backends send vLLM and make of its answers, without vLLM: the sampling-parameter
mapping, request seeds, greedy requests, a server's request body, and vLLM's outputs (or a server's
answer) made into a RolloutBatch."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from grpo_plugins.vllm.client import Expected, to_outputs
from grpo_plugins.vllm.io import completion_body, outputs_to_batch, repeat_greedy, request_seed, sampling_kwargs

from grpo_core.contracts import SamplingParams


def test_sampling_kwargs_map_the_contract_onto_vllm():
    sampling = SamplingParams(max_new_tokens=32, temperature=0.7, top_p=0.9, top_k=0, stop=("\n\n", "END"), seed=1)
    kwargs = sampling_kwargs(sampling, 8, [2, 7], seed=12345)
    assert kwargs["n"] == 8 and kwargs["max_tokens"] == 32 and kwargs["min_tokens"] == 0
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"]) == (0.7, 0.9, -1)  # 0 -> -1 (off)
    assert kwargs["stop"] == ["\n\n", "END"] and kwargs["include_stop_str_in_output"] is True
    assert kwargs["stop_token_ids"] == [2, 7] and kwargs["ignore_eos"] is False
    assert kwargs["seed"] == 12345 and kwargs["logprobs"] == 0
    assert (kwargs["repetition_penalty"], kwargs["presence_penalty"], kwargs["frequency_penalty"], kwargs["min_p"]) == (
        1.0, 0.0, 0.0, 0.0)
    assert sampling_kwargs(SamplingParams(max_new_tokens=4, top_k=50), 2, [2], None)["top_k"] == 50
    assert sampling_kwargs(SamplingParams(max_new_tokens=4), 2, [2], None)["seed"] is None


def test_greedy_is_temperature_zero_without_truncation():
    sampling = SamplingParams(max_new_tokens=4, greedy=True, temperature=0.5, top_p=0.5, top_k=3)
    kwargs = sampling_kwargs(sampling, 1, [2], None)
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"]) == (0.0, 1.0, -1)


def test_greedy_asks_one_completion_and_repeats_it_group_size_times():
    """vLLM refuses n > 1 at temperature 0; every greedy sample is the same anyway."""
    assert sampling_kwargs(SamplingParams(max_new_tokens=4, greedy=True), 4, [2], None)["n"] == 1
    one = [SimpleNamespace(outputs=[_completion(0, [5, EOS], "stop", "a")]),
           SimpleNamespace(outputs=[_completion(0, [6], "length", "b")])]
    batch = outputs_to_batch(repeat_greedy(one, 3), [[1], [2]], 3, pad_id=PAD, eos_ids=[EOS], max_new_tokens=1)
    assert batch.completion_ids.tolist() == [[5]] * 3 + [[6]] * 3
    assert batch.completions == ["a"] * 3 + ["b"] * 3


def test_request_seeds_are_deterministic_in_range_and_their_sample_streams_disjoint():
    assert request_seed(7) == request_seed(7)
    seeds = [request_seed(1000 + i) for i in range(500)]
    assert all(0 <= s < 2**62 for s in seeds)
    # vLLM seeds sample k of a request with seed + k: neighbouring prompts never share one
    streams = [{s + k for k in range(64)} for s in seeds]
    assert len(set().union(*streams)) == 500 * 64


EOS, STOP_TOKEN, PAD = 2, 9, 0


def _completion(index, ids, reason, text="", logps=None, extra=None):
    """A stand-in for vLLM's CompletionOutput: token ids, per-token {id: Logprob}."""
    logps = logps if logps is not None else [-0.1 * (t + 1) for t in range(len(ids))]
    entries = []
    for token, value in zip(ids, logps):
        entry = {token: SimpleNamespace(logprob=value, rank=1)}
        if extra:  # other tokens vLLM may list next to the sampled one
            entry[extra] = SimpleNamespace(logprob=-9.0, rank=2)
        entries.append(entry)
    return SimpleNamespace(index=index, token_ids=tuple(ids), logprobs=entries, finish_reason=reason, text=text)


@pytest.fixture
def outputs():
    return [
        SimpleNamespace(outputs=[  # given out of order: rows follow .index
            _completion(1, [5, 6, STOP_TOKEN], "stop", "ab\n\n", extra=11),
            _completion(0, [4, EOS], "stop", "x"),
            _completion(2, [7, 7, 7, 7], "length", "yyyy"),
        ]),
        SimpleNamespace(outputs=[
            _completion(0, [8, 8, 8, EOS], "length", "zzz"),  # EOS on the last allowed token
            _completion(1, [3], "stop", "q\n\nleft over"),
            _completion(2, [EOS], "stop", ""),
        ]),
    ]


def test_outputs_become_a_rollout_batch_like_hf(outputs):
    prompts = [[10, 11, 12], [13]]
    batch = outputs_to_batch(outputs, prompts, 3, pad_id=PAD, eos_ids=[EOS], max_new_tokens=4, stop=("\n\n",))
    assert batch.prompt_ids.tolist() == [[10, 11, 12], [PAD, PAD, 13]]
    assert batch.prompt_mask.tolist() == [[True] * 3, [False, False, True]]
    assert batch.completion_ids.tolist() == [
        [4, EOS, PAD, PAD],
        [5, 6, STOP_TOKEN, PAD],
        [7, 7, 7, 7],
        [8, 8, 8, EOS],
        [3, PAD, PAD, PAD],
        [EOS, PAD, PAD, PAD],
    ]
    lengths = [2, 3, 4, 4, 1, 1]
    assert batch.completion_mask.tolist() == [[t < n for t in range(4)] for n in lengths]  # through EOS / stop
    assert batch.truncated.tolist() == [False, False, True, False, False, False]
    assert batch.completions == ["x", "ab\n\n", "yyyy", "zzz", "q\n\n", ""]
    assert batch.group_size == 3
    logp = batch.sampling_logp
    assert logp.dtype == torch.float32 and logp.shape == (6, 4)
    expected = [[-0.1 * (t + 1) if t < n else 0.0 for t in range(4)] for n in lengths]
    assert torch.allclose(logp, torch.tensor(expected))
    assert (logp[~batch.completion_mask] == 0).all()


def test_texts_come_from_decode_when_given_cut_at_the_stop(outputs):
    rows = []

    def decode(ids):
        rows.extend(ids)
        return [f"<{len(r)}>\n\nmore" for r in ids]

    batch = outputs_to_batch(outputs, [[10], [13]], 3, pad_id=PAD, eos_ids=[EOS], max_new_tokens=4, stop=("\n\n",),
                             decode=decode)
    assert rows == [[4, EOS], [5, 6, STOP_TOKEN], [7, 7, 7, 7], [8, 8, 8, EOS], [3], [EOS]]
    assert batch.completions == ["<2>\n\n", "<3>\n\n", "<4>\n\n", "<4>\n\n", "<1>\n\n", "<1>\n\n"]


def test_completions_are_cut_at_max_new_tokens():
    long = [SimpleNamespace(outputs=[_completion(0, [4, 5, 6, 7, 8], "length", "abcde")])]
    batch = outputs_to_batch(long, [[1]], 1, pad_id=PAD, eos_ids=[EOS], max_new_tokens=3)
    assert batch.completion_ids.tolist() == [[4, 5, 6]] and batch.truncated.tolist() == [True]
    assert batch.sampling_logp.shape == (1, 3)


def test_no_logprobs_gives_no_sampling_logp():
    output = SimpleNamespace(index=0, token_ids=[4, EOS], logprobs=None, finish_reason="stop", text="a")
    plain = [SimpleNamespace(outputs=[output])]
    batch = outputs_to_batch(plain, [[1]], 1, pad_id=PAD, eos_ids=[EOS], max_new_tokens=4)
    assert batch.sampling_logp is None and batch.completion_mask.tolist() == [[True, True]]


def test_outputs_that_do_not_fit_are_refused(outputs):
    with pytest.raises(ValueError, match="prompt 0 has 3 completions, expected 2"):
        outputs_to_batch(outputs, [[1], [2]], 2, pad_id=PAD, eos_ids=[EOS], max_new_tokens=4)
    with pytest.raises(ValueError, match="2 outputs for 1 prompts"):
        outputs_to_batch(outputs, [[1]], 3, pad_id=PAD, eos_ids=[EOS], max_new_tokens=4)
    broken = [SimpleNamespace(outputs=[_completion(0, [4, 5], "stop")])]
    broken[0].outputs[0].logprobs[1] = {99: SimpleNamespace(logprob=-1.0)}
    with pytest.raises(ValueError, match="completion 0 of prompt 0 has no log-prob for its token 1"):
        outputs_to_batch(broken, [[1]], 1, pad_id=PAD, eos_ids=[EOS], max_new_tokens=4)


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
    outputs = [to_outputs(answer, Expected(n=2, max_tokens=3, vocab_size=10))]
    batch = outputs_to_batch(outputs, [[1, 2]], 2, pad_id=9, eos_ids=[0], max_new_tokens=3)
    assert batch.completion_ids.tolist() == [[5, 6, 8], [7, 0, 9]]
    assert batch.completion_mask.tolist() == [[True, True, True], [True, True, False]]
    assert batch.truncated.tolist() == [True, False]
    assert batch.sampling_logp.tolist() == [[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0]]
