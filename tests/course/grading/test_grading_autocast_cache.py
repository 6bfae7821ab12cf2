"""Lesson 05's weight-cast-cache grader (mpcourse.course.grading.autocast_cache): it passes a correct cache
written as a learner would and rejects planted bugs (a cache that never invalidates, one keyed on the tensor's
id only, one that caches what torch never caches, casts without autograd history, no cache at all) with one
line naming the first wrong step."""
import contextlib
import weakref

import pytest
import torch

from mpcourse.course.grading import GradingError
from mpcourse.course.grading.autocast_cache import SCENARIOS, _torch_cast_made, check_cached_cast


def make_cache(*, version=True, dtype_key=True, rule=True, views=False, inference=False, enable_grad=True,
               cache=True):
    """A learner's cached_cast; each keyword plants one bug."""
    def cached_cast(store, t, to_type):
        ok = t.dtype == torch.float32 and t.requires_grad and t.is_leaf
        ok = ok and (views or not t._is_view()) and (inference or not torch.is_inference_mode_enabled())
        if not cache or (rule and not ok):
            return t.to(to_type)
        key = (id(t), to_type) if dtype_key else id(t)
        hit = store.get(key)
        if hit is not None and hit[0]() is t and (not version or hit[1] == t._version):
            return hit[2]
        with torch.enable_grad() if enable_grad else contextlib.nullcontext():    # bug: no_grad casts cached
            cast = t.to(to_type)
        store[key] = (weakref.ref(t), t._version, cast)
        return cast
    return cached_cast


def test_a_correct_cache_passes(capsys):
    check_cached_cast(make_cache())
    assert capsys.readouterr().out.startswith("PASS cached_cast: 12 scenarios, 31 casts")


def test_torch_autocast_serves_a_stale_cast_after_an_in_place_update():
    """The documented difference the course's rule fixes (torch 2.13): torch never recasts within a region."""
    inplace = next(s for s in SCENARIOS if s[0].startswith("an in-place update"))
    assert _torch_cast_made(inplace) == [True, False, False, False]
    assert not inplace[1]                                        # so this scenario is graded on the course's rule


@pytest.mark.parametrize("bug,match", [
    (dict(version=False), r"'an in-place update between uses.*step 3 .*a stale cast.*t\._version"),
    (dict(dtype_key=False, version=False), r"'the same weight to BF16, then FP16.*step 1 cached_cast\(cache, w, "
                                           r"float16\): returned torch\.bfloat16 .*key the cache on the dtype too"),
    (dict(rule=False), r"'a tensor that does not require grad.*step 1 .*reused the cast of step 0.*cache only FP32 "
                       r"leaf tensors that require grad"),
    (dict(views=True), r"'a leaf that is a view.*reused the cast of step 0"),
    (dict(inference=True), r"'under torch\.inference_mode.*step 1 .*inference_mode\(\): reused the cast of step 0"),
    (dict(enable_grad=False), r"'a cast first made under no_grad.*step 1 .*no autograd history"),
    (dict(cache=False), r"'one weight used three times', step 1 .*made a new cast; torch\.autocast and the course's "
                        r"cache reuse the cast of step 0"),
], ids=["never invalidates", "keyed on id only", "caches everything", "caches views", "caches in inference mode",
        "cast without grad", "no cache"])
def test_a_planted_bug_fails_with_one_line(bug, match):
    with pytest.raises(GradingError, match=f"^FAIL cached_cast: scenario {match}") as e:
        check_cached_cast(make_cache(**bug))
    assert "\n" not in str(e.value)


def test_the_stub_and_a_wrong_return_fail_clearly():
    def stub(cache, t, to_type):
        raise NotImplementedError("exercise: replace this line with your code")
    with pytest.raises(GradingError, match="not implemented yet.*YOUR CODE HERE"):
        check_cached_cast(stub)
    with pytest.raises(GradingError, match="returned NoneType; return the cast tensor"):
        check_cached_cast(lambda cache, t, to_type: None)
