"""What the vLLM backends send vLLM, without vLLM: the sampling-parameter mapping, greedy
requests (one completion repeated), a server's request body, and a server's answer made into
the batch vLLM's outputs make (the outputs themselves: tests/plugins/rollout/test_outputs.py)."""

from __future__ import annotations

import json

from grpo_plugins.rollout.outputs import Completion, Output, outputs_to_batch
from grpo_plugins.vllm.client import Expected, to_outputs
from grpo_plugins.vllm.io import completion_body, repeat_greedy, sampling_kwargs

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
    one = [Output([Completion(0, [5, 2], "stop", "a", None)]), Output([Completion(0, [6], "length", "b", None)])]
    batch = outputs_to_batch(repeat_greedy(one, 3), [[1], [2]], 3, pad_id=0, eos_ids=[2], max_new_tokens=1)
    assert batch.completion_ids.tolist() == [[5]] * 3 + [[6]] * 3
    assert batch.completions == ["a"] * 3 + ["b"] * 3


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
