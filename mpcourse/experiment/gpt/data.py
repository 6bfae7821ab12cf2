"""Character-level text corpus for the course's model: the embedded default and ``--data PATH``.

The default corpus needs no download: the CPython documentation topics that ship with every
Python in ``pydoc_data.topics`` (about 465,000 characters of English prose and code, 103 distinct
characters, unigram entropy about 3.25 nats per character). Its topics are joined in sorted
order, so the text, the vocabulary and the split are the same on every machine with the same Python.

The split is deterministic: the first 90% of the characters train, the last 10% validate (the
nanoGPT convention for character-level Shakespeare).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch


class CorpusError(ValueError):
    """A text file that cannot serve as a corpus (missing, empty, binary or not UTF-8)."""


def default_text() -> str:
    """The embedded default corpus: every ``pydoc_data.topics`` entry, in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def read_text(path: str | Path) -> str:
    """Read a UTF-8 text file for use as a corpus.

    Raises:
        CorpusError: the file is missing, is a directory, is empty, contains NUL bytes (binary),
            is not valid UTF-8, or is too short to hold one training block.
    """
    p = Path(path)
    if not p.exists():
        raise CorpusError(f"--data {path}: no such file. Pass a UTF-8 text file, or omit --data "
                          "to use the embedded default corpus.")
    if not p.is_file():
        raise CorpusError(f"--data {path}: is not a regular file. Pass a UTF-8 text file.")
    raw = p.read_bytes()
    if not raw:
        raise CorpusError(f"--data {path}: the file is empty. Pass a file with some text in it.")
    if not raw.strip():
        raise CorpusError(f"--data {path}: the file holds only whitespace (an empty corpus). "
                          "Pass a file with some text in it.")
    if b"\x00" in raw:
        raise CorpusError(f"--data {path}: contains NUL bytes, so it looks binary, not text. "
                          "Pass a UTF-8 text file.")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"--data {path}: is not valid UTF-8 (byte {e.start}: {e.reason}). "
                          "Convert it, e.g. `iconv -f latin1 -t utf-8`, or pass another file.") from e


@dataclass
class Corpus:
    """A character-level corpus, encoded and split.

    Attributes:
        text: the whole text.
        chars: the vocabulary, sorted; token id ``i`` is ``chars[i]``.
        train: (N_train,) int64 token ids, the first 90% of the text.
        val: (N_val,) int64 token ids, the last 10%.
        name: where the text came from (for reports).
    """

    text: str
    chars: list[str]
    train: torch.Tensor
    val: torch.Tensor
    name: str

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        """(len(s),) int64 token ids; raises KeyError naming a character not in the vocabulary."""
        index = {c: i for i, c in enumerate(self.chars)}
        try:
            return torch.tensor([index[c] for c in s], dtype=torch.long)
        except KeyError as e:
            raise KeyError(f"character {e.args[0]!r} is not in this corpus's vocabulary") from None

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def unigram_entropy(self) -> float:
        """Entropy of the character frequencies, in nats: the loss of the best model that ignores context."""
        counts = Counter(self.text)
        n = len(self.text)
        return -sum(c / n * math.log(c / n) for c in counts.values())

    def batch(self, split: str, batch_size: int, block_size: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """A random batch of ``batch_size`` windows of ``block_size`` tokens.

        Returns:
            x: (B, T) int64 inputs; y: (B, T) int64 targets (x shifted by one).
        """
        data = self.train if split == "train" else self.val
        starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
        x = torch.stack([data[s:s + block_size] for s in starts.tolist()])           # (B, T)
        y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts.tolist()])   # (B, T)
        return x, y


def load_corpus(path: str | Path | None = None, *, val_fraction: float = 0.1,
                min_chars: int = 1000) -> Corpus:
    """Load the embedded default corpus (``path=None``) or a UTF-8 text file, encode and split it.

    Raises:
        CorpusError: see ``read_text``; also when the text has fewer than ``min_chars`` characters.
    """
    if path is None:
        text, name = default_text(), "pydoc_data.topics (embedded default)"
    else:
        text, name = read_text(path), str(Path(path).name)
    if len(text) < min_chars:
        raise CorpusError(f"the corpus has {len(text)} characters; at least {min_chars} are needed "
                          "for a train/validation split. Pass a longer text file.")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)   # (N,) int64
    n_train = int(len(ids) * (1 - val_fraction))
    return Corpus(text=text, chars=chars, train=ids[:n_train], val=ids[n_train:], name=name)
