"""Tests for mpcourse.core.master. Oracles: an FP32 reference run with torch's own optimizer (same gradients),
torch's FP16 casts (round to nearest even), torch.amp.GradScaler, and exact FP16 arithmetic facts."""
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpcourse.core.master import NORM_TYPES, MasterWeights, cast_model
from mpcourse.core.scaling import DynamicLossScaler, StaticLossScaler

INF, NAN = float("inf"), float("nan")


def fp16_values(n, seed, scale=1.0):
    """n random values exactly representable in FP16 (so FP16 and FP32 runs start equal)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).half().float()


# ----------------------------------------------------------------------------------------------------------
# Regression cases: FP16 gradients, the master copy and the unscaler
# ----------------------------------------------------------------------------------------------------------
def test_fp16_gradient_goes_through_the_master_not_the_unscaler():
    """FP16 gradient 1000 with scale 65536: handed to the unscaler directly it is refused with the fix named;
    through MasterWeights it is an FP32 inf (1000 * 65536 > 65504), so the step is skipped and nothing breaks."""
    w = nn.Parameter(torch.tensor([1.0], dtype=torch.float16))
    scaler = DynamicLossScaler(init_scale=65536.0)
    scaler.scale((w.float() * 1000.0).sum()).backward()
    assert w.grad.dtype == torch.float16 and w.grad.isinf().all()
    with pytest.raises(ValueError, match=r"MasterWeights.*master\.step\(scaler\)"):
        scaler.unscale_(torch.optim.SGD([w], lr=1.0))
    master = MasterWeights([w], torch.optim.SGD, lr=1.0)
    master.step(scaler)
    scaler.update()
    assert scaler.last_step_skipped and w.item() == 1.0 and scaler.get_scale() == 32768.0


def test_adam_eps_zero_gradient_stays_finite_with_master_weights():
    """FP16 params [1, -2, 0.5], zero gradient, Adam eps 1e-8: with an FP32 master they stay exactly unchanged.
    Without: eps is 0 in FP16 and the update is 0 / (sqrt(0) + 0) = NaN (google-deepmind/optax#1754,
    pytorch/pytorch#8860)."""
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0  # the arithmetic fact behind it
    values = [1.0, -2.0, 0.5]
    pure = nn.Parameter(torch.tensor(values, dtype=torch.float16))
    opt = torch.optim.Adam([pure], lr=1e-3, eps=1e-8)
    pure.grad = torch.zeros_like(pure)
    opt.step()
    assert pure.isnan().all()  # the contrast: Adam stepping FP16 params directly

    w = nn.Parameter(torch.tensor(values, dtype=torch.float16))
    master = MasterWeights([w], torch.optim.Adam, lr=1e-3, eps=1e-8)
    for _ in range(3):
        w.grad = torch.zeros_like(w)
        master.step()
        master.zero_grad()
    assert torch.isfinite(w).all() and w.tolist() == values
    assert master.master_params[0].dtype == torch.float32 and master.master_params[0].tolist() == values


def test_tiny_gradient_recovered_by_static_scaling():
    """A true gradient of 1e-8 is below FP16's smallest subnormal 2**-24: 0 in FP16. With S = 2**16 the FP16
    gradient is 6.55e-4 (normal), copied to FP32 and divided by S: 1e-8 within 0.03%."""
    def grad_after(scaler):
        w = nn.Parameter(torch.tensor([1.0], dtype=torch.float16))
        master = MasterWeights([w], torch.optim.SGD, lr=0.0)
        loss = (w.float() * 1e-8).sum()  # backward casts the grad to the param's dtype, FP16
        (scaler.scale(loss) if scaler else loss).backward()
        master.copy_grads_to_master()
        if scaler:
            scaler.unscale_(master.optimizer)
        return master.master_params[0].grad.item()

    assert grad_after(None) == 0.0
    recovered = grad_after(StaticLossScaler(2.0 ** 16))
    assert abs(recovered - 1e-8) / 1e-8 < 3e-4
    # exact oracle: torch's FP16 rounding of the scaled value, divided by S in FP32
    assert recovered == (torch.tensor(1e-8 * 2 ** 16).half().float() / 2 ** 16).item()


# ----------------------------------------------------------------------------------------------------------
# FP32 reference runs
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_cls, kwargs", [
    (torch.optim.SGD, dict(lr=1e-3, momentum=0.9)),
    (torch.optim.Adam, dict(lr=1e-3, eps=1e-8)),
    (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)),
])
def test_master_equals_fp32_reference_run(opt_cls, kwargs):
    """Same gradients (FP16-representable, as an FP16 backward makes them) fed to (a) MasterWeights over an FP16
    model and (b) an FP32 model with the same torch optimizer: master == FP32 reference bit for bit, and the model
    == the reference rounded to FP16 (torch's cast), every step."""
    init = fp16_values(64, seed=0)
    model_w = nn.Parameter(init.half())              # (64,) fp16
    ref_w = nn.Parameter(init.clone())               # (64,) fp32 reference
    master = MasterWeights([model_w], opt_cls, **kwargs)
    ref_opt = opt_cls([ref_w], **kwargs)
    for step in range(50):
        g = fp16_values(64, seed=100 + step, scale=1e-2)
        model_w.grad, ref_w.grad = g.half(), g.clone()
        master.step()
        ref_opt.step()
        assert torch.equal(master.master_params[0], ref_w), step
        assert torch.equal(model_w, ref_w.detach().half()), step
        master.zero_grad()
    # the contrast: the same optimizer stepping the FP16 params directly drifts away from the reference
    pure_w = nn.Parameter(init.half())
    pure_opt = opt_cls([pure_w], **kwargs)
    for step in range(50):
        pure_w.grad = fp16_values(64, seed=100 + step, scale=1e-2).half()
        pure_opt.step()
    assert not torch.equal(pure_w, ref_w.detach().half())


def test_small_updates_are_swamped_in_fp16_but_not_in_the_master():
    """|w| / |lr * g| = 1 / 2**-12 > 2048: each FP16 update rounds away; the FP32 master accumulates them."""
    w_pure = nn.Parameter(torch.ones(4, dtype=torch.float16))
    w = nn.Parameter(torch.ones(4, dtype=torch.float16))
    pure_opt = torch.optim.SGD([w_pure], lr=2.0 ** -12)
    master = MasterWeights([w], torch.optim.SGD, lr=2.0 ** -12)
    for _ in range(1024):
        w_pure.grad = torch.ones(4, dtype=torch.float16)
        w.grad = torch.ones(4, dtype=torch.float16)
        pure_opt.step()
        master.step()
    assert w_pure.tolist() == [1.0] * 4                    # every update lost
    assert master.master_params[0].tolist() == [0.75] * 4  # 1 - 1024 * 2**-12, exact in FP32
    assert w.tolist() == [0.75] * 4


def test_param_groups_keep_their_options():
    a, b = nn.Parameter(fp16_values(3, 1).half()), nn.Parameter(fp16_values(5, 2).half())
    master = MasterWeights([{"params": [a], "lr": 0.5}, {"params": b, "lr": 0.01, "momentum": 0.9}],
                           torch.optim.SGD, lr=0.1)
    ref_a, ref_b = nn.Parameter(a.detach().float()), nn.Parameter(b.detach().float())
    ref = torch.optim.SGD([{"params": [ref_a], "lr": 0.5}, {"params": [ref_b], "lr": 0.01, "momentum": 0.9}], lr=0.1)
    assert [g["lr"] for g in master.optimizer.param_groups] == [0.5, 0.01]
    for step in range(5):
        ga, gb = fp16_values(3, 10 + step), fp16_values(5, 20 + step)
        a.grad, b.grad, ref_a.grad, ref_b.grad = ga.half(), gb.half(), ga, gb
        master.step()
        ref.step()
    assert torch.equal(master.master_params[0], ref_a) and torch.equal(master.master_params[1], ref_b)
    assert torch.equal(a, ref_a.detach().half()) and torch.equal(b, ref_b.detach().half())


# ----------------------------------------------------------------------------------------------------------
# A real FP16 model with dynamic loss scaling, checkpoints
# ----------------------------------------------------------------------------------------------------------
def make_model(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1))
    return cast_model(model, torch.float16, keep_fp32=NORM_TYPES)


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 8, generator=g)
    return x, x[:, :1] * 0.5 - x[:, 1:2]


def train(model, master, scaler, steps, start=0, inject=(3, 11)):
    """An fp16 forward/backward per step; a NaN loss is injected at the steps in `inject`."""
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step)
        loss = F.mse_loss(model(x).float(), y)
        if step in inject:
            loss = loss * NAN
        scaler.scale(loss).backward()
        master.step(scaler)
        scaler.update()
        master.zero_grad()
        losses.append(loss.item())
    return losses


def snapshot(model, master, scaler):
    return (copy.deepcopy(model.state_dict()), copy.deepcopy(master.state_dict()), scaler.state_dict())


def assert_same(a, b):
    (m1, w1, s1), (m2, w2, s2) = a, b
    assert s1 == s2
    for k in m1:
        assert m1[k].dtype == m2[k].dtype and torch.equal(m1[k], m2[k]), k
    for t1, t2 in zip(w1["master_params"], w2["master_params"]):
        assert torch.equal(t1, t2)
    for i, st in w1["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, w2["optimizer"]["state"][i][k]), (i, k)


def test_state_dict_round_trip_resumes_bit_for_bit():
    model = make_model(0)
    master = MasterWeights(model, torch.optim.AdamW, lr=1e-2)
    scaler = DynamicLossScaler(init_scale=2.0 ** 16, growth_interval=4, hysteresis=2)
    train(model, master, scaler, 8)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "master": master.state_dict(), "scaler": scaler.state_dict()}, buf)
    train(model, master, scaler, 8, start=8)
    uninterrupted = snapshot(model, master, scaler)

    buf.seek(0)
    ckpt = torch.load(buf)
    model2 = make_model(seed=1)  # different random init: everything must come from the checkpoint
    master2 = MasterWeights(model2, torch.optim.AdamW, lr=1e-2)
    scaler2 = DynamicLossScaler()
    model2.load_state_dict(ckpt["model"])
    master2.load_state_dict(ckpt["master"])
    scaler2.load_state_dict(ckpt["scaler"])
    train(model2, master2, scaler2, 8, start=8)
    assert_same(snapshot(model2, master2, scaler2), uninterrupted)
    assert scaler2.skipped_steps == scaler.skipped_steps >= 2  # both injected NaNs (steps 3 and 11) skipped


def test_load_state_dict_rebuilds_master_from_checkpoint_not_model():
    w = nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float16))
    master = MasterWeights([w], torch.optim.SGD, lr=1.0)
    with torch.no_grad():
        master.master_params[0].copy_(torch.tensor([1.0 + 2 ** -20, -2.0 - 3 * 2 ** -20]))  # below FP16 precision
    master.copy_master_to_model()
    ckpt = copy.deepcopy(master.state_dict())
    assert w.tolist() == [1.0, -2.0]  # the model lost the low bits

    w2 = nn.Parameter(torch.tensor([7.0, 7.0], dtype=torch.float16))
    master2 = MasterWeights([w2], torch.optim.SGD, lr=1.0)
    master2.load_state_dict(ckpt)
    assert torch.equal(master2.master_params[0], ckpt["master_params"][0])  # the low bits survive
    assert w2.tolist() == [1.0, -2.0]  # rounded values written into the model
    # rebuilding from the (rounded) model would have lost them
    assert not torch.equal(w.detach().float(), ckpt["master_params"][0])
    with pytest.raises(ValueError, match="master params"):
        extra = nn.Parameter(torch.ones(1, dtype=torch.float16))
        MasterWeights([w2, extra], torch.optim.SGD, lr=1.0).load_state_dict(ckpt)


def test_with_dynamic_scaler_equals_with_torch_grad_scaler():
    """The same FP16 training with our DynamicLossScaler or torch's GradScaler (both over FP32 master grads)."""
    runs = []
    for scaler in (DynamicLossScaler(init_scale=2.0 ** 20, growth_interval=3),
                   torch.amp.GradScaler("cpu", init_scale=2.0 ** 20, growth_interval=3)):
        model = make_model(0)
        master = MasterWeights(model, torch.optim.Adam, lr=1e-2)
        losses = train(model, master, scaler, 20)
        runs.append((losses, scaler.get_scale(), [p.detach().clone() for p in model.parameters()]))
    (l1, s1, p1), (l2, s2, p2) = runs
    assert str(l1) == str(l2) and s1 == s2 and all(torch.equal(a, b) for a, b in zip(p1, p2))


def test_fp16_model_with_master_weights_trains_like_fp32():
    """An FP16 model with FP32 master weights and dynamic scaling ends close to the same model in FP32."""
    fp16_model = make_model(0)
    torch.manual_seed(0)
    fp32_model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1))
    master = MasterWeights(fp16_model, torch.optim.Adam, lr=1e-2)
    losses16 = train(fp16_model, master, DynamicLossScaler(), 60, inject=())
    opt = torch.optim.Adam(fp32_model.parameters(), lr=1e-2)
    for step in range(60):
        x, y = batch(step)
        loss = F.mse_loss(fp32_model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses16[-1] < 0.1 * losses16[0]
    assert abs(losses16[-1] - loss.item()) < 0.02 + 0.1 * loss.item()


# ----------------------------------------------------------------------------------------------------------
# cast_model, kept-FP32 params, the clipping dance, errors
# ----------------------------------------------------------------------------------------------------------
def test_cast_model_keeps_norms_fp32_and_they_are_their_own_master():
    model = make_model(0)
    lin, ln = model[0], model[1]
    assert lin.weight.dtype == torch.float16 and ln.weight.dtype == torch.float32
    x = torch.randn(4, 8)
    h = lin(x.half())
    out = ln(h)
    assert out.dtype == torch.float16  # the norm computes in FP32, hands FP16 on
    assert torch.equal(out, F.layer_norm(h.float(), (16,), ln.weight, ln.bias).half())
    assert model(x).dtype == torch.float16  # Apex O2: FP32 inputs cast to FP16 at the model's entrance
    master = MasterWeights(model, torch.optim.SGD, lr=0.1)
    dtypes = [(p.dtype, m.dtype, m is p) for p, m in zip(master.model_params, master.master_params)]
    assert dtypes == [(torch.float16, torch.float32, False)] * 2 + [(torch.float32, torch.float32, True)] * 2 + \
        [(torch.float16, torch.float32, False)] * 2
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        cast_model(nn.Linear(2, 2), torch.float32)


def test_clipping_dance_copies_grads_once():
    w = nn.Parameter(torch.zeros(2, dtype=torch.float16))
    master = MasterWeights([w], torch.optim.SGD, lr=1.0)
    scaler = DynamicLossScaler(init_scale=2.0 ** 10)
    scaler.scale((w.float() * torch.tensor([3.0, 4.0])).sum()).backward()
    master.copy_grads_to_master()
    scaler.unscale_(master.optimizer)
    norm = torch.nn.utils.clip_grad_norm_(master.parameters(), max_norm=1.0)
    master.step(scaler)  # must not copy the (scaled) FP16 grads again
    scaler.update()
    assert norm.item() == 5.0
    oracle = torch.tensor([3.0, 4.0]) * (1.0 / (5.0 + 1e-6))  # torch's clip coefficient, FP32
    assert torch.equal(master.master_params[0], -oracle.float())
    assert torch.equal(w, -oracle.half())


def test_bf16_model_and_errors():
    w = nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    master = MasterWeights([w], torch.optim.SGD, lr=2.0 ** -10)
    w.grad = torch.ones(2, dtype=torch.bfloat16)
    master.step()
    assert master.master_params[0].tolist() == [1 - 2 ** -10, 2 - 2 ** -10]
    assert w.tolist() == [1.0, 2.0]  # BF16 has 8 significant bits: the update only lives in the master
    with pytest.raises(ValueError, match="floating-point leaf"):
        MasterWeights([torch.arange(3)], torch.optim.SGD, lr=1.0)
    with pytest.raises(ValueError, match="twice"):
        MasterWeights([{"params": [w]}, {"params": [w]}], torch.optim.SGD, lr=1.0)
    with pytest.raises(ValueError, match="no parameters"):
        MasterWeights([], torch.optim.SGD, lr=1.0)
    assert master.step() is None  # no gradient at all: the optimizer skips params without .grad
