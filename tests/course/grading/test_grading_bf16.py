"""Lesson 06 graders: pass on the library's reference implementations, reject planted plausible wrong ones."""
import pytest
import torch

from mpcourse.core.bf16 import kahan_add_, stochastic_round_bf16
from mpcourse.course.grading import GradingError
from mpcourse.course.grading.bf16 import check_kahan_add, check_stochastic_round_bf16


def test_reference_implementations_pass(capsys):
    check_stochastic_round_bf16(stochastic_round_bf16)
    check_kahan_add(kahan_add_)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("PASS stochastic_round_bf16: ") and out[1].startswith("PASS kahan_add_: ")


def test_a_bf16_sr_that_ignores_its_generator_is_rejected():
    """Planted bug: the draws come from torch's global RNG, so a seeded generator does not reproduce them."""
    with pytest.raises(GradingError, match="generator passed in"):
        check_stochastic_round_bf16(lambda x, g: stochastic_round_bf16(x, None))


def sr_no_nan_guard(x, generator):                      # right everywhere except NaN payloads
    r = torch.randint(0, 1 << 16, x.shape, generator=generator, dtype=torch.int32)
    return ((x.view(torch.int32) + r) & -65536).view(torch.float32).to(torch.bfloat16)


def test_nan_payloads_carried_into_inf_or_zero_are_rejected():
    """0x7F800001 -> +inf, 0x7FFFFFFF -> -0, 0xFFFFFFFF -> +0 under the bit-level add: met deterministically."""
    with pytest.raises(GradingError, match=r"NaN with bit pattern 0x7F800001 came back as inf"):
        check_stochastic_round_bf16(sr_no_nan_guard)
    for payload in (0x7FFFFFFF, 0xFFFFFFFF):          # each payload alone is caught too
        def only(x, g, payload=payload):
            out = stochastic_round_bf16(x, g).float()
            bits = x.view(torch.int32)
            hit = bits == (payload - (1 << 32) if payload >= 1 << 31 else payload)
            return torch.where(hit, sr_no_nan_guard(x, g).float(), out).to(torch.bfloat16)
        with pytest.raises(GradingError, match=f"0x{payload:08X} came back as -?0\\.0"):
            check_stochastic_round_bf16(only)


def sr_always_down(x, generator):                       # truncation toward zero: a neighbour, but biased
    return torch.where(x.isnan(), x, (x.view(torch.int32) & -65536).view(torch.float32)).to(torch.bfloat16)


def sr_half(x, generator):                              # the right neighbours, probability 0.5
    down = sr_always_down(x, generator).float()
    up = torch.nextafter(down.bfloat16(), torch.where(x < 0, -torch.inf, torch.inf).bfloat16()).float()
    up = torch.where(down == x, down, up)
    coin = torch.rand(x.shape, generator=generator) < 0.5
    return torch.where(x.isnan(), x, torch.where(coin, up, down)).to(torch.bfloat16)


def sr_nearest(x, generator):
    return x.to(torch.bfloat16)


def sr_two_steps(x, generator):                         # 17 random bits: can jump past a neighbour
    r = torch.randint(0, 1 << 17, x.shape, generator=generator, dtype=torch.int32)
    out = ((x.view(torch.int32) + r) & -65536).view(torch.float32)
    return torch.where(x.isnan(), x, out).to(torch.bfloat16)


@pytest.mark.parametrize("fn", [sr_always_down, sr_half, sr_nearest])
def test_biased_rounding_is_rejected(fn):
    with pytest.raises(GradingError, match=r"FAIL stochastic_round_bf16: biased\. .*1\.00100004"):
        check_stochastic_round_bf16(fn)


def test_rounding_past_a_neighbour_is_rejected():
    with pytest.raises(GradingError, match="one of the two BF16 neighbours"):
        check_stochastic_round_bf16(sr_two_steps)


def test_wrong_dtype_and_stub_are_explained():
    with pytest.raises(GradingError, match="bfloat16"):
        check_stochastic_round_bf16(lambda x, g: x.half())
    def stub(x, g):
        raise NotImplementedError("exercise")
    with pytest.raises(GradingError, match="not implemented yet"):
        check_stochastic_round_bf16(stub)


def kahan_forgets_compensation(w, comp, update):        # plain BF16 addition: comp never used
    w.copy_((w.float() + update).to(torch.bfloat16))


def kahan_never_feeds_back(w, comp, update):            # comp computed but never added to the next update
    new = (w.float() + update).to(torch.bfloat16)
    comp.copy_(update - (new.float() - w.float()))
    w.copy_(new)


def kahan_textbook_sign(w, comp, update):               # Kahan's c = (t - w) - y: w - comp is the sum
    y = update - comp.float()
    new = (w.float() + y).to(torch.bfloat16)
    comp.copy_((new.float() - w.float()) - y)
    w.copy_(new)


def kahan_all_in_comp(w, comp, update):                 # w never moves: w + comp right, w stale
    comp.copy_(comp.float() + update)


@pytest.mark.parametrize("fn", [kahan_forgets_compensation, kahan_never_feeds_back, kahan_textbook_sign])
def test_kahan_without_working_compensation_is_rejected(fn):
    with pytest.raises(GradingError, match=r"ten updates of \+1e-3 .* should leave w = 1\.0078125"):
        check_kahan_add(fn)


def test_kahan_that_never_moves_the_weight_is_rejected():
    with pytest.raises(GradingError, match="w = 1.0078125 .*got w = 1.0"):
        check_kahan_add(kahan_all_in_comp)


def test_kahan_out_of_place_is_rejected():
    def out_of_place(w, comp, update):
        w = (w.float() + update).to(torch.bfloat16)       # rebinding: the caller's w never changes
    with pytest.raises(GradingError, match="got w = 1.0,"):
        check_kahan_add(out_of_place)


def kahan_rounds_y(w, comp, update):                    # y = update + comp rounded to BF16: close, not exact
    y = (update + comp.float()).bfloat16().float()
    new = (w.float() + y).to(torch.bfloat16)
    comp.copy_((y - (new.float() - w.float())).to(torch.bfloat16))
    w.copy_(new)


def kahan_two_roundings(w, comp, update):               # new = bf16(bf16(w + update) + comp): rounded twice
    y = update + comp.float()
    new = ((w.float() + update).bfloat16().float() + comp.float()).to(torch.bfloat16)
    comp.copy_((y - (new.float() - w.float())).to(torch.bfloat16))
    w.copy_(new)


@pytest.mark.parametrize("fn", [kahan_rounds_y, kahan_two_roundings])
def test_kahan_close_but_not_exact_is_rejected(fn):
    """Planted bugs that track the FP64 sum within 1% (the old tolerance) but not the exact recurrence."""
    with pytest.raises(GradingError, match=r"after step \d+ .*exact step by step"):
        check_kahan_add(fn)
