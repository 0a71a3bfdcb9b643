"""The small sentence corpus shipped with vtnumba for the semantic-search demo.

``vtnumba/data/corpus.txt`` holds ~40 sentences on varied topics (animals, cooking, sport,
space, geography, history, computing, health, money, weather, music, travel, energy), one
per line; lines starting with ``#`` are comments.  It is package data, so it is found the
same way from a source checkout and from an installed wheel.
"""

from __future__ import annotations

from importlib import resources


def load_corpus() -> list[str]:
    """The corpus sentences, in file order (comments and blank lines dropped)."""
    text = resources.files("vtnumba").joinpath("data", "corpus.txt").read_text(encoding="utf-8")
    sentences = [line.strip() for line in text.splitlines()]
    return [s for s in sentences if s and not s.startswith("#")]


def random_sentences(n: int, seed: int = 0, min_words: int = 8, max_words: int = 40, model_dir=None) -> list[str]:
    """``n`` random "sentences" of ``min_words..max_words`` whole words, for throughput benchmarks.

    Words are drawn from the model's WordPiece vocabulary (alphabetic entries of 3+ letters,
    so most are one token each): the benchmark then measures the encoder, not the tokenizer's
    handling of rare words.  Deterministic for a given ``seed``.
    """
    import numpy as np

    from vtnumba.backend.arrays import check_int
    from vtnumba.models.minilm_files import find_minilm_dir

    n = check_int("n", n, min_value=0)  # (2.5 and None failed inside numpy, naming nothing)
    min_words = check_int("min_words", min_words, min_value=1)
    max_words = check_int("max_words", max_words, min_value=min_words)
    seed = check_int("seed", seed, min_value=0)
    vocab_file = find_minilm_dir(model_dir) / "vocab.txt"
    vocab = [w for w in (line.strip() for line in vocab_file.read_text(encoding="utf-8").splitlines())
             if w.isalpha() and w.isascii() and len(w) >= 3]
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(vocab, int(rng.integers(min_words, max_words + 1)))) + "." for _ in range(n)]
