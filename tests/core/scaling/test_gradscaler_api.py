"""torch.amp.GradScaler's public API on DynamicLossScaler, run side by side with torch.amp.GradScaler.

Checklist: the behaviours PyTorch's device-generic GradScaler tests check (test/test_torch.py, the
``test_grad_scaling_*`` family: scale, unscale, update_scale, unscale_sparse, state_dict, autocast with plain /
foreach / fused optimizers and pickling, clipping, clipping with a separate unscale_, a gradient penalty,
accumulation, several models and optimizers, an optimizer that takes the scaler, gradients broken between
unscale_ and step), plus the constructor's positional device, ``enabled=False``, getters and setters and
``update(new_scale=...)``. Each test is written here anew and runs both classes; ``SCALERS`` holds the pair.
Documented policy differences are tested at the end.
"""
import copy
import pickle
import warnings

import pytest
import torch

from mpcourse.core.scaling import DynamicLossScaler

SCALERS = {"torch": torch.amp.GradScaler, "ours": DynamicLossScaler}
both = pytest.mark.parametrize("name", list(SCALERS))


def make(name, *args, **kwargs):
    return SCALERS[name]("cpu", *args, **kwargs)


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    data = [(torch.randn(6, 4), torch.randn(6, 2)) for _ in range(6)]
    return model, data


# -- construction and queries ---------------------------------------------------------------------------------
@both
def test_positional_device_and_getters(name):
    s = SCALERS[name]("cpu", 2.0 ** 10, 3.0, 0.25, 7)  # torch's positional order
    assert (s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (
        1024.0, 3.0, 0.25, 7)
    assert s.is_enabled()
    s.set_growth_factor(4.0)
    s.set_backoff_factor(0.125)
    s.set_growth_interval(3)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (4.0, 0.125, 3)
    sd = s.state_dict()  # torch's five keys (ours adds its hysteresis fields)
    assert {k: sd[k] for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")} \
        == {"scale": 1024.0, "growth_factor": 4.0, "backoff_factor": 0.125, "growth_interval": 3,
            "_growth_tracker": 0}


def test_get_init_scale_matches_torchs_init_scale():
    ours, ref = make("ours", init_scale=8.0), make("torch", init_scale=8.0)
    assert ours.get_init_scale() == ref._init_scale == 8.0
    sd = make("torch", init_scale=32.0).state_dict()
    ours.load_state_dict(sd)
    ref.load_state_dict(sd)
    assert ours.get_init_scale() == ref._init_scale == 32.0


@both
def test_setters_change_the_trajectory(name):
    s, w = make(name, init_scale=4.0, growth_interval=1), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=1.0)
    trace = []
    for g, setter in [(1.0, None), (float("inf"), ("set_backoff_factor", 0.25)), (1.0, ("set_growth_factor", 3.0)),
                      (1.0, ("set_growth_interval", 2)), (1.0, None), (1.0, None)]:
        if setter:
            getattr(s, setter[0])(setter[1])
        w.grad = s.scale(torch.tensor([g]))
        s.step(opt)
        s.update()
        trace.append(s.get_scale())
    assert trace == [8.0, 2.0, 6.0, 6.0, 18.0, 18.0]


@both
def test_enabled_false_passes_everything_through(name):
    s = make(name, enabled=False)
    assert not s.is_enabled() and s.get_scale() == 1.0 and s.state_dict() == {}
    x = torch.tensor([2.0, float("inf")])
    assert s.scale(x) is x
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=1.0)
    w.grad = x.clone()
    s.unscale_(opt)  # no-op
    assert torch.equal(w.grad, x)
    s.step(opt)  # just steps, inf included
    s.update()
    assert w[0].item() == -2.0 and w[1].item() == float("-inf")
    s.load_state_dict({"anything": 1})  # ignored when disabled
    # a closure is fine when disabled: step just calls optimizer.step(closure)
    assert s.step(opt, lambda: torch.tensor(3.0)).item() == 3.0


@both
def test_update_new_scale_float_and_tensor(name):
    s, w = make(name, init_scale=64.0, growth_interval=2), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=1.0)
    w.grad = s.scale(torch.tensor([1.0]))
    s.step(opt)
    s.update(new_scale=4.0)
    assert s.get_scale() == 4.0 and s._get_growth_tracker() == 0  # not an update by the rule: tracker kept
    t = torch.tensor(16.0)
    s.update(new_scale=t)
    t.fill_(3.0)  # later changes to the tensor do not reach the scaler
    assert s.get_scale() == 16.0
    w.grad = s.scale(torch.tensor([1.0]))  # the new scale is used
    assert w.grad.item() == 16.0


# -- the kernels' contract (test_grad_scaling_scale / _unscale / _update_scale / _unscale_sparse) --------------
@both
def test_scale_keeps_structures(name):
    s = make(name, init_scale=2.0)
    t0, t1 = torch.full((1,), 4.0), torch.full((1,), 8.0, dtype=torch.float64)
    out = s.scale((t1, [t0, (t1, t0)]))
    assert isinstance(out, tuple) and isinstance(out[1], list) and isinstance(out[1][1], tuple)
    assert [out[0].item(), out[1][0].item(), out[1][1][0].item()] == [16.0, 8.0, 16.0]
    assert out[0].dtype == torch.float64 and s._scale.device == t0.device
    assert [x.item() for x in s.scale(iter([t0, t0]))] == [8.0, 8.0]


@both
def test_unscale_divides_and_flags_per_dtype(name):
    s = make(name, init_scale=4.0)
    s.scale(torch.ones(()))
    ps = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, dtype=torch.float64))]
    opt = torch.optim.SGD(ps, lr=1.0)
    ps[0].grad, ps[1].grad = torch.full((3,), 8.0), torch.full((2,), 2.0, dtype=torch.float64)
    s.unscale_(opt)
    assert ps[0].grad.tolist() == [2.0] * 3 and ps[1].grad.tolist() == [0.5] * 2
    assert sum(v.item() for v in s._found_inf_per_device(opt).values()) == 0
    s.update()
    ps[1].grad = torch.tensor([1.0, float("nan")], dtype=torch.float64)
    s.unscale_(opt)
    assert sum(v.item() for v in s._found_inf_per_device(opt).values()) == 1


@both
def test_update_scale_rule(name):
    """Two clean iterations grow by growth_factor at growth_interval 2; an overflow backs off and resets."""
    s, w = make(name, init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2), \
        torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=1.0)
    seen = []
    for g in [1.0, 1.0, float("inf"), 1.0]:
        w.grad = s.scale(torch.tensor([g]))
        s.step(opt)
        s.update()
        seen.append((s.get_scale(), s._get_growth_tracker()))
    assert seen == [(4.0, 1), (8.0, 0), (2.0, 0), (2.0, 1)]


@both
def test_unscale_sparse(name):
    s = make(name, init_scale=4.0)
    s.scale(torch.ones(()))
    w = torch.nn.Parameter(torch.zeros(2, 3))
    opt = torch.optim.SGD([w], lr=1.0)
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    w.grad = torch.sparse_coo_tensor(i, torch.tensor([8.0, 4.0, 12.0]), (2, 3)).coalesce()
    s.unscale_(opt)
    assert w.grad.to_dense().tolist() == [[0.0, 0.0, 2.0], [1.0, 0.0, 3.0]]
    assert sum(v.item() for v in s._found_inf_per_device(opt).values()) == 0
    s.update()
    w.grad = torch.sparse_coo_tensor(i, torch.tensor([8.0, float("inf"), 12.0]), (2, 3)).coalesce()
    s.unscale_(opt)
    assert sum(v.item() for v in s._found_inf_per_device(opt).values()) == 1


@pytest.mark.parametrize("lazy_init", [False, True])
@both
def test_state_dict_round_trip(name, lazy_init):
    s0 = make(name, init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = make(name, init_scale=6.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=1)
    if lazy_init:
        s1.scale(torch.full((1,), 4.0))  # live tensors exist: load must fill them
    s1.load_state_dict(s0.state_dict())
    assert (s1.get_scale(), s1.get_growth_factor(), s1.get_backoff_factor(), s1.get_growth_interval(),
            s1._get_growth_tracker()) == (3.0, 4.0, 0.5, 2, 0)
    if lazy_init:
        assert s1._scale.item() == 3.0


# -- whole training loops (test_grad_scaling_autocast and friends) ---------------------------------------------
OPTIMIZERS = [(torch.optim.SGD, {}), (torch.optim.Adam, {}), (torch.optim.AdamW, {"foreach": True}),
              (torch.optim.SGD, {"fused": True}), (torch.optim.Adam, {"fused": True}),
              (torch.optim.AdamW, {"fused": True})]


def run_case(name, opt_ctor, opt_kwargs, enabled=True, skip_iter=2, pickle_at=None, autocast=False):
    """The control run (no scaler; the optimizer step at skip_iter left out) and the scaled run where an inf
    is planted into one gradient at skip_iter. Returns (control params, scaled params, final scale)."""
    model, data = model_and_data()
    control = copy.deepcopy(model)
    opt_c = opt_ctor(control.parameters(), lr=0.05, **opt_kwargs)
    opt_s = opt_ctor(model.parameters(), lr=0.05, **opt_kwargs)
    scaler = make(name, init_scale=128.0, growth_factor=2.0, growth_interval=1, enabled=enabled)
    for i, (x, y) in enumerate(data):
        for m, opt, scaled in ((control, opt_c, False), (model, opt_s, True)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = torch.nn.functional.mse_loss(m(x).float(), y)
            if scaled:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    m[2].weight.grad.fill_(float("inf"))
                scaler.step(opt)
                scaler.update()
                if pickle_at == i:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if not (i == skip_iter and enabled):
                    opt.step()
    return list(control.parameters()), list(model.parameters()), scaler.get_scale()


@pytest.mark.parametrize("opt_ctor, opt_kwargs", OPTIMIZERS,
                         ids=[f"{c.__name__}{''.join(k)}" for c, k in OPTIMIZERS])
def test_training_loop_side_by_side(opt_ctor, opt_kwargs):
    results = {name: run_case(name, opt_ctor, opt_kwargs, pickle_at=3) for name in SCALERS}
    for name, (control, scaled, scale) in results.items():
        assert scale == 128.0 * 2.0 ** 5 * 0.5, name  # 5 growths (growth_interval 1), one backoff
        for c, s in zip(control, scaled):
            torch.testing.assert_close(s, c, rtol=1e-5, atol=1e-7)
    for a, b in zip(results["ours"][1], results["torch"][1]):
        assert torch.equal(a, b)  # the same operations in the same order: bit for bit


@both
def test_training_loop_disabled_and_under_autocast(name):
    control, scaled, scale = run_case(name, torch.optim.SGD, {}, enabled=False)
    assert scale == 1.0 and all(torch.equal(c, s) for c, s in zip(control, scaled))
    control, scaled, scale = run_case(name, torch.optim.Adam, {}, autocast=True)
    for c, s in zip(control, scaled):
        torch.testing.assert_close(s, c, rtol=1e-4, atol=1e-5)


def clipping_run(name, separate_unscale, max_norm=0.2):
    model, data = model_and_data(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = make(name, init_scale=2.0 ** 8, growth_interval=2)
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        s.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if i == 2:
            model[0].bias.grad[0] = float("inf")
        if separate_unscale:
            s.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        else:  # clip the scaled grads with a scaled max_norm (the older recipe)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * s.get_scale())
        s.step(opt)
        s.update()
    return [p.detach().clone() for p in model.parameters()], s.get_scale()


@pytest.mark.parametrize("separate_unscale", [True, False])
def test_clipping_side_by_side(separate_unscale):
    (ours, s_ours), (ref, s_ref) = (clipping_run(n, separate_unscale) for n in ("ours", "torch"))
    assert s_ours == s_ref == 2.0 ** 8 * 2.0 * 0.5 * 2.0  # growths after steps 1 and 4, a backoff at step 2
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


@both
def test_gradient_penalty_with_unscaled_autograd_grad(name):
    """Penalty on the gradient norm: autograd.grad of the scaled loss, divided by the scale by hand."""
    model, data = model_and_data(2)
    control = copy.deepcopy(model)
    for m, scaler in ((control, None), (model, make(name, init_scale=2.0 ** 6))):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        for x, y in data:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            scaled = scaler.scale(loss) if scaler else loss
            grads = torch.autograd.grad(scaled, list(m.parameters()), create_graph=True)
            if scaler:
                grads = [g / scaler.get_scale() for g in grads]
            penalty = sum(g.pow(2).sum() for g in grads).sqrt()
            total = loss + penalty
            (scaler.scale(total) if scaler else total).backward()
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
    for c, s in zip(control.parameters(), model.parameters()):
        torch.testing.assert_close(s, c, rtol=1e-5, atol=1e-7)


@both
def test_accumulation_steps_once_per_window(name):
    model, data = model_and_data(3)
    control = copy.deepcopy(model)
    for m, scaler in ((control, None), (model, make(name, init_scale=2.0 ** 4, growth_interval=1))):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        for i, (x, y) in enumerate(data):
            loss = torch.nn.functional.mse_loss(m(x), y) / 3
            (scaler.scale(loss) if scaler else loss).backward()
            if (i + 1) % 3 == 0:
                if scaler:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad()
        if scaler:
            assert scaler.get_scale() == 2.0 ** 6  # one update per window
    for c, s in zip(control.parameters(), model.parameters()):
        torch.testing.assert_close(s, c, rtol=1e-5, atol=1e-7)


def multiple_run(name):
    """Two models, two optimizers, two losses, one scaler; an inf in model 1 at step 2 skips only its step."""
    (m0, data), (m1, _) = model_and_data(4), model_and_data(5)
    opt0, opt1 = torch.optim.SGD(m0.parameters(), lr=0.05), torch.optim.Adam(m1.parameters(), lr=0.01)
    s = make(name, init_scale=2.0 ** 7, growth_interval=1)
    for i, (x, y) in enumerate(data):
        opt0.zero_grad()
        opt1.zero_grad()
        out0 = m0(x)
        loss0 = torch.nn.functional.mse_loss(out0, y)
        loss1 = torch.nn.functional.mse_loss(m1(x) + out0.detach(), y)
        s.scale(loss0).backward()
        s.scale(loss1).backward()
        if i == 2:
            m1[2].weight.grad.fill_(float("inf"))
        s.step(opt0)
        s.step(opt1)
        s.update()
    return [p.detach().clone() for p in list(m0.parameters()) + list(m1.parameters())], s.get_scale()


def test_multiple_models_and_optimizers_side_by_side():
    (ours, s_ours), (ref, s_ref) = multiple_run("ours"), multiple_run("torch")
    assert s_ours == s_ref == 2.0 ** 7 * 2.0 ** 5 * 0.5
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


# -- optimizers that do their own scaling (test_grad_scaler_pass_itself) ---------------------------------------
class AttributeProtocol(torch.optim.Optimizer):
    """Declares _step_supports_amp_scaling and reads grad_scale / found_inf, as torch's fused optimizers do."""

    def __init__(self, params):
        super().__init__(params, {})
        self._step_supports_amp_scaling = True
        self.seen = []

    def step(self, closure=None):
        self.seen.append((self.grad_scale, self.found_inf.item()))
        if not self.found_inf.item():
            for g in self.param_groups:
                for p in g["params"]:
                    p.data.sub_(p.grad / self.grad_scale)


class KeywordProtocol(AttributeProtocol):
    """The older contract: step() takes grad_scaler= and queries the scaler itself."""

    def step(self, closure=None, grad_scaler=None):
        found = grad_scaler._check_inf_per_device(self)
        self.seen.append((type(grad_scaler).__name__, sum(v.item() for v in found.values()),
                          grad_scaler._get_scale_async().item()))


@both
def test_optimizer_with_step_supports_amp_scaling(name):
    s = make(name, init_scale=4.0)
    w = torch.nn.Parameter(torch.zeros(2))
    opt = AttributeProtocol([w])
    for g in ([1.0, 2.0], [float("inf"), 0.0]):
        w.grad = s.scale(torch.tensor(g))
        s.step(opt)
        s.update()
    assert [(float(gs), f) for gs, f in opt.seen] == [(4.0, 0.0), (4.0, 1.0)]
    assert w.tolist() == [-1.0, -2.0] and not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    assert s.get_scale() == 2.0
    kw = KeywordProtocol([w])
    w.grad = s.scale(torch.tensor([float("nan"), 0.0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the keyword contract
        s.step(kw)
    s.update()
    assert kw.seen == [(type(s).__name__, 1.0, 2.0)] and s.get_scale() == 1.0


@both
def test_keyword_contract_warns_as_torch(name):
    """torch.amp.GradScaler.step warns FutureWarning (at the caller's line) when it passes itself as
    grad_scaler=; the library's scalers warn the same way, and not for the attribute contract."""
    def warns(scaler, opt_cls):
        w = torch.nn.Parameter(torch.zeros(2))
        opt = opt_cls([w])
        w.grad = scaler.scale(torch.tensor([1.0, 2.0]))
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            scaler.step(opt)
        scaler.update()
        return [(r.category, r.filename) for r in rec if issubclass(r.category, FutureWarning)]

    ref = warns(torch.amp.GradScaler("cpu", init_scale=4.0), KeywordProtocol)
    assert ref == [(FutureWarning, __file__)]                      # the oracle: torch warns at the caller
    assert warns(make(name, init_scale=4.0), KeywordProtocol) == ref
    assert warns(make(name, init_scale=4.0), AttributeProtocol) == []


# -- policies shared with torch and policy differences ---------------------------------------------------------
@both
def test_grads_broken_between_unscale_and_step_are_not_checked_again(name):
    """As torch: the inf/NaN flag is taken in unscale_; a gradient changed afterwards is the caller's."""
    s, w = make(name), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=1.0)
    w.grad = s.scale(torch.tensor([1.0, 1.0]))
    s.unscale_(opt)
    w.grad.fill_(float("nan"))
    s.step(opt)
    s.update()
    assert torch.isnan(w).all()


@both
def test_pickling_mid_iteration_is_refused(name):
    s, w = make(name), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=1.0)
    w.grad = s.scale(torch.tensor([1.0]))
    s.unscale_(opt)
    with pytest.raises((RuntimeError, AssertionError), match="pickled"):
        pickle.dumps(s)
    s.step(opt)
    s.update()
    s2 = pickle.loads(pickle.dumps(s))
    assert s2.get_scale() == s.get_scale() and s2._scale is None


def test_policy_differences_are_deliberate():
    # 1. setters and new_scale validate (torch accepts a growth factor of 0.5 and a new scale of 0)
    ref, ours = make("torch"), make("ours")
    ref.set_growth_factor(0.5)
    with pytest.raises(ValueError, match="growth_factor"):
        ours.set_growth_factor(0.5)
    # 2. a "cuda" scaler stays enabled without CUDA (torch warns and disables itself)
    if not torch.cuda.is_available():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            assert not torch.amp.GradScaler("cuda").is_enabled()
        assert DynamicLossScaler("cuda").is_enabled()
    # 3. a number as the first argument is refused (it is the device, as in torch), naming the fix
    with pytest.raises(TypeError, match="init_scale="):
        DynamicLossScaler(1024.0)
    # 4. an int new_scale is accepted (torch requires a float or a tensor)
    ours.scale(torch.ones(()))
    ours.update(new_scale=8)
    assert ours.get_scale() == 8.0
    # 5. FP16 gradients are refused by unscale_ in both; BF16 only by ours (see tests/core/scaling/test_scaling.py)
