"""Peer buffers: memory every rank can read and write
===================================================

What it does: gives every rank a buffer that every *other* rank maps too -- symmetric
memory, the workspace TPSP exchanges its partial sums through.  Each rank writes a
pattern into its own buffer and reads every peer's straight out of memory; then one rank
writes into its neighbour's buffer and raises a flag there to say so.  On the way: how a
shared-memory segment is made without ever having a name in ``/dev/shm`` (so a crash cannot
leave one behind), how a peer opens it anyway, how the ranks *agree* before any of them
moves on, what a flag's epoch is, and what a wait that times out looks like.  The
timeline shows a message going around the ring: a write into a peer's memory, a flag, and
the peer's wait that the flag releases.

**Builds on:** :doc:`05_fused_add_rmsnorm` and :doc:`01_devices_queues_events` (events
order queues within a process; here flags order ranks).  Next:
:doc:`07_reduce_scatter_all_gather`.

Run it::

    mpiexec -n 2 python tutorials/06_peer_buffers.py            # default target (cpu without a GPU)
    mpiexec -n 2 python tutorials/06_peer_buffers.py --target cudasim
    mpiexec -n 2 python tutorials/06_peer_buffers.py --target cuda  # CUDA IPC

Key insight: only *handles* travel between the ranks (the creator's pid and descriptor
number, or a 64-byte CUDA IPC handle on a GPU), exchanged once with MPI.  After that the data moves by
plain loads and stores into mapped memory, and a small flag, written after the data,
tells the reader when to look.
"""

# %%
# Setup
# -----
#
# ``init_distributed`` splits the world into tensor-parallel groups (here one
# group of all ranks, named ``"tp"``) and tells each group whether its ranks share a node
# (``peer_access``: only then can they map each other's memory).
import os
import time

from vtnumba.apps.tutorial import start

lesson = start("06 peer buffers")

import numpy as np  # noqa: E402

from vtnumba import trace  # noqa: E402
from vtnumba.dist import (  # noqa: E402
    PeerBuffers,
    PeerSignals,
    ShmSegment,
    all_ranks_ready,
    barrier,
    destroy_distributed,
    init_distributed,
    list_segments,
)

group = init_distributed()
rank, tp = group.rank, group.size
lesson.say(f"group: {group}")
lesson.check(group.peer_access, "all ranks are on one node, so they can map each other's memory")


def to_host(arr) -> np.ndarray:
    """A numpy copy of a buffer view, whatever the target's array type."""
    return arr.copy() if isinstance(arr, np.ndarray) else arr.copy_to_host()


def write(arr, values: np.ndarray) -> None:
    """Store host values into a buffer view (a memcpy on cpu, a host-to-device copy else).

    On a GPU a copy from pageable host memory may return before its DMA has landed, so
    synchronize before anyone is told the data is there.
    """
    if isinstance(arr, np.ndarray):
        np.copyto(arr, values)
    else:
        from numba import cuda

        arr.copy_to_device(values)
        cuda.synchronize()


# %%
# A shared-memory segment, by hand
# --------------------------------
#
# Rank 0 *creates* it with ``memfd_create``: an
# anonymous file in RAM that has no name in any directory -- it exists only while a process
# holds a descriptor or a mapping of it.  Rank 0 maps it and writes into it.  The handle it
# broadcasts is ``fd:<pid>:<fd>:<name>``: the others *attach* by opening
# ``/proc/<pid>/fd/<fd>``, rank 0's own descriptor (the kernel lets only the same user do
# that).  Once everyone has mapped it, rank 0 closes its descriptor -- the memory lives on as
# long as a process maps it.  At no moment was there a file a crash could leave behind.
# Attaching is a few lines -- note the check that the descriptor really is our segment:
#
# .. vt-source:: vtnumba.dist.shm.ShmSegment.attach
#
# .. vt-source:: vtnumba.dist.shm.ShmSegment._open_descriptor
seg = ShmSegment.create(4096, tag="demo") if rank == 0 else None
handle = lesson.comm.bcast(seg.handle if seg else None, root=0)
if rank == 0:
    seg.array[:5] = np.frombuffer(b"hello", np.uint8)
else:
    seg = ShmSegment.attach(handle, 4096)
name = handle.rsplit(":", 1)[1]
barrier(group)                       # everyone has mapped it ...
if rank == 0:
    seg.unlink()                     # ... so nobody needs to open it again
barrier(group)
text = bytes(seg.array[:5]).decode()
lesson.say(f"segment handle {handle}; in /dev/shm: {name in list_segments()}; rank {rank} reads {text!r} "
           "through its mapping")
lesson.check(name not in list_segments() and text == "hello", "the memory is shared and has no name to leak")
seg.close()
# (``ShmSegment.create(..., named=True)`` makes the textbook /dev/shm file instead, unlinked as
# soon as every rank mapped it -- PeerBuffers falls back to it where /proc/<pid>/fd cannot be
# opened; only a kill inside those few milliseconds could leave that file behind.)

# %%
# Peer buffers for every rank
# ---------------------------
#
# ``PeerBuffers`` does all of that for every rank, collectively: each rank creates its
# segment (or, on a GPU, allocates device memory and exports a CUDA IPC handle), the
# handles are allgathered as raw bytes, every rank opens every peer's, and the ranks
# *agree* after each step -- if any rank fails, every rank raises the same error instead
# of leaving the others waiting.  When the constructor returns, nobody can open them again.
N = 1024                                # int32 values per rank
pb = PeerBuffers(2 * N * 4, group)      # two regions: the pattern (1) and a mailbox (3)
lesson.say(f"{pb}; local array type: {type(pb.local).__name__}")
lesson.say(f"vtnumba files in /dev/shm: {list_segments()} (the segments have no names)")

# Each rank writes a pattern that says who wrote it into its own buffer ...
patterns = pb.views(np.int32, (N,), offset=0)   # one view per rank: patterns[j] is rank j's memory
write(patterns[rank], rank * 1_000_000 + np.arange(N, dtype=np.int32))
barrier(group)                                  # ... everyone has written (a barrier: all or nothing)
# ... and reads every peer's bytes straight out of memory, no message involved.
seen = [to_host(patterns[j]) for j in range(tp)]
lesson.say("rank 0 reads: " + "; ".join(f"rank {j}'s buffer starts {seen[j][:3].tolist()}" for j in range(tp)))
lesson.check(all(np.array_equal(seen[j], j * 1_000_000 + np.arange(N)) for j in range(tp)),
             "every rank read every peer's pattern")
lesson.check(pb.peer(rank) is pb.local, "peer(my rank) is my local buffer")
barrier(group)  # nobody may overwrite a buffer another rank is still reading

# %%
# Writing into a peer's buffer, ordered by a flag
# -----------------------------------------------
#
# A barrier orders everyone with everyone; a flag orders one writer with one reader.
# ``PeerSignals`` keeps small flag areas in shared host memory; ``set(name, target,
# value)`` is a *release* store (the data written before it is visible first), ``wait``
# polls with *acquire* loads:
#
# .. vt-source:: vtnumba.dist.signals.PeerSignals.set
#
# .. vt-source:: vtnumba.dist.signals.PeerSignals.wait
#
# Flags are epoch counters (1, 2, 3 ...) that only grow: step e waits for ``>= e``, so
# nothing is ever reset and a late waiter still sees it.  Each rank sends a message to the
# next rank around a ring, straight into that rank's mailbox.  Each step is wrapped in a
# ``trace.span`` (see :doc:`../tracing`); ``flow_out`` / ``flow_in`` name the flag, so the
# timeline draws an arrow from the flag's store to the wait it released -- across ranks.
# The first round (epoch 1) also compiles the flags' load and store functions (numba);
# the second is the one we draw, with rank 0 starting 20 ms late on purpose.
sig = PeerSignals(group, names=("mail",), timeout_s=lesson.args.timeout)  # the lesson's --timeout (60 s)
nxt, prv = (rank + 1) % tp, (rank - 1) % tp
mailbox = pb.views(np.int32, (N,), offset=N * 4)   # mailbox[j] is rank j's mailbox


def send_around_ring(e: int, late_s: float = 0.0) -> np.ndarray:
    if rank == 0:
        time.sleep(late_s)
    with trace.span(f"write rank {nxt}'s mailbox", "peer", "ring"):
        write(mailbox[nxt], np.full(N, 100 * e + rank, np.int32))  # 1. the data, into the peer's memory
    with trace.span(f"set flag on rank {nxt}", "peer", "ring", flow_out=f"mail:{nxt}:{e}"):
        sig.set("mail", nxt, e)                                      # 2. then the flag, in the peer's flag area
    with trace.span(f"wait for rank {prv}'s flag", "peer", "ring", flow_in=f"mail:{rank}:{e}"):
        sig.wait("mail", e, source=prv)                              # 3. wait for my neighbour's flag ...
    with trace.span("read my mailbox", "peer", "ring"):
        return to_host(mailbox[rank])                                # 4. ... then read my own mailbox


send_around_ring(sig.next_epoch())  # epoch 1: the warm-up round
e = sig.next_epoch()
with lesson.timeline("ring.png", "One message around the ring (epoch 2).  Each rank writes into the next rank's "
                     "mailbox, then raises the flag there; an arrow goes from that flag store to the wait it "
                     "released on the receiving rank.  Rank 0 started 20 ms late, so rank 1 waited for it.",
                     title="06: a write into a peer's memory, ordered by a flag"):
    got = send_around_ring(e, late_s=0.02)
lesson.say(f"epoch {e}: rank {rank} found {got[0]} x {N} from rank {prv} in its mailbox")
lesson.check(np.all(got == 100 * e + prv), "each rank got its neighbour's message, ordered by the flag alone")

# %%
# Agreement
# ---------
#
# Before a fast path, every rank asks "can you?"; ``all_ranks_ready`` is the all-reduce
# MIN that vLLM's ``TPSPBackend`` uses: True on every rank only if it was True on every rank.  (One rank
# going ahead while another falls back would leave both waiting in different collectives.)
everyone = all_ranks_ready(True, group)
one_says_no = all_ranks_ready(rank != tp - 1, group)  # the last rank cannot
lesson.say(f"all_ranks_ready: all say yes -> {everyone}; rank {tp - 1} says no -> {one_says_no} on every rank")
lesson.check(everyone and not one_says_no, "the ranks agree")

# %%
# A wait that cannot succeed
# --------------------------
#
# Nobody will ever raise ``mail`` to 99, so the wait
# gives up after its timeout with an error naming the rank, the flag, the value it wanted
# and the value it saw -- every wait in vtnumba has one, so a lost peer is an error, not
# a hang.  (A rank that fails inside a protocol can also ``abort()``, which makes its
# peers' waits fail at once instead of at the timeout.)
try:
    sig.wait("mail", 99, source=prv, timeout_s=0.2)
    timeout_msg = ""
except RuntimeError as exc:
    timeout_msg = str(exc)
lesson.say(f"wait(mail >= 99, timeout 0.2 s) -> RuntimeError: {timeout_msg}")
lesson.check("timed out after 0.2 s" in timeout_msg, "a wait with a timeout raises instead of hanging")

# %%
# What changes on a GPU
# ---------------------
#
# On ``cuda`` the buffer is device memory from ``cuMemAlloc``, in whole 2 MiB blocks (the
# driver may pack smaller allocations into one block, and IPC would share all of it);
# the handle that travels is a 64-byte ``cudaIpcMemHandle_t``, copied out as raw bytes
# (plus the offset and size inside the allocation), and each peer opens it with
# ``cuIpcOpenMemHandle`` -- a kernel on rank 0 then loads and stores rank 1's memory over
# NVLink or PCIe.  Raw bytes, not pickles: numba-cuda 0.30's pickled IPC handle is broken
# with cuda-bindings 13.5 (see :mod:`vtnumba.dist.cuda_ipc`).  Teardown then needs two
# barriers: everyone closes the peers' handles, *then* everyone frees their own memory.
lesson.say(f"transport on this target: {pb.kind!r} (shm: numpy views of the mapping; shm-sim: the same memory "
           "as simulator device arrays; cuda_ipc: device arrays on opened IPC handles)")
if lesson.target == "cuda":
    from vtnumba import default_backend
    from vtnumba.dist.cuda_ipc import IPC_HANDLE_BYTES, CudaIpcExport

    exp = CudaIpcExport(default_backend(), 1 << 20)
    msg = exp.handle_bytes
    lesson.say(f"a CUDA IPC handle message: {len(msg)} bytes = magic {msg[:4]!r} + {IPC_HANDLE_BYTES}-byte handle "
               f"({msg[4:12].hex()}...) + offset + size")
    lesson.check(len(msg) == 4 + IPC_HANDLE_BYTES + 16, "the handle travels as fixed-size raw bytes")
    exp.free()
else:
    lesson.say(f"here the handle is a short string, {len(handle)} bytes like {handle[:24]!r}...: the creator's "
               "pid and descriptor number (a peer opens /proc/<pid>/fd/<fd>) and the segment's tag")

# %%
# Teardown
# --------
#
# Teardown is collective too: ``close()`` synchronizes, waits until nobody uses any
# buffer, unmaps the peers', waits until nobody maps its own, then frees it -- the last
# unmap returns the pages to the kernel.
sig.close()
pb.close()
destroy_distributed()
lesson.check(not [n for n in list_segments() if f"-{os.getpid()}-" in n], "no /dev/shm file of this process")
lesson.say("done")

# %%
# Expected output
# ---------------
#
# * ``in /dev/shm: False`` and ``'hello'`` read through the mapping: shared memory with no
#   name to leak.
# * Each rank reads every peer's pattern, ``rank * 1000000 + 0, 1, 2``.
# * The ring timeline: rank 1 writes rank 0's mailbox and sets the flag first, then waits
#   (red) until rank 0, 20 ms late, has written and raised rank 1's flag -- the arrow from
#   rank 0's "set flag" to the end of rank 1's wait.  Rank 0 finds its flag already raised
#   and hardly waits.
# * A wait with a 0.2 s timeout that says who waited for what, and what it saw.
#
# Common issues
# -------------
#
# * ``PeerAccessError: group ... spans more than one node`` -- ranks on different
#   machines cannot map each other's memory; use the MPI collectives
#   (``mpi_reduce_scatter`` / ``mpi_all_gather``) or ``PeerBuffers.try_create``, which
#   returns None on every rank so all of them fall back together.
# * Reading a peer's buffer without a barrier or a flag reads whatever is there *now*:
#   stale data, not an error.  Every read needs an "it is ready" from the writer.
# * The peer buffers are anonymous memory (``memfd``): a small ``/dev/shm`` (Docker's default
#   is 64 MiB) does not limit them.  Segments made *by name* live there, and are reserved
#   when they are made (``posix_fallocate``): too little room is an ``OSError`` naming the
#   size ("could not allocate ... of shared memory"), at once -- not a ``SIGBUS`` at the
#   first write, which is what ``ftruncate`` alone would give.
# * In the simulator, numpy arguments to a kernel are copied in and back, which hides a
#   peer's writes and clobbers them afterwards; PeerBuffers hands out zero-copy simulator
#   arrays instead -- pass those, not ``np.asarray`` of them.
#
# Try next
# --------
#
# 1. Swap steps 1 and 2 (raise the flag, then write the data) and make the writer sleep
#    5 ms between them: the reader now finds stale bytes in its mailbox, although every
#    flag arrived.
# 2. Run with ``mpiexec -n 3``: every rank still hears from its left neighbour only; add a
#    second flag name and send each message around the ring twice.
