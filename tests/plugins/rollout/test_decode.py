"""The ``hf`` backend's lean decode loop against transformers ``generate`` on the tiny model.

Tolerance: none. Both draw the same exponential noise per row and step, so under a fixed
seed they give identical tokens, lengths and truncation flags here; a difference could
only come from float rounding of the forward at another batch size (not seen on CPU).
"""

from __future__ import annotations

import copy

import pytest
import torch
from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions
from pydantic import ValidationError

from grpo_core.contracts import RolloutSetup, SamplingParams
from grpo_core.testing import build_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tokenizer, prompts: tests/plugins/conftest.py


@pytest.fixture(scope="module")
def model(tokenizer, prompts):
    """The tiny model with one sampled token declared an extra EOS id, chosen so that about
    half the rows end early and the others run to ``max_new_tokens`` (the case the lean
    loop is for)."""
    base = build_model(tokenizer)
    plain = _generate(base, tokenizer, prompts, "generate", SamplingParams(max_new_tokens=24, seed=3))
    rows = [set(row[mask].tolist()) for row, mask in zip(plain.completion_ids, plain.completion_mask)]
    # with token t an EOS id, a row ends at its first t (the tokens before it do not change)
    share = {t: sum(t in row for row in rows) / len(rows) for t in set().union(*rows)}
    token = min(share, key=lambda t: abs(share[t] - 0.5))
    model = copy.deepcopy(base)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, token]
    return model


def _generate(model, tokenizer, prompts, decode, sampling, group=6, **options):
    """Generate on the float32 model itself (``dtype: null``) with generate's draw unless
    ``options`` say otherwise: the lean loop against ``generate`` token for token."""
    options = {"dtype": None, "sampler": "multinomial", **options} if decode == "lean" else {"dtype": None, **options}
    backend = HFRollout(HFRolloutOptions(decode=decode, **options))
    backend.setup(RolloutSetup(model, tokenizer))
    return backend.generate(prompts, group, sampling)


def _same(a, b) -> None:
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.truncated, b.truncated)
    assert a.completions == b.completions


SAMPLINGS = [  # (sampling, whether rows end at uneven steps with this model)
    (SamplingParams(max_new_tokens=24, seed=3), True),
    (SamplingParams(max_new_tokens=24, seed=7, temperature=0.7, top_k=20, top_p=0.9), True),
    (SamplingParams(max_new_tokens=24, seed=11, temperature=1.3, top_p=0.8), False),
    (SamplingParams(max_new_tokens=24, greedy=True), False),
]


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize(("sampling", "uneven"), SAMPLINGS, ids=["plain", "topk-topp", "hot-topp", "greedy"])
def test_lean_loop_gives_generates_tokens(model, tokenizer, prompts, sampling, uneven, share):
    plain = _generate(model, tokenizer, prompts, "generate", sampling, share_prompt_prefill=share)
    lean = _generate(model, tokenizer, prompts, "lean", sampling, share_prompt_prefill=share)
    _same(plain, lean)
    if uneven:  # rows ended at different steps: the dropping was exercised
        lengths = plain.completion_mask.sum(1)
        assert (~plain.truncated).any() and len(set(lengths.tolist())) > 2


def test_lean_loop_with_stop_strings_and_prompt_split(model, tokenizer, prompts):
    sampling = SamplingParams(max_new_tokens=24, seed=5, stop=("5", "= "))
    plain = _generate(model, tokenizer, prompts, "generate", sampling)
    lean = _generate(model, tokenizer, prompts, "lean", sampling, prompts_per_generate=2)
    split_plain = _generate(model, tokenizer, prompts, "generate", sampling, prompts_per_generate=2)
    _same(split_plain, lean)
    assert (~plain.truncated).sum() >= 6  # the stop strings did end rows


def _decoded_rows(model, tokenizer, prompts, decode, sampling) -> list[int]:
    """The batch size of every decoder forward of one generate call."""
    sizes: list[int] = []
    handle = model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        batch = _generate(model, tokenizer, prompts, decode, sampling)
    finally:
        handle.remove()
    assert batch.truncated.any() and not batch.truncated.all()
    return sizes


def test_finished_rows_leave_the_batch(model, tokenizer, prompts):
    sampling = SamplingParams(max_new_tokens=24, seed=3)
    plain = _decoded_rows(model, tokenizer, prompts, "generate", sampling)
    lean = _decoded_rows(model, tokenizer, prompts, "lean", sampling)
    rows = len(prompts) * 6
    # prefill of the 3 prompts, then generate decodes all 18 rows every step
    assert plain[0] == lean[0] == len(prompts)
    assert set(plain[1:]) == {rows}
    decode = lean[1:]
    assert decode[0] == rows and decode == sorted(decode, reverse=True)
    assert len(decode) == len(plain) - 1  # the same number of steps: some row runs to the end
    assert sum(decode) < 0.9 * sum(plain[1:])


def test_decode_option_is_validated():
    with pytest.raises(ValidationError, match="lean"):
        HFRolloutOptions(decode="fast")
    assert HFRolloutOptions().decode == "lean"


def test_inverse_cdf_picks_the_token_whose_interval_holds_u():
    from grpo_plugins.rollout.decode import inverse_cdf

    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25]] * 6)
    uniforms = torch.tensor([0.0, 0.2499, 0.25, 0.7499, 0.75, 1.0 - 2**-24])
    assert inverse_cdf(probs, uniforms).tolist() == [1, 1, 3, 3, 4, 4]
    unnormalized = probs * 3  # only the proportions matter; zero-probability tokens never come out
    assert inverse_cdf(unnormalized, uniforms).tolist() == [1, 1, 3, 3, 4, 4]


def test_inverse_cdf_sampler_draws_the_models_distribution(model, tokenizer, prompts):
    """The first token of 3000 rows (one prompt) against the model's softmax: a chi-square
    statistic over the tokens of probability >= 1% (the rest pooled). Seeded, so not flaky;
    the 0.999 quantile of chi-square with k-1 degrees of freedom is about k + 3.1 sqrt(2k)."""
    rows, prompt = 3000, prompts[0]
    sampling = SamplingParams(max_new_tokens=1, seed=0, temperature=0.8, top_k=40)
    batch = _generate(model, tokenizer, [prompt], "lean", sampling, group=rows, sampler="inverse-cdf")
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1] / 0.8
    probs = torch.softmax(logits.masked_fill(logits < logits.topk(40).values[-1], -float("inf")), -1)
    counts = torch.bincount(batch.completion_ids[:, 0], minlength=probs.shape[0]).double()
    big = probs >= 0.01
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([probs[big], probs[~big].sum()[None]]).double() * rows
    chi2 = float(((observed - expected) ** 2 / expected.clamp(min=1e-9)).sum())
    k = int(big.sum())
    assert chi2 < k + 3.1 * (2 * k) ** 0.5, (chi2, k)
    assert counts[probs == 0].sum() == 0  # top-k excluded tokens never drawn
    multinomial = _generate(model, tokenizer, [prompt], "lean", sampling, group=rows)
    assert not torch.equal(multinomial.completion_ids, batch.completion_ids)  # another draw


def test_inverse_cdf_rows_do_not_depend_on_which_rows_ended(model, tokenizer, prompts):
    """One uniform per row and step, drawn for all rows: a row's tokens are those it would get
    if no row ever left the batch (the same model without the extra EOS id, cut at its end)."""
    sampling = SamplingParams(max_new_tokens=24, seed=3)
    ended = _generate(model, tokenizer, prompts, "lean", sampling, sampler="inverse-cdf")
    plain_model = copy.deepcopy(model)
    plain_model.generation_config.eos_token_id = [tokenizer.eos_token_id]
    running = _generate(plain_model, tokenizer, prompts, "lean", sampling, sampler="inverse-cdf")
    lengths = ended.completion_mask.sum(1)
    assert (~ended.truncated).any() and len(set(lengths.tolist())) > 2
    for row, n in enumerate(lengths.tolist()):
        assert ended.completion_ids[row, :n].tolist() == running.completion_ids[row, :n].tolist()


def test_inverse_cdf_needs_the_lean_loop():
    with pytest.raises(ValidationError, match="sampler: inverse-cdf needs decode: lean"):
        HFRolloutOptions(decode="generate", sampler="inverse-cdf")
