"""What the server and colocated backends keep of a completion a weight update interrupts, and how it continues
(:mod:`grpo_plugins.rollout.partial`), on hand-made outputs with vLLM's attributes (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from grpo_plugins.rollout.outputs import outputs_to_batch, request_seed
from grpo_plugins.rollout.partial import PartialCompletion, continuation_seed, stitched_outputs, versions_tensor


def output(ids, logps, finish=None):
    """A cumulative ``CompletionOutput``: token ids, ``{token: logprob}`` per position, finish reason."""
    return SimpleNamespace(token_ids=ids, logprobs=[{t: v} for t, v in zip(ids, logps)], finish_reason=finish)


def test_an_interrupted_completion_keeps_its_tokens_and_continues_from_its_prefix():
    """Prompt [1, 2], completion 1 of a request seeded 10 (its own seed 11): two tokens with
    version 0, interrupted; the continuation asks for prompt + prefix, 5 - 2 = 3 tokens, seed
    request_seed(11 + 2); it samples one more token with version 1 and stops."""
    part = PartialCompletion([1, 2], 1, 11)
    part.running = output([5, 6], [-0.1, -0.2])
    part.interrupt(0)
    assert (part.ids, part.logps, part.versions, part.finished) == ([5, 6], [-0.1, -0.2], [0, 0], False)
    assert part.rest(5) == ([1, 2, 5, 6], 3, request_seed(13))
    part.fold(output([7], [-0.3], "stop"), 1)
    assert (part.ids, part.versions, part.finish_reason) == ([5, 6, 7], [0, 0, 1], "stop")
    # an aborted answer (a paused server's) is not an end
    aborted = PartialCompletion([1], 0, None)
    aborted.fold(output([4], [-0.5], "abort"), 0)
    assert not aborted.finished and aborted.rest(3) == ([1, 4], 2, None)
    assert continuation_seed(None, 4) is None


def test_stitched_completions_make_the_batch_with_each_tokens_version():
    eos = 9
    a, b = PartialCompletion([1], 0, 0), PartialCompletion([1], 1, 1)
    a.fold(output([3, 4], [-1.0, -2.0]), 0)
    a.fold(output([eos], [-0.5], "stop"), 1)
    b.fold(output([5], [-0.25], "length"), 0)
    batch = outputs_to_batch(stitched_outputs([[a, b]]), [[1]], 2, pad_id=0, eos_ids=[eos], max_new_tokens=3)
    assert batch.completion_ids.tolist() == [[3, 4, eos], [5, 0, 0]]
    assert batch.sampling_logp.tolist() == [[-1.0, -2.0, -0.5], [-0.25, 0.0, 0.0]]
    assert batch.truncated.tolist() == [False, True]
    assert versions_tensor([[a, b]], 2, 3).tolist() == [[0, 0, 1], [0, 0, 0]]
    # a greedy group (one completion) is repeated G times, as its tokens are
    assert torch.equal(versions_tensor([[a]], 3, 3), torch.tensor([[0, 0, 1]] * 3))
