"""``vtnumba embed`` with a TEXT that is not valid UTF-8: a clear error naming it, on every rank, no traceback.

The shell hands a program bytes; Python decodes ``argv`` as UTF-8 and keeps the bytes it
cannot decode as lone surrogates (``$'abc\\xff\\xfe'`` arrives as ``'abc\\udcff\\udcfe'``).  The
tokenizer (Rust, UTF-8 only) cannot take those, so the command must refuse them itself.
Run as a user would: in subprocesses, alone and under ``mpiexec -n 2``.
"""

import os
import subprocess
import sys

import pytest

from vtnumba.models.minilm_tokenizer import invalid_text

BAD = b"abc\xff\xfe"  # not UTF-8


def _embed(*texts, mpiexec=0):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}
    cmd = [sys.executable, "-m", "vtnumba", "embed", "--target", "cpu", *texts]
    if mpiexec:
        cmd = ["mpiexec", "-n", str(mpiexec), *cmd]
    return subprocess.run(cmd, capture_output=True, env=env, timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("ranks", [0, 2])
def test_a_text_that_is_not_utf8_is_refused_by_name(ranks):
    proc = _embed(b"a fine sentence", BAD, mpiexec=ranks)
    err = proc.stderr.decode("utf-8", "replace")
    out = proc.stdout.decode("utf-8", "replace")
    assert proc.returncode == 2, out + err
    assert "Traceback" not in err + out
    assert "TEXT argument 2 ('abc\\udcff\\udcfe') is not valid UTF-8 text" in err
    assert "its bytes: b'abc\\xff\\xfe'" in err
    assert err.count("vtnumba embed: error:") == 1  # said once (rank 0), though every rank stopped


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_text_refused_on_one_rank_only_ends_the_job_naming_it(bad_rank):
    # With mpiexec ... : ... the ranks' texts can differ: the refusal took the "every rank
    # refuses alike" way out, so the others waited out their timeout and nothing named the rank.
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}
    cmd = [b"mpiexec"]
    for rank in range(2):
        cmd += [b":"] if rank else []
        text = BAD if rank == bad_rank else b"a fine sentence"
        cmd += [b"-n", b"1", sys.executable.encode(), b"-m", b"vtnumba", b"embed", b"--target", b"cpu",
                b"--timeout", b"30", text]
    proc = subprocess.run(cmd, capture_output=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    out = proc.stdout.decode("utf-8", "replace") + proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 1, out
    assert f"[rank {bad_rank}] failed while running: ValueError: TEXT argument 1 ('abc\\udcff\\udcfe') is not " \
           "valid UTF-8 text" in out, out
    assert f"[rank {1 - bad_rank}] stopped while running, because rank(s) [{bad_rank}] refused their input" in out, out
    assert "timed out" not in out and "did not leave" not in out, out


def test_the_tokenizer_names_the_text_too():
    assert invalid_text("fine, even non-ASCII: \u00e9\u4e2d") is None
    bad = BAD.decode("utf-8", "surrogateescape")
    assert "character 3 is a lone surrogate" in invalid_text(bad)
    assert "its bytes" not in invalid_text("x\ud800")  # a surrogate that was never a byte


def test_a_blank_text_is_refused_before_the_model_loads():
    # It failed after loading the model, with exit status 1, naming texts[0].
    proc = _embed(b"a fine sentence", b"  ", mpiexec=2)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, err
    assert err.count("vtnumba embed: error: TEXT argument 2 ('  ') is empty; expected a text with at least one word") \
        == 1, err


@pytest.mark.parametrize("ranks", [0, 2])
def test_a_text_without_word_pieces_is_bad_input_said_once(ranks):
    # Zero-width spaces and control characters pass the blank check, and only the tokenizer
    # finds nothing in them: every rank failed with status 1, naming texts[1].
    proc = _embed(b"a fine sentence", "\u200b\x07".encode(), mpiexec=ranks)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert err.count("vtnumba embed: error: TEXT argument 2 ('\\u200b\\x07') has no word pieces") == 1, err


def test_the_tokenizer_finds_the_first_text_without_word_pieces():
    from minilm_weights import minilm_dir

    from vtnumba.models.minilm_tokenizer import NO_PIECES, MiniLMTokenizer

    tok = MiniLMTokenizer(minilm_dir())
    assert tok.first_without_pieces(["fine", "also fine \u00e9"]) is None
    assert tok.first_without_pieces(["fine", "\u200b", "\x07\u0301"]) == 1
    assert tok.first_without_pieces(["\x07\u0301"]) == 0
    with pytest.raises(ValueError, match=r"texts\[1\]='\\x07' " + NO_PIECES[:20]):
        tok.encode(["fine", "\x07"])


def test_a_rank_count_that_does_not_divide_the_heads_is_said_once_before_loading():
    # It was '[rank r] failed while loading the model: ValueError: tp_size=5 ...' from every rank.
    proc = _embed(b"a fine sentence", mpiexec=5)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, err
    assert err.count("vtnumba embed: error: tp_size=5 does not divide the model's 12 attention heads; expected one "
                     "of [1, 2, 3, 4, 6, 12]") == 1, err
    assert "loading all-MiniLM-L6-v2" not in err and "failed" not in err, err


def test_a_missing_model_is_said_once(tmp_path):
    # Every rank on one machine reads the same (missing) files: it was each rank's own four-line
    # failure, labelled 'while running'.
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}
    env["VTNUMBA_MINILM_DIR"] = str(tmp_path / "nowhere")
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "vtnumba", "embed", "--target", "cpu", "hi"],
                          capture_output=True, env=env, timeout=120, stdin=subprocess.DEVNULL, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count(f"vtnumba embed: error: VTNUMBA_MINILM_DIR='{tmp_path / 'nowhere'}' is not a folder") == 1
    assert "Traceback" not in proc.stderr


def test_a_truncated_text_is_one_warning_line_from_rank_0():
    # Every rank tokenizes the same texts: three ranks printed three two-line warnings pointing
    # into vtnumba's source -- and then one, naming texts[1], where the user passed TEXT 2.
    proc = _embed("fine", "word " * 300, mpiexec=3)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0, err
    assert err.count("warning") == 1 and "TruncationWarning" not in err, err
    assert "vtnumba embed: warning: TEXT argument 2 has 302 tokens; only its first 256 are embedded" in err, err
