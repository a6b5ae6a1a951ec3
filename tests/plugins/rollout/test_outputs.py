"""What an engine's answers become, without an engine (:mod:`grpo_plugins.rollout.outputs`):
request seeds, and outputs with vLLM's attributes made into a RolloutBatch like the ``hf``
backend's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from grpo_plugins.rollout.outputs import outputs_to_batch, request_seed


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


