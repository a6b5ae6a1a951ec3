"""AdamW with bfloat16 moments (``train.optimizer.state_dtype: bfloat16``): the AdamW formula,
unbiased stochastic rounding, weight decay, half the state memory, an exact resume through
the run's checkpoints, and a clear error for a bad value."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_core import checkpoint as ckpt
from grpo_core.cli import main
from grpo_core.train.learner import lean_adamw
from grpo_core.train.learner.lean_adamw import BF16StateAdamW, _noise_pair, stochastic_round_bf16

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _reference(p0: list[float], grads: list[list[float]], lr, b1, b2, eps, wd) -> list[float]:
    """AdamW by hand, in Python floats (float64), one coordinate at a time."""
    p, m, v = list(p0), [0.0] * len(p0), [0.0] * len(p0)
    for t, g in enumerate(grads, start=1):
        for i, gi in enumerate(g):
            p[i] *= 1 - lr * wd
            m[i] = b1 * m[i] + (1 - b1) * gi
            v[i] = b2 * v[i] + (1 - b2) * gi * gi
            p[i] -= lr * (m[i] / (1 - b1**t)) / (math.sqrt(v[i] / (1 - b2**t)) + eps)
    return p


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "sliced"])
@pytest.mark.parametrize("chunk", [3, 7, 1 << 20])  # split across batches, packed in one, whole tensors
def test_matches_the_adamw_formula(chunk, fused, monkeypatch):
    """Step 1 is the float32 formula (the moments are rounded only after use); later steps
    read moments stored in bfloat16 (8 significant bits), so each update carries at most
    ~1.5 bf16 ulps (2^-7 relative) of error: after 5 steps every coordinate is within
    2% of lr per step of the float64 reference. Both paths (the fused kernel over packed
    slices, and the slice-by-slice one that bfloat16 weights take), over parameters of 10, 7
    and 1 elements: with ``chunk`` 3 they are split across batches, with 7 the small ones
    share a batch."""
    if not fused:
        monkeypatch.setattr(lean_adamw, "_fusable", lambda p: False)
    torch.manual_seed(0)
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-8, 0.1
    shapes = [(2, 5), (7,), (1,)]
    p0 = [torch.randn(shape) for shape in shapes]
    grads = [[torch.randn(shape) for shape in shapes] for _ in range(5)]
    params = [torch.nn.Parameter(x.clone()) for x in p0]
    opt = BF16StateAdamW(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, chunk=chunk)
    for t in range(1, 6):
        for p, g in zip(params, grads[t - 1]):
            p.grad = g.clone()
        opt.step()
        for i, p in enumerate(params):
            ref = torch.tensor(_reference(p0[i].flatten().tolist(), [g[i].flatten().tolist() for g in grads[:t]],
                                          lr, b1, b2, eps, wd), dtype=torch.float64).view(shapes[i])
            tol = 1e-6 if t == 1 else 0.02 * lr * t
            error = (p.detach().double() - ref).abs().max()
            assert error <= tol, (t, i, error)
    assert all(opt.state[p][k].dtype == torch.bfloat16 for p in params for k in ("exp_avg", "exp_avg_sq"))


def test_float32_weights_take_the_fused_path_and_bfloat16_weights_the_sliced_one(monkeypatch):
    """The fast path is the one float32 weights take (mixed precision's master weights)."""
    calls = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    for dtype, expect in ((torch.float32, [2]), (torch.bfloat16, [])):
        calls.clear()
        params = [torch.nn.Parameter(torch.randn(4, dtype=dtype)), torch.nn.Parameter(torch.randn(3, dtype=dtype))]
        for p in params:
            p.grad = torch.ones_like(p)
        before = [p.detach().clone() for p in params]
        BF16StateAdamW(params, lr=0.1).step()
        assert calls == expect  # one kernel call over both parameters' slices, or none
        assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))


def test_weight_decay_alone_shrinks_by_one_minus_lr_wd():
    """A zero gradient leaves m = v = 0: the step is the decoupled decay p *= 1 - lr * wd."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 4.0]))
    opt = BF16StateAdamW([p], lr=0.1, weight_decay=0.5)
    for _ in range(3):
        p.grad = torch.zeros(3)
        opt.step()
    assert torch.allclose(p.detach(), torch.tensor([1.0, -2.0, 4.0]) * 0.95**3, atol=1e-6)


def test_stochastic_rounding_is_unbiased_and_keeps_the_second_moment_decaying():
    """x between two bf16 neighbours rounds to either, with mean x (nearest rounding would
    give the lower one always). And with beta2 = 0.999 a stored v decays by 0.1% a step,
    below bf16's resolution: rounded to nearest it would never move."""
    x = torch.full((20000,), 1.0 + 2**-9)  # a quarter of the way from 1 to the next bf16, 1 + 2^-7
    r = stochastic_round_bf16(x, torch.Generator().manual_seed(0)).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(float(r.mean()) - (1 + 2**-9)) < 2e-4
    assert float(x.to(torch.bfloat16).float().mean()) == 1.0  # the bias it avoids

    for noise in _noise_pair(100_000, torch.device("cpu"), torch.Generator().manual_seed(1)):
        assert int(noise.min()) == 0 and int(noise.max()) == 2**16 - 1  # the whole 16-bit range
        assert abs(float(noise.float().mean()) - (2**16 - 1) / 2) < 300

    p = torch.nn.Parameter(torch.zeros(4096))
    opt = BF16StateAdamW([p], lr=1e-3)
    p.grad = torch.ones(4096)
    opt.step()
    v0 = float(opt.state[p]["exp_avg_sq"].float().mean())
    for _ in range(200):
        p.grad = torch.zeros(4096)
        opt.step()
    v = float(opt.state[p]["exp_avg_sq"].float().mean())
    assert abs(v / v0 - 0.999**200) < 0.01, v / v0


def test_state_is_half_of_float32_adamw():
    model = torch.nn.Linear(64, 32)
    for opt in (torch.optim.AdamW(model.parameters()), BF16StateAdamW(model.parameters())):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        nbytes = sum(t.numel() * t.element_size() for s in opt.state.values()
                     for k, t in s.items() if k != "step")
        n = sum(p.numel() for p in model.parameters())
        assert nbytes == n * (8 if isinstance(opt, torch.optim.AdamW) else 4)


def test_a_run_with_bf16_moments_trains_and_resumes_exactly(tmp_path, write_spec, kit):
    """4 steps straight (checkpoints at 2 and 4) against the same run resumed from step 2:
    the same weights bit for bit (the moments, their dtype and the rounding noise come back)."""
    spec = write_spec(tmp_path, train={"steps": 4, "seed": 3, "lr": 1e-3, "optimizer": {"state_dtype": "bfloat16"}},
                      rollout={"sampler": "multinomial"},  # a draw whose groups' rewards differ: updates happen
                      checkpoint={"every": 2, "keep": 5})
    assert main([str(spec)]) == 0
    middle = tmp_path / "out" / "checkpoints" / "step-000002"
    assert main([str(spec), "--set", "train.output_dir=resumed", "--resume", str(middle)]) == 0
    straight, resumed = (kit.load_weights(tmp_path / d / "final") for d in ("out", "resumed"))
    assert straight.keys() == resumed.keys()
    assert [k for k in straight if not torch.equal(straight[k], resumed[k])] == []
    state = ckpt.load_state(middle / ckpt.STATE)["optimizer"]["state"]
    assert state and all(s["exp_avg_sq"].dtype == torch.bfloat16 for s in state.values())
    assert {float(s["step"]) for s in state.values()} == {2.0}  # two updates taken by then
    assert any(float(s["exp_avg_sq"].float().abs().max()) > 0 for s in state.values())


@pytest.mark.parametrize(("value", "expect"), [
    ("train.optimizer.state_dtype=int4", "'auto', 'bfloat16' or 'float32'"),
    ("train.optimizer.name=sgd", "'adamw'"),
    ("train.optimizer.moments=bf16", "moments"),
])
def test_a_bad_optimizer_option_is_a_spec_error(tmp_path, write_spec, capsys, value, expect):
    spec = write_spec(tmp_path)
    assert main(["validate", str(spec), "--set", value]) == 2
    err = capsys.readouterr().err
    assert "train.optimizer" in err and expect in err and "Traceback" not in err, err


def test_state_moves_between_float32_and_bf16_adamw():
    """A run may switch ``state_dtype`` on resume: either optimizer loads the other's state,
    the moments cast to its own dtype, the step count kept."""
    p = torch.nn.Parameter(torch.randn(100))
    p.grad = torch.randn(100)
    plain = torch.optim.AdamW([p])
    plain.step()
    lean = BF16StateAdamW([p])
    lean.load_state_dict(plain.state_dict())
    assert lean.state[p]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(lean.state[p]["exp_avg"], plain.state[p]["exp_avg"].to(torch.bfloat16))
    lean.step()
    back = torch.optim.AdamW([p])
    back.load_state_dict(lean.state_dict())
    assert back.state[p]["exp_avg_sq"].dtype == torch.float32 and float(back.state[p]["step"]) == 2.0


@pytest.mark.parametrize(("mixed", "strategy", "weights", "expect"), [
    ("bf16", "ddp", torch.float32, BF16StateAdamW),  # a bf16 run: half the optimizer memory
    ("no", "ddp", torch.float32, torch.optim.AdamW),  # a float32 run keeps float32 moments
    ("fp16", "ddp", torch.float32, torch.optim.AdamW),
    ("bf16", "fsdp2", torch.float32, torch.optim.AdamW),  # sharded moments are float32 (not implemented)
    ("bf16", "ddp", torch.bfloat16, torch.optim.AdamW),  # bf16 weights: torch's AdamW in their dtype
])
def test_auto_state_dtype_is_bfloat16_in_a_bf16_run_with_float32_weights(mixed, strategy, weights, expect):
    from grpo_core.spec.models import TrainSection
    from grpo_core.train.learner.optim import make_optimizer

    train = TrainSection.model_validate({"mixed_precision": mixed, "parallel": {"strategy": strategy}})
    assert train.optimizer.state_dtype == "auto"
    optimizer, _ = make_optimizer(torch.nn.Linear(4, 3).to(weights), train, total_updates=10)
    assert type(optimizer) is expect
