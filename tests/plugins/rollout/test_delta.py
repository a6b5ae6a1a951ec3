"""Delta weight pushes as pure functions (grpo_plugins.rollout.delta): after any number of pushes
the receiver's copy is bitwise the sender's latest tensors (as a full push leaves it), a push
sends a tensor whole when that is smaller, and a receiver whose copy drifted by one element
is caught by the checksum, naming the tensor."""

from __future__ import annotations

import pytest
import torch
from grpo_plugins.rollout.delta import (
    DeltaDecoder,
    DeltaEncoder,
    DeltaMismatch,
    apply_delta,
    bits,
    checksum,
    make_delta,
    push_stats,
)
from hypothesis import given, settings
from hypothesis import strategies as st


def _step(weights: dict[str, torch.Tensor], fraction: float, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Each tensor with about ``fraction`` of its elements nudged (an optimizer step at an RL
    learning rate, as bf16 sees it)."""
    out = {}
    for name, t in weights.items():
        t = t.clone()
        flat = t.reshape(-1)
        pick = torch.rand(flat.numel(), generator=gen) < fraction
        flat[pick] = (flat[pick].float() + torch.randn(int(pick.sum()), generator=gen)).to(t.dtype)
        out[name] = t
    return out


@settings(max_examples=25)
@given(seed=st.integers(0, 2**16), steps=st.integers(1, 6), fraction=st.sampled_from([0.0, 0.01, 0.3, 0.9]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_after_n_pushes_the_receiver_holds_bitwise_what_a_full_push_gives(seed, steps, fraction, dtype):
    gen = torch.Generator().manual_seed(seed)
    weights = {"a.weight": torch.randn(17, 9, generator=gen).to(dtype),
               "b.bias": torch.randn(5, generator=gen).to(dtype)}
    weights["a.weight"].view(-1)[0] = -0.0  # signed zeros and NaNs travel bit for bit
    weights["b.bias"][1] = float("nan")
    sender, receiver = DeltaEncoder(), DeltaDecoder()
    for step in range(steps + 1):
        deltas = sender.encode(weights.items())
        if step == 0:
            assert all(d.full for d in deltas)  # the first push is whole
        elif fraction <= 0.01:
            assert not deltas[0].full  # 153 elements, about 2 changed
        for d in deltas:
            got = receiver.decode(d)
            assert torch.equal(bits(got), bits(weights[d.name])) and got.shape == weights[d.name].shape
        weights = _step(weights, fraction, gen)


def test_a_sparse_change_sends_its_elements_and_a_dense_one_the_whole_tensor():
    old = torch.zeros(1000, dtype=torch.bfloat16)
    sparse, dense = old.clone(), old.clone()
    sparse[[3, 500]] = 1.0
    dense[:600] = 1.0  # 600 x (2 + 4) bytes > 1000 x 2 bytes
    d = make_delta("w", old, sparse)
    assert not d.full and d.indices.tolist() == [3, 500] and d.indices.dtype == torch.int32 and d.nbytes == 2 * 6
    assert make_delta("w", old, dense).full
    assert make_delta("w", old.float(), sparse).full  # another dtype: whole
    assert make_delta("w", old.reshape(10, 100), sparse).full  # another shape: whole
    stats = push_stats([d, make_delta("v", old, dense)])
    assert stats == {"bytes": 12 + 2000, "full_bytes": 4000, "tensors_whole": 1, "elements_sent": 1002 / 2000}


def test_reset_makes_the_next_push_whole():
    sender = DeltaEncoder()
    w = [("w", torch.ones(8))]
    assert sender.encode(w)[0].full and not sender.encode(w)[0].full
    sender.reset()
    assert sender.encode(w)[0].full
    assert sender.encode(w, full=True)[0].full


def test_a_receiver_copy_corrupted_in_one_element_is_caught_by_the_checksum():
    """The negative control: one element of the receiver's copy differs from what the sender
    believes it holds; the delta does not touch it, and the checksum refuses the result."""
    gen = torch.Generator().manual_seed(0)
    weights = {"layer.weight": torch.randn(64, 32, generator=gen).to(torch.bfloat16)}
    sender, receiver = DeltaEncoder(), DeltaDecoder()
    for d in sender.encode(weights.items()):
        receiver.decode(d)
    receiver.held["layer.weight"].view(-1)[1234] += 1.0
    weights = _step(weights, 0.01, gen)
    (delta,) = sender.encode(weights.items())
    assert not delta.full and 1234 not in delta.indices.tolist()
    with pytest.raises(DeltaMismatch, match=r"layer\.weight.*checksum.*a full push is needed"):
        receiver.decode(delta)


def test_a_delta_with_nothing_to_apply_to_is_refused():
    delta = make_delta("w", torch.zeros(4), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    with pytest.raises(DeltaMismatch, match="holds no torch.float32 tensor of shape \\[4\\]"):
        apply_delta(None, delta)


def test_the_checksum_sees_one_changed_element_and_two_swapped():
    t = torch.randn(100)
    changed, swapped = t.clone(), t.clone()
    changed[7] = torch.nextafter(changed[7], torch.tensor(10.0))  # one ulp
    swapped[[3, 4]] = t[[4, 3]]
    assert len({checksum(t), checksum(changed), checksum(swapped)}) == 3
    assert checksum(t) == checksum(t.clone()) and 0 <= checksum(t) < 2**63
