"""``BF16Optimizer`` steps without changing its parameters' dtype, and gives the bits of the rule it replaced.

Until this version the wrapper set every ``param.data`` to an FP32 temporary for the wrapped optimizer's step and
back to the BF16 storage afterwards. That rule is kept here, written out again (``dtype_swap_step``), as the
oracle: the same parameters, gradients and seeds go through both side by side for several steps and every bit
must agree (weights, AdamW state, Kahan compensation, the stochastic-rounding generator, the lost/changed
counts), for the three write-backs of the pure-BF16 recipes. The point of the change is checked too: the
parameter keeps its dtype, storage and autograd gradient accumulator (the node DDP's reducer hooks), which the
old rule did not (the control below shows it).
"""
import pytest
import torch

from mpcourse.core.bf16 import BF16Optimizer, kahan_add_, stochastic_round_bf16

VARIANTS = {"bf16-pure": dict(rounding="nearest"), "bf16-pure-sr": dict(rounding="stochastic"),
            "bf16-pure-kahan": dict(rounding="nearest", kahan=True)}


class DtypeSwapStep:
    """The previous rule of ``BF16Optimizer.step``, independent of the library's wrapper: FP32 ``param.data`` and
    ``param.grad`` during the wrapped step, state in FP32 during it, then the BF16 write-back into the old storage."""

    def __init__(self, optimizer, rounding="nearest", kahan=False, seed=0, state_dtype=torch.bfloat16):
        self.optimizer, self.rounding, self.kahan, self.state_dtype = optimizer, rounding, kahan, state_dtype
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.generator = torch.Generator().manual_seed(seed)
        self.comp = [torch.zeros_like(p) for p in self.params] if kahan else None
        self.grads = [None] * len(self.params)
        self.lost = self.changed = 0

    @torch.no_grad()
    def accumulate_grads(self):
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self.grads[i] = p.grad.float() if self.grads[i] is None else self.grads[i].add_(p.grad)
                p.grad = None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        self.accumulate_grads()
        grads = [g for g in self.grads if g is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)

    def _state_to(self, p, dtype):
        st = self.optimizer.state.get(p, {})
        for k, v in st.items():
            if k != "step" and torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape:
                st[k] = v.to(dtype)

    @torch.no_grad()
    def step(self):
        self.accumulate_grads()
        saved = []
        for i, p in enumerate(self.params):
            w16 = p.data
            p.grad = None
            p.data = w16.float()
            p.grad = self.grads[i]
            self._state_to(p, torch.float32)
            saved.append(w16)
        self.optimizer.step()
        self.lost = self.changed = 0
        for i, (p, w16) in enumerate(zip(self.params, saved)):
            w32, old = p.data, w16.clone()
            if self.kahan:
                kahan_add_(w16, self.comp[i], w32 - old.float())
            elif self.rounding == "nearest":
                w16.copy_(w32)
            else:
                w16.copy_(stochastic_round_bf16(w32.clone(), self.generator))
            wanted = w32 != old.float()
            self.changed += int(wanted.sum())
            self.lost += int((wanted & (w16 == old)).sum())
            p.grad = None
            p.data = w16
            self._state_to(p, self.state_dtype)

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)
        self.grads = [None] * len(self.params)


def _params(seed=0, shapes=((33, 16), (16,), (7, 5, 3))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in shapes]


def _grads(params, step, micro):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return [(torch.randn(p.shape, generator=g) * 10.0 ** -(1 + micro)).to(torch.bfloat16) for p in params]


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_in_place_step_gives_the_bits_of_the_dtype_swap_rule(variant, state_dtype):
    """Eight AdamW steps (weight decay on), two micro-batches each, clipping on every other step (so some
    steps clip and some do not): every bit of both optimizers' results is compared after every step."""
    new_p, old_p = _params(), _params()
    kw = dict(VARIANTS[variant], seed=7, state_dtype=state_dtype)
    new = BF16Optimizer(torch.optim.AdamW(new_p, lr=3e-3, weight_decay=0.1), **kw)
    old = DtypeSwapStep(torch.optim.AdamW(old_p, lr=3e-3, weight_decay=0.1), **kw)
    changed_bits = 0
    for step in range(8):
        for micro in range(2):
            for opt, params in ((new, new_p), (old, old_p)):
                for p, g in zip(params, _grads(params, step, micro)):
                    p.grad = g
                opt.accumulate_grads()
        if step % 2:
            new.clip_grad_norm_(0.05), old.clip_grad_norm_(0.05)
        before = [p.detach().clone() for p in new_p]
        new.step(), old.step()
        for p, q, b in zip(new_p, old_p, before):
            assert p.dtype == torch.bfloat16 and torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16))
            changed_bits += int((p.detach() != b).sum())
            for k in ("exp_avg", "exp_avg_sq", "step"):
                s, t = new.state[p][k], old.optimizer.state[q][k]
                assert s.dtype == t.dtype and torch.equal(s, t), k
        assert (new.lost, new.changed) == (old.lost, old.changed)
        assert torch.equal(new.generator.get_state(), old.generator.get_state())
        if new.comp is not None:
            assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(new.comp, old.comp))
        new.zero_grad(), old.zero_grad()
    assert changed_bits > 0 and new.lost > 0 or variant != "bf16-pure"   # the weights moved; some updates lost


def _accumulator(p):
    return p.view_as(p).grad_fn.next_functions[0][0]            # autograd's AccumulateGrad node of p


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_parameter_keeps_dtype_storage_and_gradient_accumulator(variant):
    params = _params()
    opt = BF16Optimizer(torch.optim.AdamW(params, lr=1e-2), **VARIANTS[variant])
    before = [(p.dtype, p.data_ptr(), _accumulator(p)) for p in params]
    fired = []
    for acc in (b[2] for b in before):                          # held, as DDP's reducer holds them
        acc.register_hook(lambda *_: fired.append(1))
    for step in range(3):
        sum((p.float() ** 2).sum() for p in params).backward()
        opt.step()
        opt.zero_grad()
    assert [(p.dtype, p.data_ptr(), _accumulator(p)) for p in params] == before
    assert len(fired) == 3 * len(params)                        # the hooks saw every backward


def test_the_dtype_swap_rule_resets_the_accumulator():
    """The control: the old rule hands autograd a new accumulator after the first step, so a hook registered
    at construction (DDP's) stops firing; this is what the test above guards against."""
    params = _params()
    opt = DtypeSwapStep(torch.optim.AdamW(params, lr=1e-2))
    fired, held = [], [_accumulator(p) for p in params]      # held, as DDP's reducer holds them
    for acc in held:
        acc.register_hook(lambda *_: fired.append(1))
    for step in range(3):
        sum((p.float() ** 2).sum() for p in params).backward()
        opt.step()
        opt.zero_grad()
    assert len(fired) == len(params)                            # only the first backward reached the hooks


def test_the_generator_stream_splits_at_any_element():
    """What a sharded step relies on (``BF16Optimizer._skip_draws``): the CPU generator draws the 16-bit
    numbers of ``stochastic_round_bf16`` one per element in order, so skipping k draws and drawing the rest
    gives the tail of one draw of the whole tensor."""
    whole = torch.randint(0, 1 << 16, (1000,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    for k in (0, 1, 333, 999):
        g = torch.Generator().manual_seed(3)
        torch.randint(0, 1 << 16, (k,), generator=g, dtype=torch.int32)
        assert torch.equal(torch.randint(0, 1 << 16, (1000 - k,), generator=g, dtype=torch.int32), whole[k:])
