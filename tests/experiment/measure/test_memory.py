"""Memory counted from live tensors (mpcourse.experiment.measure.memory), against hand-computed byte totals and,
for the peak, against torch's own tracker (torch.distributed._tools.mem_tracker.MemTracker)."""
from types import SimpleNamespace

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from mpcourse.core.emulation import tensor_cores
from mpcourse.core.optim.state import LowPrecisionState
from mpcourse.core.quant import Float8Linear
from mpcourse.experiment.gpt.data import load_corpus
from mpcourse.experiment.measure.memory import PeakTracker, measure_step
from mpcourse.experiment.gpt.model import GPTConfig
from recipe_loop import make_recipe

L, C, H, T, B = 1, 32, 2, 16, 4
TINY = GPTConfig(n_layer=L, n_embd=C, n_head=H, block_size=T)
N = B * T                                               # tokens per step


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(None)


def n_params(V):
    """Hand count: embeddings, per block 2 LayerNorms + qkv + proj + fc + proj (with biases), ln_f; tied head."""
    block = 2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)
    return V * C + T * C + L * block + 2 * C


# bytes per parameter by hand: (weights, grads, master, optimizer); extra handled per recipe below
STATE = {
    "fp32": (4, 4, 0, 8), "torch-amp-bf16": (4, 4, 0, 8), "torch-amp-fp16": (4, 4, 0, 8), "bf16-autocast": (4, 4, 0, 8),
    "fp16-pure": (2, 2, 0, 4),                            # fp16 everything, AdamW state fp16
    "fp16-master": (2, 2 + 4, 4, 8), "fp16-static": (2, 2 + 4, 4, 8), "fp16-dynamic": (2, 2 + 4, 4, 8),
    "bf16-master": (2, 2 + 4, 4, 8),
    "bf16-pure": (2, 4, 0, 4), "bf16-pure-sr": (2, 4, 0, 4), "bf16-pure-kahan": (2, 4, 0, 4),  # fp32 grad buffers
    "bf16-master-bf16-moments": (2, 2 + 4, 4, 4),         # DeepSeek-V3: moments in bf16
    "bf16-master-bf16-moments-sr": (2, 2 + 4, 4, 4),      # the same, rounded stochastically
    "fp8-current": (4, 4, 0, 8), "fp8-delayed": (4, 4, 0, 8),
}
FP8_WEIGHTS = [(3 * C, C), (C, C), (4 * C, C), (C, 4 * C)]   # per block: qkv, proj, fc, mlp.proj (N, K)


def activations_by_hand(V, fbytes=4, fp8=False):
    """Bytes autograd saves in one forward of the tiny GPT, op by op (parameters excluded). ``fbytes``: bytes of
    the compute dtype; ``fp8``: the four linears of each block save their input in E4M3 (1 B) + a scale_inv."""
    lin_in = (lambda k: N * k * 1 + 4) if fp8 else (lambda k: N * k * fbytes)
    ln = N * C * fbytes + 2 * N * fbytes                  # input, mean, rstd
    block = (ln + lin_in(C)                               # ln1; qkv input
             + 2 * N * C * fbytes                         # q and k^T copied for the batched matmul
             + T * T                                      # causal mask (bool buffer)
             + B * H * T * T * fbytes                     # softmax output (att, also reused by att @ v)
             + N * C * fbytes                             # v copied for att @ v
             + lin_in(C)                                  # attn proj input
             + ln + lin_in(C)                             # ln2; fc input
             + N * 4 * C * fbytes                         # GELU input
             + lin_in(4 * C))                             # mlp proj input
    head = (N * 8 + T * 8                                 # token ids, positions (int64)
            + ln + N * C * fbytes                         # ln_f; head input
            + N * V * 4 + N * 8 + 4)                      # log_softmax output (fp32 loss), targets, total_weight
    return L * block + head


_MEASURED = {}


def measure(name, corpus):
    """(recipe, StepMemory, batch) of one measured step of ``name`` on the tiny GPT (computed once per recipe)."""
    if name not in _MEASURED:
        _MEASURED[name] = _measure(name, corpus)
    return _MEASURED[name]


def _measure(name, corpus):
    r = make_recipe(name, corpus, TINY)
    x, y = corpus.batch("train", B, T, torch.Generator().manual_seed(0))
    with tensor_cores():
        _, _, mem = measure_step(r, x, y)
    return r, mem, (x, y)


@pytest.mark.parametrize("name", list(STATE))
def test_state_bytes_match_the_hand_count(name, corpus):
    r, mem, _ = measure(name, corpus)
    P = n_params(corpus.vocab_size)
    assert mem.n_params == P
    w, g, m, o = STATE[name]
    extra = 0
    if name == "bf16-pure-kahan":
        extra = 2 * P                                     # bf16 compensation buffer
    if name == "fp8-delayed":
        from mpcourse.experiment.recipes.fp8 import AMAX_HISTORY_LEN
        extra = L * len(FP8_WEIGHTS) * 3 * (1 + AMAX_HISTORY_LEN) * 4   # per layer 3 x (scale + history), fp32
    assert (mem.weights, mem.grads, mem.master, mem.optimizer, mem.extra) == (w * P, g * P, m * P, o * P, extra)
    assert r.memory() == {k: getattr(mem, k) for k in ("weights", "grads", "master", "optimizer", "extra")}


@pytest.mark.parametrize("name,fbytes,fp8", [
    ("fp32", 4, False), ("fp16-pure", 2, False), ("fp16-master", 2, False), ("bf16-master", 2, False),
    ("bf16-pure", 2, False), ("bf16-master-bf16-moments", 2, False), ("fp8-current", 4, True), ("fp8-delayed", 4, True)])
def test_activation_bytes_match_the_hand_count(name, fbytes, fp8, corpus):
    _, mem, _ = measure(name, corpus)
    assert mem.activations == activations_by_hand(corpus.vocab_size, fbytes, fp8)
    # FP8 layers also save an E4M3 copy of each weight (+ its scale_inv): weight-sized, added, not saved
    cache = L * sum(n * k + 4 for n, k in FP8_WEIGHTS) if fp8 else 0
    assert mem.fp8_cache == cache


def test_claim_d_fp8_keeps_the_fp32_state_and_adds_copies(corpus):
    """FP8 compute does not lower model state: the fp32 weights stay and the FP8 copies are added. What FP8
    saves is the linear layers' saved inputs (1 byte instead of 4)."""
    _, m32, _ = measure("fp32", corpus)
    _, m8, _ = measure("fp8-current", corpus)
    assert m8.state == m32.state
    assert m8.activations < m32.activations
    assert m32.activations - m8.activations == L * (3 * N * C + N * 4 * C) * 3 - L * 4 * 4


def test_fp8_weights_bytes_by_hand(corpus):
    """fp8-delayed-fp8-weights: the FP8 layers' weights are stored as E4M3 (1 B) and their FP32 masters (4 B) sit in
    the optimizer; gradients are the masters' (FP32); AdamW's moments stay 8 B. The rest is FP32 as fp8-delayed."""
    from mpcourse.experiment.recipes.fp8 import AMAX_HISTORY_LEN
    r, mem, _ = measure("fp8-delayed-fp8-weights", corpus)
    P, F = n_params(corpus.vocab_size), L * sum(n * k for n, k in FP8_WEIGHTS)   # F: FP8-stored weight elements
    assert mem.n_params == P
    assert (mem.weights, mem.grads, mem.master, mem.optimizer) == (4 * (P - F) + 1 * F, 4 * P, 4 * F, 8 * P)
    per_layer = 3 * (1 + AMAX_HISTORY_LEN) * 4 + 4                 # delayed-scaling states + the weight's scale_inv
    assert mem.extra == L * len(FP8_WEIGHTS) * per_layer
    # the same activations as fp8-delayed; no FP8 weight copies: the stored weight is the parameter itself
    assert mem.activations == activations_by_hand(corpus.vocab_size, 4, fp8=True) and mem.fp8_cache == 0
    # claim (d) with FP8 weights: the module's weight drops 4 -> 1 B, but the FP32 master is a new 4 B copy
    _, m8, _ = measure("fp8-delayed", corpus)
    assert m8.weights - mem.weights == 3 * F and mem.master - m8.master == 4 * F
    assert mem.state - m8.state == F + L * len(FP8_WEIGHTS) * 4
    assert r.memory() == {k: getattr(mem, k) for k in ("weights", "grads", "master", "optimizer", "extra")}


@pytest.mark.parametrize("name", [*STATE, "fp8-delayed-fp8-weights"])
def test_peak_equals_torch_mem_tracker(name, corpus, monkeypatch):
    """Oracle: MemTracker, told about every tensor alive before the step, over the same step."""
    _, mem, (x, y) = measure(name, corpus)
    for hook in ("register_hook", "register_post_accumulate_grad_hook") if name == "fp8-delayed-fp8-weights" else ():
        # MemTracker hooks every parameter's gradient, which torch refuses for a parameter without grad (the FP8
        # weights); such a hook would never run, so it is skipped there
        real = getattr(torch.Tensor, hook)
        monkeypatch.setattr(torch.Tensor, hook, lambda t, fn, real=real: real(t, fn) if t.requires_grad
                            else SimpleNamespace(remove=lambda: None))
    r = make_recipe(name, corpus, TINY)
    opt = getattr(r.optimizer, "optimizer", r.optimizer)            # BF16Optimizer wraps a torch optimizer
    before = [t for ts in r.memory_tensors().values() for t in ts] + [p for g in opt.param_groups for p in g["params"]]
    mt = MemTracker()
    mt.track_external(r.model, opt, x, y, *before)
    with tensor_cores(), mt:
        with r.forward_context():
            loss = r.model(x, y)[1]                                  # as the training step: logits not kept
        r.backward(loss)
        r.step()
    assert mem.peak == mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert mem.peak > mem.state


def test_peak_tracker_on_planted_allocations():
    base = torch.zeros(1000)                                          # 4000 B alive before
    with PeakTracker([base]) as pt:
        a = torch.ones(3000)                                          # +12000
        b = a * 2                                                     # +12000 -> 28000 at most
        del a, b
        c = torch.ones(500)                                           # after the frees: 4000 + 2000
        assert pt.live_bytes() == 6000
    assert pt.peak == 28000
    del c


def test_bf16_moments_first_adamw_step_by_hand():
    """One AdamW step from zero state: m = (1-b1) g and v = (1-b2) g^2 rounded to bf16 and stored; the update is
    the closed form with the *fp32* moments (rounding happens after the step)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64))
    g = torch.randn(64) * 1e-2
    w0 = w.detach().clone()
    opt = LowPrecisionState(torch.optim.AdamW, torch.bfloat16)([w], lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                                                             weight_decay=0.0)
    w.grad = g.clone()
    opt.step()
    st = opt.state[w]
    assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16 and w.dtype == torch.float32
    assert torch.equal(st["exp_avg"], ((1 - 0.9) * g).to(torch.bfloat16))
    assert torch.equal(st["exp_avg_sq"], ((1 - 0.99) * g * g).to(torch.bfloat16))
    m_hat, v_hat = (0.1 * g) / 0.1, (0.01 * g * g) / 0.01
    torch.testing.assert_close(w.detach(), w0 - 1e-2 * m_hat / (v_hat.sqrt() + 1e-8), rtol=1e-5, atol=1e-7)
    # second step: the stored bf16 moments are what the step reads (upcast exactly)
    m1, v1 = st["exp_avg"].float(), st["exp_avg_sq"].float()
    w.grad = g.clone()
    opt.step()
    torch.testing.assert_close(st["exp_avg"].float(), (0.9 * m1 + 0.1 * g).to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="state_dtype"):
        LowPrecisionState(torch.optim.AdamW, torch.float8_e4m3fn)


@pytest.mark.parametrize("name", ["fp8-moments", "int8-moments"])
def test_blockwise_moments_bytes_by_hand(name, corpus):
    """FP32 weights and grads; AdamW's two moments 1 byte each + one FP32 scale per 256 where a tensor has >= 4096
    elements and a multiple of 256 (torchao's rule), FP32 (2 x 4 bytes) elsewhere. In the tiny GPT only the MLP's
    two (4C x C) weights qualify (4096 elements); qkv (3C x C = 3072) and the embeddings do not."""
    r, mem, _ = measure(name, corpus)
    P = n_params(corpus.vocab_size)
    Q = L * 2 * 4 * C * C                                 # fc and mlp.proj weights
    assert Q == L * 2 * 4096
    optimizer = (P - Q) * 8 + 2 * (Q * 1 + Q // 256 * 4)
    assert (mem.weights, mem.grads, mem.master, mem.optimizer, mem.extra) == (4 * P, 4 * P, 0, optimizer, 0)
    quantized = [p for p in r.optimizer.param_groups[0]["params"] if "exp_avg_scale" in r.optimizer.state[p]]
    assert sorted(p.numel() for p in quantized) == [4096] * (2 * L)
