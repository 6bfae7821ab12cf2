"""Corpus loading (embedded default, --data errors) and the GPT's shapes, dtypes and parameter count."""
import math

import pytest
import torch

from mpcourse.experiment.gpt.data import CorpusError, load_corpus
from mpcourse.experiment.gpt.model import GPT, GPTConfig


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_default_corpus_is_pydoc_topics_and_split_is_deterministic(corpus):
    from pydoc_data.topics import topics
    assert len(corpus.text) > 400_000
    assert corpus.text.startswith(topics[sorted(topics)[0]][:50])
    again = load_corpus()
    assert torch.equal(again.train, corpus.train) and torch.equal(again.val, corpus.val)
    assert len(corpus.train) + len(corpus.val) == len(corpus.text)
    assert abs(len(corpus.val) / len(corpus.text) - 0.1) < 1e-3
    assert corpus.decode(corpus.encode("def f(x):")) == "def f(x):"


def test_unigram_entropy_matches_direct_count(corpus):
    from collections import Counter
    n = len(corpus.text)
    direct = -sum(c / n * math.log(c / n) for c in Counter(corpus.text).values())
    assert corpus.unigram_entropy() == pytest.approx(direct)
    assert 3.0 < corpus.unigram_entropy() < 3.5          # about 3.25 nats for the default corpus


def test_batches_are_shifted_windows_and_seeded(corpus):
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    x, y = corpus.batch("train", 4, 16, g1)
    x2, _ = corpus.batch("train", 4, 16, g2)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(x, x2)


@pytest.mark.parametrize("content,match", [
    (None, "no such file"), (b"", "empty"), (b"\n\n  \n", "only whitespace"), (b"abc\x00def" * 300, "binary"),
    ("caf\xe9 ".encode("latin-1") * 400, "not valid UTF-8"), (b"short", "at least"),
])
def test_bad_data_files_get_clear_errors(tmp_path, content, match):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(CorpusError, match=match):
        load_corpus(path)


def test_directory_is_refused(tmp_path):
    with pytest.raises(CorpusError, match="not a regular file"):
        load_corpus(tmp_path)


def test_any_utf8_file_works(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("héllo wörld, ünïcode — fine. " * 100, encoding="utf-8")
    c = load_corpus(path)
    assert "—" in c.chars and c.vocab_size == len(set(c.text))


def test_default_model_has_about_a_million_parameters(corpus):
    m = GPT(GPTConfig(vocab_size=corpus.vocab_size))
    assert 0.8e6 < m.num_params() < 1.2e6
    assert m.head.weight is m.tok_emb.weight                  # tied by default
    untied = GPT(GPTConfig(vocab_size=corpus.vocab_size, tie_weights=False))
    assert untied.num_params() == m.num_params() + corpus.vocab_size * 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_shapes_dtypes_and_fp32_loss(dtype):
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16)
    m = GPT(cfg).to(dtype)
    idx = torch.randint(11, (2, 8))
    logits, loss = m(idx, idx)
    assert logits.shape == (2, 8, 11) and logits.dtype == dtype
    assert loss.dtype == torch.float32 and loss.shape == ()
    # At init the logits are near 0, so the loss is near log(vocab): uniform prediction.
    assert abs(float(loss.detach()) - math.log(11)) < 0.2


def test_causal_mask_means_no_peeking_and_no_nan_rows():
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)
    m = GPT(cfg).half()
    a = torch.randint(11, (1, 8))
    b = a.clone()
    b[0, 5:] = (b[0, 5:] + 1) % 11                              # change only the future of position 4
    la, _ = m(a)
    lb, _ = m(b)
    assert torch.equal(la[0, :5], lb[0, :5])
    assert torch.isfinite(la).all()


def test_config_errors():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    m = GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, 5, dtype=torch.long))
