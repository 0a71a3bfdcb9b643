"""Turning texts into all-MiniLM-L6-v2 token ids, the way sentence-transformers does.

The checkpoint's ``tokenizer.json`` (a BERT WordPiece tokenizer, lower-casing) is loaded
with Hugging Face ``tokenizers`` -- a small Rust wheel, no torch.  Each text becomes
``[CLS] word-pieces... [SEP]``.

Two settings in ``tokenizer.json`` are *not* what sentence-transformers uses, so they are
switched off here: it pads every input to a fixed 128 and truncates at 128.  vtnumba
never pads (the model packs real tokens, see :mod:`vtnumba.models.minilm`), and truncation
follows sentence-transformers' ``max_seq_length`` (256 for this model, from
``sentence_bert_config.json``): an over-long text keeps its first ``max_seq_length - 1``
ids and gets ``[SEP]`` back as its last token -- exactly what ``tokenizers``' own
longest-first truncation produces.

**Long inputs (documented choice).**  sentence-transformers truncates silently.  vtnumba
truncates too (so its outputs stay comparable to the reference) but says so with a
:class:`TruncationWarning`; ``on_long="error"`` refuses instead, with a
:class:`ValueError`.  ``max_seq_length`` may be raised up to the model's 512 positions;
beyond that there are no position embeddings, so asking for more is a ``ValueError``.

**Text that is not text.**  A ``str`` holding lone surrogates (bytes that were not UTF-8, as
Python passes them through from a command line) is refused with a ``ValueError`` naming
its index and showing its bytes (:func:`invalid_text`).

**Empty inputs.**  sentence-transformers would embed ``""`` as ``[CLS] [SEP]`` -- a vector
that means nothing.  vtnumba refuses a text with no word pieces (empty, whitespace only,
or only characters the normaliser removes) with a ``ValueError`` naming its index.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping, Sequence, Set

import numpy as np

from vtnumba.backend.arrays import is_int
from vtnumba.models.minilm_files import INSTALL_HINT, find_minilm_dir
from vtnumba.models.minilm_weights import MiniLMConfig

ON_LONG = ("truncate", "error")


class TruncationWarning(UserWarning):
    """A text was longer than ``max_seq_length`` tokens and was truncated."""


def _first_caller_outside_vtnumba() -> int:
    """``warnings.warn``'s stacklevel for its caller that names the first frame outside vtnumba --
    the user's line that called ``encoder.encode(...)``, not vtnumba's own call of the tokenizer
    (what Python 3.12's ``skip_file_prefixes`` does)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # .../vtnumba/
    frame, level = sys._getframe(1), 1  # (level 1: the frame that calls warn)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _check_texts(texts) -> list[str]:
    if isinstance(texts, (str, bytes)):
        raise TypeError(f"texts={texts!r} must be a sequence of str, not a single {type(texts).__name__}; wrap it in a list")
    if isinstance(texts, (Set, Mapping)):
        # A set has no order and a dict's values would be dropped for its keys: either way the
        # embeddings could not be matched back to the texts the caller meant.
        raise TypeError(f"texts must be a sequence of str (a list or tuple), not a {type(texts).__name__}: "
                        "the i-th embedding belongs to the i-th text, so their order must be the caller's")
    try:
        out = list(texts)
    except TypeError:
        raise TypeError(f"texts must be a sequence of str, got {type(texts).__name__}") from None
    if not out:
        raise ValueError("texts is empty; expected at least one text")
    for i, t in enumerate(out):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}]={t!r} is a {type(t).__name__}; expected str")
        bad = invalid_text(t)
        if bad:
            raise ValueError(f"texts[{i}]={t!r} {bad}")
    return out


#: Why a text with no word pieces is refused (after "TEXT ... " in the programs' messages).
NO_PIECES = ("has no word pieces after normalisation (only control characters, zero-width spaces or combining "
             "marks); expected some text")


def first_without_pieces_in(token_counts) -> int | None:
    """The index of the first of :meth:`MiniLMTokenizer.token_counts` that is ``[CLS] [SEP]`` only
    (no word piece), or None -- for a program that also reads the counts for truncation."""
    return next((i for i, n in enumerate(token_counts) if n <= 2), None)


def invalid_text(text: str) -> str | None:
    """Why ``text`` cannot be tokenized, or None when it can.

    A Python ``str`` may hold lone surrogates (``\\udc80``-``\\udcff``): that is how Python keeps
    bytes that were not valid UTF-8 -- a command-line argument in another encoding, say --
    so they can be written back unchanged.  They are not text, and the tokenizer (Rust,
    UTF-8 only) would refuse them with an obscure TypeError.  A blank text is refused too:
    it would embed as nothing but ``[CLS] [SEP]``.
    """
    if not text.strip():
        return "is empty; expected a text with at least one word"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raw = text.encode("utf-8", "surrogateescape") if _only_escaped_bytes(text) else None
        shown = f" (its bytes: {raw!r})" if raw is not None else ""
        return (f"is not valid UTF-8 text: character {exc.start} is a lone surrogate{shown}; pass text "
                "decoded from its real encoding")
    return None


def _only_escaped_bytes(text: str) -> bool:
    try:
        text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


class MiniLMTokenizer:
    """WordPiece ids for texts: ``encode(texts) -> list of int64 arrays`` (no padding).

    ``max_seq_length`` defaults to the model's sentence-transformers setting (256);
    ``on_long`` is ``"truncate"`` (warn and cut, like sentence-transformers) or ``"error"``.
    """

    def __init__(self, model_dir: str | os.PathLike | None = None, max_seq_length: int | None = None, on_long: str = "truncate"):
        folder = find_minilm_dir(model_dir)
        self.config = MiniLMConfig.from_dir(folder)
        if on_long not in ON_LONG:
            raise ValueError(f"on_long={on_long!r} is not supported; expected one of {ON_LONG}")
        limit = self.config.max_position_embeddings
        if max_seq_length is None:
            max_seq_length = self.config.max_seq_length
        if not is_int(max_seq_length):
            raise TypeError(f"max_seq_length={max_seq_length!r} must be an int")
        if not 3 <= int(max_seq_length) <= limit:
            raise ValueError(
                f"max_seq_length={max_seq_length} is out of range; expected 3..{limit} "
                f"(the model has {limit} position embeddings, and [CLS] + [SEP] need 2)"
            )
        self.max_seq_length = int(max_seq_length)
        self.on_long = on_long
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ImportError(f"tokenizing for MiniLM needs the 'tokenizers' package; {INSTALL_HINT}") from exc
        try:
            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # the tokenizers library raises a bare Exception for a bad file
            raise ValueError(f"{folder / 'tokenizer.json'} is not a tokenizer file ({exc}); re-download it") from None
        # tokenizer.json pads and truncates to a fixed 128; we pack real tokens and truncate ourselves.
        tok.no_padding()
        tok.no_truncation()
        self._tok = tok
        self.cls_id = self._special_id("[CLS]")
        self.sep_id = self._special_id("[SEP]")

    def _special_id(self, token: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"tokenizer.json has no {token} token; this is not a BERT tokenizer")
        return int(tid)

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        """How many tokens each text has, ``[CLS]`` and ``[SEP]`` included, before any truncation
        -- for a program's own messages about texts :meth:`encode` would refuse or truncate."""
        return [len(enc.ids) for enc in self._tok.encode_batch(_check_texts(texts))]

    def first_without_pieces(self, texts: Sequence[str]) -> int | None:
        """The index of the first text that has no word piece once normalised -- only control
        characters, zero-width spaces or combining marks, say -- or None.  :meth:`encode`
        refuses such a text; a program can ask this first, to refuse it as bad input."""
        return first_without_pieces_in(self.token_counts(texts))

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids (``int64``, ``[CLS] ... [SEP]``) for each text, truncated per ``on_long``."""
        texts = _check_texts(texts)  # (every text: a str, valid UTF-8, not blank)
        encodings = self._tok.encode_batch(texts)
        out: list[np.ndarray] = []
        long_ones: list[tuple[int, int]] = []
        for i, enc in enumerate(encodings):
            ids = np.asarray(enc.ids, dtype=np.int64)
            if ids.size <= 2:
                raise ValueError(f"texts[{i}]={texts[i]!r} {NO_PIECES}")
            if ids.size > self.max_seq_length:
                if self.on_long == "error":
                    raise ValueError(
                        f"texts[{i}] has {ids.size} tokens, more than max_seq_length={self.max_seq_length}; "
                        "shorten it, raise max_seq_length (at most 512), or use on_long='truncate'"
                    )
                long_ones.append((i, int(ids.size)))
                # Same ids as tokenizers' longest-first truncation: keep [CLS] + the first pieces, end with [SEP].
                ids = np.concatenate([ids[: self.max_seq_length - 1], np.asarray([self.sep_id], dtype=np.int64)])
            out.append(ids)
        if long_ones:
            shown = ", ".join(f"texts[{i}] ({n} tokens)" for i, n in long_ones[:5])
            more = f" and {len(long_ones) - 5} more" if len(long_ones) > 5 else ""
            warnings.warn(
                f"truncated {shown}{more} to max_seq_length={self.max_seq_length} tokens, as sentence-transformers does",
                TruncationWarning,
                stacklevel=_first_caller_outside_vtnumba(),
            )
        return out
