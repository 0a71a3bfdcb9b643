"""The two messages between the encoder-cache scheduler and its workers, once per step.

Upstream: ``ECCPUConnectorMetadata`` and ``ECCPUWorkerMetadata`` in vLLM's CPU connector.

* :class:`ECConnectorMetadata` -- scheduler -> workers: what to copy this step.
  ``saves``: ``mm_hash -> block_ids`` the producer just allocated (copy the encoder output
  into those blocks).  ``loads``: ``mm_hash -> (transfer_id, block_ids)`` ready in the region
  (copy those blocks into the device encoder cache).  The transfer id is minted per
  dispatch, so two loads of the same ``mm_hash`` in different steps are distinct and a late
  report of the first cannot release the second's pin.
* :class:`ECWorkerMetadata` -- workers -> scheduler: which copies have *finished*.
  ``completed_saves`` (mm_hashes, now safe to mark ready) and ``completed_loads`` (transfer
  ids).  Every tensor-parallel rank loads the same blocks and reports the same ids;
  :meth:`~ECWorkerMetadata.aggregate` concatenates, so an id appears once per reporting
  rank and the scheduler counts the participants off the list.  ``load_ranks`` names the
  rank of each reported load (the worker fills it in), so that one rank's report handed
  in twice counts once.

Both are plain picklable dataclasses: in the demos they travel over mpi4py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from vtnumba.backend.arrays import is_int

__all__ = ["ECConnectorMetadata", "ECWorkerMetadata"]


def _check_ids(ids, what: str) -> None:
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise TypeError(f"{what} must be a 1-D integer array, got {ids.dtype} of shape {ids.shape}")
    elif not isinstance(ids, (list, tuple, range)):
        raise TypeError(f"{what}={ids!r} must be a list of block ids")


@dataclass
class ECConnectorMetadata:
    """Block ids may be lists or int arrays; the scheduler sends int64 arrays (compact to pickle)."""

    saves: dict[str, "list[int] | np.ndarray"] = field(default_factory=dict)  #: mm_hash -> block ids to fill
    #: mm_hash -> (transfer id, block ids to read)
    loads: dict[str, "tuple[int, list[int] | np.ndarray]"] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Block ids stay as given (lists, tuples or int arrays): an entry can have thousands
        # of rows, and the worker converts each list to one int64 array anyway.
        for h, ids in self.saves.items():
            if not isinstance(h, str):
                raise TypeError(f"saves key {h!r} must be an mm_hash str")
            _check_ids(ids, f"saves[{h!r}]")
        for h, value in self.loads.items():
            if not isinstance(h, str):
                raise TypeError(f"loads key {h!r} must be an mm_hash str")
            if not (isinstance(value, (tuple, list)) and len(value) == 2):
                raise TypeError(f"loads[{h!r}]={value!r} must be a (transfer_id, block_ids) pair")
            tid, ids = value
            if not is_int(tid):
                raise TypeError(f"loads[{h!r}] transfer_id={tid!r} must be an int")
            _check_ids(ids, f"loads[{h!r}] block_ids")
            self.loads[h] = (int(tid), ids)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


@dataclass
class ECWorkerMetadata:
    """Workers -> scheduler: the copies that have finished (see the module docstring)."""

    completed_saves: list[str] = field(default_factory=list)  #: mm_hashes whose save finished
    completed_loads: list[int] = field(default_factory=list)  #: transfer ids whose load finished (once per rank)
    #: the tensor-parallel rank that reported each of ``completed_loads`` (same length), or
    #: empty when unknown (every report then counts)
    load_ranks: list[int] = field(default_factory=list)

    def aggregate(self, other: "ECWorkerMetadata | None") -> "ECWorkerMetadata":
        """Append ``other``'s reports to this one (in place) and return self."""
        if other is None:
            return self
        if not isinstance(other, ECWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into ECWorkerMetadata")
        if len(self.load_ranks) != len(self.completed_loads) or len(other.load_ranks) != len(other.completed_loads):
            self.load_ranks = []  # a report without ranks: the combined one has none either
        else:
            self.load_ranks.extend(other.load_ranks)
        self.completed_saves.extend(other.completed_saves)
        self.completed_loads.extend(other.completed_loads)
        return self

    @classmethod
    def aggregate_all(cls, metas: Iterable["ECWorkerMetadata | None"]) -> "ECWorkerMetadata | None":
        """Combine the reports of several ranks; None when no rank reported anything."""
        out = cls()
        for m in metas:
            out.aggregate(m)
        return out if (out.completed_saves or out.completed_loads) else None
