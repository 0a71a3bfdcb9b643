"""all-MiniLM-L6-v2 tensor-parallel over real MPI ranks (tp = the world size: 2, 3 or 4).

    mpiexec -n 2 python -m mpi4py -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_minilm_tp.py -q
    mpiexec -n 3 python -m mpi4py -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_minilm_tp.py -q

Every rank checks its own outputs against sentence-transformers' reference, then the ranks
agree on the verdict (an all-reduce of a pass flag) before the next collective, so one
failing rank never leaves the others waiting.
"""

import time

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
MPI = pytest.importorskip("mpi4py.MPI")

from minilm_weights import minilm_dir, minilm_reference, needs_the_target
from vtnumba.backend import CPUBackend
from vtnumba.dist.comm import wait_request
from vtnumba.models import MiniLMEncoder, TPSPReduceNorm, load_minilm_weights

TOL = 1e-5
COMM = MPI.COMM_WORLD
pytestmark = needs_the_target()  # the encoder computes on the run's target


def _allreduce(buf, op):
    """In-place all-reduce over the world with a deadline (a hang becomes an error)."""
    wait_request(COMM.Iallreduce(MPI.IN_PLACE, buf, op=op), None, "the test's all-reduce", 60)
    return buf


def _all_agree(ok: bool) -> bool:
    return bool(_allreduce(np.asarray([1 if ok else 0], dtype=np.int64), MPI.MIN)[0])


@pytest.fixture(scope="module")
def weights():
    # Missing weights fail on every rank alike, or skip on a GPU run (see tests/minilm_weights.py).
    return load_minilm_weights(minilm_dir())


@pytest.fixture(scope="module")
def ref():
    return minilm_reference()


def _errors(enc, ref):
    out = enc.encode_tokens(ref["texts"])
    ids_ok = [i.tolist() for i in out.token_ids] == [i.tolist() for i in ref["ids"]]
    hid = max(float(np.abs(h - w).max()) for h, w in zip(out.hidden_states, ref["hidden"]))
    emb = float(np.abs(enc.encode(ref["texts"]) - ref["emb"]).max())
    return ids_ok, hid, emb, out


@pytest.mark.mpi(min_size=2)
def test_regular_forward_matches_reference(weights, ref):
    enc = MiniLMEncoder(COMM, weights=weights, timeout_s=60)
    assert enc.tp == COMM.Get_size() and enc.mode == "regular"
    ids_ok, hid, emb, out = _errors(enc, ref)
    # Every rank holds the same hidden states (the all-reduce hands all ranks one sum).
    mine = np.concatenate(out.hidden_states)
    spread = _allreduce(mine.copy(), MPI.MAX)
    same = float(np.abs(spread - mine).max()) < 1e-6
    assert _all_agree(ids_ok and hid < TOL and emb < TOL and same), (COMM.Get_rank(), ids_ok, hid, emb, same)


def _mpi_reference_tpsp_op(comm):
    """TPSP's semantics (docs/concepts/tpsp.rst) over plain MPI collectives (a stand-in for the fused op)."""
    tp = comm.Get_size()

    def op(x, W, bias, residual_shard, norm_weight, eps, norm_bias=None):
        R, H = residual_shard.shape
        padded = np.zeros((tp * R, H), np.float32)
        padded[: x.shape[0]] = x @ W.T
        mine = np.empty((R, H), np.float32)
        comm.Reduce_scatter_block(padded, mine, op=MPI.SUM)  # rank r gets the sum of rows r*R..r*R+R-1
        z = mine + bias + residual_shard
        mu = z.mean(axis=1, keepdims=True, dtype=np.float64)
        var = ((z - mu) ** 2).mean(axis=1, keepdims=True)
        normed = np.ascontiguousarray((z - mu) / np.sqrt(var + eps) * norm_weight + norm_bias, dtype=np.float32)
        gathered = np.empty((tp * R, H), np.float32)
        comm.Allgather(normed, gathered)
        return gathered, z

    return op


@pytest.mark.mpi(min_size=2)
def test_tpsp_adapter_matches_reference(weights, ref):
    comm = COMM.Dup()
    try:
        op = _mpi_reference_tpsp_op(comm)
        # The stand-in op is numpy code: the encoder computes on the host on every target.
        enc = MiniLMEncoder(comm, use_tpsp=True, tpsp_op=op, weights=weights, timeout_s=60, backend=CPUBackend())
        assert enc.mode == "tpsp" and isinstance(enc.model.reduce_norm, TPSPReduceNorm)
        ids_ok, hid, emb, _ = _errors(enc, ref)
        assert _all_agree(ids_ok and hid < TOL and emb < TOL), (COMM.Get_rank(), ids_ok, hid, emb)
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_bad_input_on_one_rank_raises_on_every_rank(weights):
    enc = MiniLMEncoder(COMM, weights=weights, timeout_s=60)
    texts = ["" if COMM.Get_rank() == 1 else "hello", "world"]
    if COMM.Get_rank() == 1:
        with pytest.raises(ValueError, match="empty"):
            enc.encode(texts)
    else:
        with pytest.raises(RuntimeError, match="another rank .* rejected its input"):
            enc.encode(texts)
    # Everyone left the agreement step: the group still works.
    assert enc.encode(["still working"]).shape == (1, 384)


@pytest.mark.mpi(min_size=2)
def test_an_encoder_on_a_freed_group_says_so(weights):
    # After destroy_distributed() its group's communicators are gone: MPI's own error was
    # "Invalid communicator ... Null communicator" from inside the input agreement.
    from vtnumba.dist import destroy_distributed, init_distributed

    enc = MiniLMEncoder(init_distributed(), weights=weights, timeout_s=60)
    assert enc.encode(["hello"]).shape == (1, 384)
    destroy_distributed()
    with pytest.raises(RuntimeError, match=r"group 'tp' was freed \(destroy_distributed\(\) ran\)"):
        enc.encode(["hello"])


@pytest.mark.mpi(min_size=2)
def test_different_texts_on_different_ranks_are_refused(weights):
    enc = MiniLMEncoder(COMM, weights=weights, timeout_s=60)
    with pytest.raises(RuntimeError, match="given different texts"):
        enc.encode([f"rank {COMM.Get_rank()} says hello"])


@pytest.mark.mpi(min_size=2)
def test_different_batch_sizes_on_different_ranks_are_refused(weights):
    # Each batch is one forward with collectives: a rank batching differently met the others'
    # forwards with its own -- wrong embeddings on one rank, a timeout on another.
    enc = MiniLMEncoder(COMM, weights=weights, timeout_s=60)
    texts = ["short one", "a somewhat longer sentence here", "x y z"]
    with pytest.raises(ValueError, match="passed different batch_size values"):
        enc.encode(texts, batch_size=1 if COMM.Get_rank() else 3)
    assert enc.encode(texts, batch_size=3).shape == (3, 384)  # and the group still works


@pytest.mark.mpi(min_size=2)
def test_group_size_must_match_and_divide_heads(weights):
    size = COMM.Get_size()
    with pytest.raises(ValueError, match=f"does not match the group's size {size}"):
        MiniLMEncoder(COMM, tp_size=1, weights=weights)
    if 12 % size:  # e.g. mpiexec -n 5: every rank refuses the same way, before any collective
        with pytest.raises(ValueError, match="attention heads"):
            MiniLMEncoder(COMM, weights=weights)


@pytest.mark.mpi(min_size=2)
def test_a_missing_peer_times_out_instead_of_hanging():
    comm, gate = COMM.Dup(), COMM.Dup()
    try:
        buf = np.ones(4, np.float32)
        if comm.Get_rank() == 0:
            req = comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            t0 = time.monotonic()
            try:
                with pytest.raises(RuntimeError, match="timed out after 0.3 s"):
                    wait_request(req, None, "the test all-reduce", 0.3)
                elapsed = time.monotonic() - t0
            finally:  # (even when the check fails: the peers must not be left in the gate)
                gate.Barrier()  # only now may the late peers arrive (a sleep could be outslept by a busy machine)
                req.Wait()
            assert elapsed < 5
        else:
            gate.Barrier()
            # A non-blocking collective only matches non-blocking ones: Iallreduce here too.
            comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM).Wait()
        assert np.all(buf == comm.Get_size())
    finally:
        comm.Free()
        gate.Free()
