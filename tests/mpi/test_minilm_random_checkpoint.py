"""The tensor-parallel MiniLM encoder with TPSP, on a random MiniLM-shaped checkpoint, vs float64 numpy.

    mpiexec -n 2 python -m mpi4py -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_minilm_random_checkpoint.py -q
    mpiexec -n 3 python -m mpi4py -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_minilm_random_checkpoint.py -q

No downloaded weights: every rank writes the same checkpoint (same seed, so the same
bytes -- checked) into its own temporary folder with :mod:`minilm_checkpoint`: real
MiniLM dimensions (hidden 384, 12 heads, 6 layers, intermediate 1536, 512 positions), a
small WordPiece vocabulary.  A folder per rank, rather than one written by rank 0, needs
no shared file system and no barrier between writing and reading.

The checkpoint goes through vtnumba's normal loading path (``load_minilm_weights``,
``MiniLMEncoder(model_dir=...)``, ``TensorParallelEncoder``), and the outputs are compared
with a float64 numpy forward written here from Hugging Face's BERT math, reading the
safetensors file itself -- so a tensor loaded under the wrong name, a dropped bias, a head
sharded wrongly or a token of one sentence attending to another all show up.

The TPSP test also checks that TPSP really ran: the profile enabled it and every
row-parallel projection of every forward took the fused op (``fused_calls``), none the
regular fallback.  A TPSP that silently declines still produces correct numbers, so the
numbers alone cannot tell.

On the ``cudasim`` target the whole model computes on the simulated device, and the
simulator runs ~7,000 GPU threads per second, so the checkpoint there is shrunk (hidden 48,
12 heads, one layer) and one short batch is run.
"""

import json
import math
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
from mpi4py import MPI  # noqa: E402

from vtnumba.dist import list_segments  # noqa: E402
from vtnumba.models import MiniLMEncoder, load_minilm_weights  # noqa: E402
from vtnumba.models.tp_runtime import DEFAULT_MAX_BATCHED_TOKENS, TensorParallelEncoder  # noqa: E402
from vtnumba.target import current_target  # noqa: E402

from minilm_checkpoint import DEFAULT_WORDS, SPECIAL_TOKENS, vocabulary, write_random_minilm_checkpoint  # noqa: E402
from minilm_weights import needs_the_target  # noqa: E402
from mpi_helpers import collectively, group  # noqa: E402,F401 (group is a fixture)

COMM = MPI.COMM_WORLD
pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(300), *needs_the_target()]

SEED = 1234
SIMULATOR = current_target().name == "cudasim"
if SIMULATOR:
    SHAPE = dict(hidden=48, heads=12, layers=1, intermediate=96)
    WORD_COUNTS = (1, 2)  # 3 + 4 = 7 tokens: one forward, two fused calls
    MAX_BATCHED_TOKENS = 16
else:
    SHAPE = dict(hidden=384, heads=12, layers=6, intermediate=1536)  # all-MiniLM-L6-v2's
    # 3..40 tokens per sentence, 91 in all: not a multiple of 2 or 3, so TPSP's last token-row
    # shard is short (and with batch_size=2 the forwards see T = 63, 21 and 7).
    WORD_COUNTS = (1, 5, 38, 12, 2, 21)
    MAX_BATCHED_TOKENS = DEFAULT_MAX_BATCHED_TOKENS

# float32 against float64, as max |error| / max |reference| (hidden states reach ~4).  Each
# float32 dot product over K <= 1536 terms rounds to ~1e-7..1e-6 of its terms' scale, erf is
# evaluated to ~1e-7, and every post-LayerNorm rescales the hidden state to O(1), so errors do
# not compound through the 6 layers: measured ~5e-7 (tp = 2 and 3).  A GPU sums in another
# order and with FMAs, which moves results by a few float32 ulps more, not orders of
# magnitude -- 1e-5 is also the TPSP op's own tolerance (test_tpsp_fused.py).  Tighter than
# that would flake; much looser would miss real mistakes: on these weights the tanh GELU
# instead of erf moves outputs by 6e-5, LayerNorm eps 1e-5 instead of 1e-12 by 3e-4, a
# dropped bias by 1e-2, one padded key leaking into softmax by 5e-2.
REL_TOL = 1e-5


# -- the checkpoint ---------------------------------------------------------------------------
def _sentences(vocab):
    """Texts made of whole vocabulary words, and the token ids BERT's WordPiece must give them."""
    rng = np.random.default_rng(SEED + 1)
    words = [w for w in DEFAULT_WORDS if w.isalpha()]  # whole words only: one id each
    texts, ids = [], []
    for n in WORD_COUNTS:
        chosen = [str(w) for w in rng.choice(words, size=n)]
        texts.append(" ".join(chosen).capitalize())  # upper case: the normaliser lower-cases
        ids.append([vocab["[CLS]"]] + [vocab[w] for w in chosen] + [vocab["[SEP]"]])
    if not SIMULATOR:
        # Word pieces and punctuation: "cats" -> cat ##s, "playing" -> play ##ing, "zebra" -> [UNK].
        texts.append("The cats are playing, a zebra is not.")
        pieces = ["the", "cat", "##s", "are", "play", "##ing", ",", "a", "[UNK]", "is", "not", "."]
        ids.append([vocab["[CLS]"]] + [vocab[p] for p in pieces] + [vocab["[SEP]"]])
    return texts, [np.asarray(i, dtype=np.int64) for i in ids]


@pytest.fixture(scope="module")
def checkpoint():
    """(folder, texts, expected ids): this rank's copy of the random checkpoint, removed afterwards."""
    tmp = tempfile.TemporaryDirectory(prefix="vtnumba-minilm-random-")
    out = {}

    def write():
        out["folder"] = write_random_minilm_checkpoint(Path(tmp.name) / "model", seed=SEED, **SHAPE)

    try:
        collectively(write)
        yield out["folder"], *_sentences(vocabulary(DEFAULT_WORDS))
    finally:
        tmp.cleanup()


@pytest.fixture(scope="module")
def weights(checkpoint):
    out = {}
    collectively(lambda: out.setdefault("w", load_minilm_weights(checkpoint[0])))
    return out["w"]


# -- the float64 reference --------------------------------------------------------------------
_ERF = np.frompyfunc(math.erf, 1, 1)


def _layer_norm(x, w, b, eps):
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)  # biased variance, as torch's LayerNorm
    return (x - mu) / np.sqrt(var + eps) * w + b


def _gelu(x):
    return 0.5 * x * (1.0 + _ERF(x / math.sqrt(2.0)).astype(np.float64))  # BERT's exact (erf) GELU


class Float64Bert:
    """Hugging Face ``BertModel``'s forward for one unpadded sentence, in float64, from the files."""

    def __init__(self, folder: Path):
        from safetensors.numpy import load_file

        cfg = json.loads((folder / "config.json").read_text())
        self.heads, self.layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        self.eps = cfg["layer_norm_eps"]
        self.t = {k: v.astype(np.float64) for k, v in load_file(str(folder / "model.safetensors")).items()}

    def _linear(self, x, name):
        return x @ self.t[name + ".weight"].T + self.t[name + ".bias"]

    def _ln(self, x, name):
        return _layer_norm(x, self.t[name + ".weight"], self.t[name + ".bias"], self.eps)

    def _attention(self, x, p):
        n, H = x.shape
        d = H // self.heads

        def heads(name):  # [n, H] -> [heads, n, d]
            return self._linear(x, p + name).reshape(n, self.heads, d).transpose(1, 0, 2)

        q, k, v = heads("attention.self.query"), heads("attention.self.key"), heads("attention.self.value")
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(d)  # [heads, n, n]: only this sentence's keys
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        return (probs @ v).transpose(1, 0, 2).reshape(n, H)

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        t, n = self.t, ids.size
        x = (t["embeddings.word_embeddings.weight"][ids] + t["embeddings.position_embeddings.weight"][:n]
             + t["embeddings.token_type_embeddings.weight"][0])
        x = self._ln(x, "embeddings.LayerNorm")
        for i in range(self.layers):
            p = f"encoder.layer.{i}."
            # Post-LayerNorm: LayerNorm(sublayer(x) + x), once after attention, once after the FFN.
            x = self._ln(self._linear(self._attention(x, p), p + "attention.output.dense") + x,
                         p + "attention.output.LayerNorm")
            inter = _gelu(self._linear(x, p + "intermediate.dense"))
            x = self._ln(self._linear(inter, p + "output.dense") + x, p + "output.LayerNorm")
        return x


def _embedding(hidden):
    mean = hidden.mean(axis=0)
    return mean / np.linalg.norm(mean)  # sentence-transformers: mean pooling, then L2 normalisation


@pytest.fixture(scope="module")
def reference(checkpoint):
    folder, _, ids = checkpoint
    out = {}

    def build():
        bert = Float64Bert(folder)
        out["bert"] = bert
        out["hidden"] = [bert(i) for i in ids]

    collectively(build)
    return out


def _rel_error(got, want) -> float:
    """max |got - want| over all sentences, relative to the largest |want| (NaN if any output is NaN)."""
    scale = np.max([np.abs(w).max() for w in want])
    return float(np.max([np.abs(np.asarray(g, np.float64) - w).max() for g, w in zip(got, want, strict=True)]) / scale)


# -- the tests --------------------------------------------------------------------------------
def test_every_rank_wrote_the_same_checkpoint(checkpoint, weights):
    folder = checkpoint[0]
    crcs = {}
    collectively(lambda: crcs.update({p.name: zlib.crc32(p.read_bytes()) for p in sorted(folder.iterdir())}))
    everyone = COMM.allgather(crcs)  # outside collectively(): its own all-gather must not pair with this one

    def body():
        assert all(c == everyone[0] for c in everyone), f"the ranks' checkpoints differ: {everyone}"
        assert set(crcs) == {"config.json", "model.safetensors", "tokenizer.json", "sentence_bert_config.json"}
        cfg = weights.config
        assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers, cfg.intermediate_size) == (
            SHAPE["hidden"], SHAPE["heads"], SHAPE["layers"], SHAPE["intermediate"])
        assert cfg.vocab_size == len(SPECIAL_TOKENS) + len(DEFAULT_WORDS) and cfg.layer_norm_eps == 1e-12
        assert cfg.max_position_embeddings == 512 and cfg.max_seq_length == 256

    collectively(body)


def test_regular_forward_from_the_folder_matches_float64(group, checkpoint, reference):
    """The baseline: ``MiniLMEncoder(model_dir=...)`` with the regular all-reduce forward."""
    folder, texts, ids = checkpoint

    def body():
        enc = MiniLMEncoder(group, model_dir=folder, timeout_s=60)
        assert enc.mode == "regular" and enc.tp == group.size
        out = enc.encode_tokens(texts)
        assert [i.tolist() for i in out.token_ids] == [i.tolist() for i in ids], "tokenizer ids differ"
        err = _rel_error(out.hidden_states, reference["hidden"])
        assert err <= REL_TOL, f"rank {group.rank}: regular forward, relative error {err:.3g} > {REL_TOL}"

    collectively(body)


def test_ranks_given_different_tpsp_options_are_refused_together(group, weights):
    # use_tpsp=False on one rank skipped TPSP's (collective) open, and its next collective met
    # the others' open: "given different texts" from the demo, a timeout from embed.
    def body():
        with pytest.raises(ValueError, match=r"were given different options -- rank 0: use_tpsp=False.*rank 1: "
                                             r"use_tpsp=True") as info:
            TensorParallelEncoder(group, use_tpsp=group.rank != 0, weights=weights, timeout_s=60)
        # ... in the constructor's terms: it named --search, which embed and the demo do not have.
        assert "use_tpsp, search and max_batched_tokens must be the same on every rank" in str(info.value)
        assert "--search" not in str(info.value)

    collectively(body)


def test_tpsp_forward_matches_float64_and_really_runs_fused(group, checkpoint, weights, reference):
    folder, texts, ids = checkpoint
    bert, want = reference["bert"], reference["hidden"]
    cls, sep = ids[0][0], ids[0][-1]
    before = set(list_segments())
    report = {}

    def body():
        # Inside the ``with``, every rank runs the same sequence of collectives: only values are
        # collected there.  The per-rank checks come after ``close`` (itself collective), so a
        # rank that fails one never leaves the others waiting in the next forward.
        forwards, errors = 0, {}
        with TensorParallelEncoder(group, use_tpsp=True, weights=weights, timeout_s=60,
                                   max_batched_tokens=MAX_BATCHED_TOKENS) as tpe:
            enabled, mode = tpe.tpsp_enabled, tpe.encoder.mode
            got = tpe.encoder.encode_tokens(texts)  # one batch: T = all tokens
            forwards += 1
            token_ids = got.token_ids
            errors["one batch"] = _rel_error(got.hidden_states, want)
            if not SIMULATOR:
                # Several batches (sorted longest first), so the forwards see different T.
                got = tpe.encoder.encode_tokens(texts, batch_size=2)
                forwards += -(-len(texts) // 2)
                errors["batches of 2"] = _rel_error(got.hidden_states, want)
                # T = 1 and T = 2: one-row token shards, and ranks that own no rows at all (T < tp).
                for tiny in ([cls], [cls, sep]):
                    tiny = np.asarray(tiny, dtype=np.int64)
                    errors[f"T={tiny.size}"] = _rel_error(tpe.encoder.encode_ids([tiny]), [bert(tiny)])
                    forwards += 1
                emb = tpe.encoder.encode(texts)
                forwards += 1
                errors["embeddings"] = float(np.abs(emb - np.stack([_embedding(h) for h in want])).max())
            fused, regular = tpe.fused_calls(), sum(op.regular_calls for op in (tpe.ops or {}).values())
        report.update(errors=errors, fused=fused, regular=regular)
        # The failure this guards against: TPSP declining on every rank and the regular forward
        # running instead -- right numbers, no TPSP.
        assert enabled and mode == "tpsp", f"TPSP was not enabled (tpsp_enabled={enabled}, mode={mode!r})"
        projections = 2 * weights.config.num_hidden_layers
        assert (fused, regular) == (projections * forwards, 0), (
            f"expected all {projections} row-parallel projections of {forwards} forwards to run fused; "
            f"got {fused} fused and {regular} regular calls")
        assert [i.tolist() for i in token_ids] == [i.tolist() for i in ids], "tokenizer ids differ"
        bad = {k: e for k, e in errors.items() if not e <= REL_TOL}  # "not <=": a NaN fails too
        assert not bad, f"rank {group.rank}: errors above {REL_TOL}: {bad}"
        leftover = set(list_segments()) - before
        assert not leftover, f"/dev/shm segments left behind: {leftover}"

    try:
        collectively(body)
    finally:
        if group.rank == 0 and report:
            print(f"\n[tp={group.size}, target {current_target().name}] {report}")


def test_a_batch_past_max_batched_tokens_runs_the_regular_forward(group, checkpoint, weights, reference):
    # A batch of long documents passed the TPSP workspace's max_batched_tokens: the encoder
    # crashed ("x has T=6599 token rows, more than max_batched_tokens=4096") and every later
    # batch failed on the broken handle.  It takes the regular forward, as documented.  And
    # the encoder's timeout_s bounds the fused op's waits too (they used the process default).
    folder, texts, ids = checkpoint
    want = reference["hidden"]
    small = 2 * max(len(i) for i in ids)  # one text fits, all of them together do not

    def body():
        with TensorParallelEncoder(group, use_tpsp=True, weights=weights, timeout_s=45,
                                   max_batched_tokens=small) as tpe:
            assert tpe.tpsp_enabled and tpe.tpsp_backend.timeout_s == 45
            got = tpe.encoder.encode_tokens(texts)  # one batch of every text: past the workspace
            assert sum(op.regular_calls for op in tpe.ops.values()) > 0
            assert all(_rel_error([g], [w]) <= REL_TOL for g, w in zip(got.hidden_states, want))
            fused = tpe.fused_calls()
            got = tpe.encoder.encode_tokens(texts[:1], batch_size=1)  # within it: fused, the handle unharmed
            assert tpe.fused_calls() > fused and _rel_error(got.hidden_states, want[:1]) <= REL_TOL

    collectively(body)


def test_the_tensor_parallel_encoder_names_a_missing_group(weights):
    with pytest.raises(TypeError, match="group must be a vtnumba ProcessGroup .* got NoneType"):
        TensorParallelEncoder(None, weights=weights)
