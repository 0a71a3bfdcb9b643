"""PeerBuffers, shared-memory segments, signals and atomics on a one-rank group (plain pytest).

Multi-rank behaviour is in tests/mpi/test_dist_peer_mpi.py; here the paths one rank can
reach: layouts, views, lifetimes, failure hooks, /dev/shm hygiene, timeouts.
"""

import os

import numpy as np
import pytest

from vtnumba import dist
from vtnumba.backend import atomics as _atomics
from vtnumba.backend.cpu import CPUBackend
from vtnumba.dist import shm
from vtnumba.dist.peer_buffers import PeerAccessError


@pytest.fixture(params=["cpu", "device"])
def backend(request):
    if request.param == "device":  # the simulator, or the GPU under VTNUMBA_TARGET=cuda
        yield request.getfixturevalue("device_backend")
        return
    b = CPUBackend()
    yield b
    b.close()


def _mine():
    # Only this process's segments (names carry the creator's pid): other jobs on the machine
    # may create and remove vtnumba segments at the same time.
    return [s for s in shm.list_segments() if f"-{os.getpid()}-" in s]


@pytest.fixture
def shm_clean():
    before = _mine()
    yield
    assert _mine() == before, "a /dev/shm segment was left behind"


# ---------------------------------------------------------------------------- shm segments
def test_anonymous_segment_has_no_name_anywhere(shm_clean, rng):
    seg = shm.ShmSegment.create(4096, tag="t")
    assert seg.path is None and seg.handle.startswith(f"fd:{os.getpid()}:")
    assert seg.name.startswith(shm.NAME_PREFIX) and len(seg.name.rsplit("-", 1)[1]) == 32  # 128-bit token
    assert seg.name not in shm.list_segments()  # nothing in /dev/shm, so nothing a kill could leak
    other = shm.ShmSegment.attach(seg.handle, 4096)  # through /proc/<pid>/fd/<fd>
    pattern = rng.integers(0, 256, 4096, dtype=np.uint8)
    seg.array[:] = pattern
    np.testing.assert_array_equal(other.array, pattern)  # same physical pages
    seg.unlink()  # the creator's descriptor closes: nobody new can open it ...
    with pytest.raises(FileNotFoundError, match=rf"shm handle '{seg.handle}': the segment is gone"):
        shm.ShmSegment.attach(seg.handle, 4096)
    with pytest.raises(FileNotFoundError, match="shm handle 'name:vtnumba-gone': the segment is gone"):
        shm.ShmSegment.attach("name:vtnumba-gone", 4096)
    other.array[7] = 99  # ... while the mappings live on
    assert seg.array[7] == 99
    other.close()
    seg.close()
    with pytest.raises(RuntimeError, match="was closed"):
        _ = seg.array


def test_a_named_segment_with_no_room_is_an_oserror_and_leaves_no_file(shm_clean, monkeypatch):
    # A full /dev/shm: without the reservation the segment mapped fine and a peer's first
    # write to a page with no room was a SIGBUS.  (Made to fail as a full tmpfs makes it.)
    import errno

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    before = set(shm.list_segments())
    with pytest.raises(OSError, match=r"could not allocate 33554432 bytes \(32 MiB\) of shared memory .*No space"):
        shm.ShmSegment.create(32 << 20, tag="t", named=True)
    assert set(shm.list_segments()) == before


def test_named_segment_lifecycle_and_mode(shm_clean, rng):
    seg = shm.ShmSegment.create(4096, tag="t", named=True)
    st = os.stat(seg.path)
    assert st.st_mode & 0o777 == 0o600 and st.st_size == 4096
    assert seg.handle == f"name:{seg.name}" and seg.name in shm.list_segments()
    other = shm.ShmSegment.attach(seg.handle, 4096)
    seg.array[:] = rng.integers(0, 256, 4096, dtype=np.uint8)
    np.testing.assert_array_equal(other.array, seg.array)
    seg.unlink()
    assert not os.path.exists(seg.path)
    other.array[7] = 99  # mapping outlives the name
    assert seg.array[7] == 99
    other.close()
    seg.close()


def test_a_descriptor_that_is_not_the_segment_is_refused(tmp_path):
    seg = shm.ShmSegment.create(64)
    try:
        pid, fd = seg.handle.split(":")[1:3]
        other_name = f"{shm.NAME_PREFIX}other-{pid}-{'0' * 32}"
        with pytest.raises(ValueError, match="not the shared-memory segment"):
            shm.ShmSegment.attach(f"fd:{pid}:{fd}:{other_name}", 64)
        with pytest.raises(ValueError, match="is malformed"):
            shm.ShmSegment.attach("fd:1:x", 64)
        with pytest.raises(ValueError, match="not a vtnumba segment handle"):
            shm.ShmSegment.attach("/etc/passwd", 64)
    finally:
        seg.close()


def test_a_symlink_or_a_foreign_file_at_a_segment_name_is_refused(shm_clean, tmp_path):
    import errno

    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 64)
    os.chmod(secret, 0o600)  # a file the mode check would accept: only O_NOFOLLOW refuses it
    name = f"{shm.NAME_PREFIX}planted-{os.getpid()}-{'a' * 32}"
    link = os.path.join(shm.SHM_DIR, name)
    os.symlink(secret, link)
    try:
        with pytest.raises(OSError) as refused:  # O_NOFOLLOW: a planted symlink is never followed
            shm.ShmSegment.attach(f"name:{name}", 64)
        assert refused.value.errno == errno.ELOOP, refused.value
    finally:
        os.unlink(link)
    fd = os.open(link, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    os.ftruncate(fd, 64)
    os.close(fd)
    try:
        with pytest.raises(PermissionError, match="is not a vtnumba segment of this user: it has mode 0o644, expected 0o600"):
            shm.ShmSegment.attach(f"name:{name}", 64)
    finally:
        os.unlink(link)


def test_segment_close_with_live_view_and_checks(shm_clean):
    seg = shm.ShmSegment.create(64, named=True)
    view = seg.array[:8]
    seg.close()  # a numpy view is still alive: close must not fail, the name is gone
    view[:] = 1
    assert not os.path.exists(seg.path)
    with pytest.raises(ValueError, match="must be a positive int"):
        shm.ShmSegment.create(0)
    with pytest.raises(ValueError, match="is not a vtnumba segment name"):
        shm.ShmSegment.attach("name:../etc/passwd", 10)
    with pytest.raises(ValueError, match="is not a vtnumba segment name"):
        shm.ShmSegment.attach("name:vtnumba-x/../../y", 10)
    a = shm.ShmSegment.create(64)
    try:
        with pytest.raises(ValueError, match="has 64 bytes, expected 128"):
            shm.ShmSegment.attach(a.handle, 128)
    finally:
        a.close()


@pytest.mark.parametrize("named", [False, True])
def test_a_segment_dropped_without_close_gives_back_its_descriptor_and_name(shm_clean, named):
    # A dropped anonymous creator kept its descriptor (its memory with it), a named one its
    # /dev/shm file, until the process ended.
    import gc

    def descriptors():
        return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")}

    before = descriptors()
    seg = shm.ShmSegment.create(4096, tag="drop", named=named)
    peer = shm.ShmSegment.attach(seg.handle, 4096)
    name = seg.name
    assert any(name in d for d in descriptors() - before) or (named and _mine())
    del peer  # an opener holds nothing to give back: no warning
    gc.collect()
    with pytest.warns(ResourceWarning, match=f"shm segment {name} was garbage-collected without close"):
        del seg
        gc.collect()
    assert not any(name in d for d in descriptors())  # (and shm_clean checks the name is gone)
    with shm.ShmSegment.create(64, named=named) as seg:  # the way not to drop one
        seg.array[:] = 1
    assert seg.linked is False and not _mine()


def test_a_segment_too_large_to_map_says_how_much_was_asked_for():
    with pytest.raises(OSError, match=r"could not allocate 1125899906842624 bytes \(1.05e\+06 GiB\)"):
        shm.ShmSegment.create(1 << 50)


def test_atexit_hook_unlinks_names_still_linked(shm_clean):
    seg = shm.ShmSegment.create(64, named=True)
    assert os.path.exists(seg.path)
    from vtnumba.memory import shared_files

    shared_files._unlink_leftovers()  # what runs at interpreter exit
    assert not os.path.exists(seg.path)
    seg.close()


# ---------------------------------------------------------------------------- PeerBuffers
def test_peer_buffers_single_rank(group, backend, shm_clean, rng):
    # The transport follows the backend: shared memory for cpu and the simulator (whose
    # "device" memory is host memory), CUDA IPC handles on a GPU.
    caps = backend.capabilities
    kind = "shm" if isinstance(backend, CPUBackend) else ("shm-sim" if caps.simulator else "cuda_ipc")
    with dist.PeerBuffers(1000, group, backend) as pb:
        assert pb.nbytes == 1000 and pb.group is group and not pb.closed
        assert pb.kind == kind
        assert not [s for s in shm.list_segments() if f"-{os.getpid()}-" in s], \
            "the segment name must be unlinked as soon as every rank mapped it"
        assert pb.peer(0) is pb.local
        if caps.kernel_arrays == "device":
            from vtnumba.backend.arrays import is_device_array

            assert is_device_array(pb.local)  # what the device's kernels take, not plain numpy
        pattern = rng.standard_normal(250).astype(np.float32)
        q = backend.create_queue("fill")
        backend.copy(q, pb.local, pattern, pattern.nbytes)  # write through the buffer itself
        backend.synchronize(q)
        backend.destroy_queue(q)
        (v,) = pb.views(np.float32, (25, 10))
        np.testing.assert_array_equal(backend.to_host(v), pattern.reshape(25, 10))
        (w,) = pb.views(np.float64, 3, offset=8)
        assert w.shape == (3,)
        with pytest.raises(ValueError, match=r"need 1008 bytes but the peer buffers have nbytes=1000"):
            pb.views(np.float64, 126)
        with pytest.raises(ValueError, match="offset=2 is not a multiple of float32's itemsize 4"):
            pb.views(np.float32, 1, offset=2)
        with pytest.raises(ValueError, match=r"rank=1 must be a group rank in 0..0"):
            pb.peer(1)
        q = pb.queue
        assert pb.queue is q
        assert pb.is_local_view(pb.local) and pb.is_local_view(v[1:], 40) and not pb.is_local_view(v[1:], 0)
        assert not pb.is_local_view(np.zeros(3)) and not pb.is_local_view("not an array")
    assert pb.closed
    pb.close()  # idempotent
    with pytest.raises(RuntimeError, match="is closed"):
        _ = pb.local
    with pytest.raises(RuntimeError, match="is closed"):
        pb.views(np.uint8, 1)


def test_default_backend_is_the_targets(group, shm_clean):
    import vtnumba

    with dist.PeerBuffers(64, group) as pb:
        assert pb.backend is vtnumba.default_backend()


@pytest.mark.parametrize("bad,exc,match", [
    (0, ValueError, r"nbytes=0 is not a valid size; expected > 0"),
    (-5, ValueError, r"nbytes=-5 is not a valid size"),
    (1.5, TypeError, r"nbytes=1.5 must be an int number of bytes"),
])
def test_peer_buffers_bad_sizes(group, bad, exc, match, shm_clean):
    with pytest.raises(exc, match=match):
        dist.PeerBuffers(bad, group, CPUBackend())


def test_peer_buffers_bad_arguments(group):
    with pytest.raises(TypeError, match="group must be a vtnumba ProcessGroup"):
        dist.PeerBuffers(64, "tp")
    with pytest.raises(TypeError, match="backend must be a vtnumba Backend"):
        dist.PeerBuffers(64, group, backend="cpu")
    with pytest.raises(ValueError, match="_fail_stage='later' must be 'export' or 'open'"):
        dist.PeerBuffers(64, group, CPUBackend(), _fail_on_rank=0, _fail_stage="later")


@pytest.mark.parametrize("stage", ["export", "open"])
def test_forced_failure_is_agreed_and_leaves_nothing(group, stage, shm_clean):
    with pytest.raises(PeerAccessError, match=rf"PeerBuffers {stage}: failed on 1 of 1 ranks .* rank 0: forced"):
        dist.PeerBuffers(64, group, CPUBackend(), _fail_on_rank=0, _fail_stage=stage)
    assert dist.PeerBuffers.try_create(64, group, CPUBackend(), _fail_on_rank=0, _fail_stage=stage) is None
    # a rank that is not the failing one: nothing fails
    pb = dist.PeerBuffers.try_create(64, group, CPUBackend(), _fail_on_rank=3, _fail_stage=stage)
    assert pb is not None
    pb.close()


@pytest.mark.parametrize("var", ["VTNUMBA_FAIL_PEER_OPEN", "VTNUMBA_FAIL_PEER_EXPORT"])
def test_forced_failure_from_the_environment(group, var, monkeypatch, shm_clean):
    monkeypatch.setenv(var, "0")
    why = []
    assert dist.PeerBuffers.try_create(64, group, CPUBackend(), why=why) is None
    assert len(why) == 1 and "rank 0: forced" in why[0], why  # (the reason, for the caller's message)
    monkeypatch.setenv(var, "zero")
    with pytest.raises(ValueError, match=f"{var}='zero' must be a group rank"):
        dist.PeerBuffers(64, group, CPUBackend())


def test_group_without_peer_access_is_refused(group, shm_clean):
    group.peer_access = False  # what a group spanning two nodes reports (see the MPI tests)
    with pytest.raises(PeerAccessError, match=r"spans more than one node.*mpi_reduce_scatter"):
        dist.PeerBuffers(64, group, CPUBackend())
    assert dist.PeerBuffers.try_create(64, group, CPUBackend()) is None


def test_close_after_destroy_distributed_releases_locally(shm_clean):
    dist.destroy_distributed()
    g = dist.init_distributed()
    pb = dist.PeerBuffers(64, g, CPUBackend())
    dist.destroy_distributed()
    pb.close()  # no communicator left for barriers: local release only, no error, nothing leaked
    assert pb.closed


def test_a_failing_unmap_still_unmaps_the_rest_reaches_the_barriers_and_raises(group, shm_clean, monkeypatch):
    """close() unmaps every peer even when one unmap fails, still meets the other ranks at both
    barriers (so none waits for it until a timeout), frees its own memory, and then raises."""
    pb = dist.PeerBuffers(64, group, CPUBackend())
    closed, barriers = [], []

    class Mapping:
        def __init__(self, name, fails):
            self.name, self.fails = name, fails

        def close(self):
            closed.append(self.name)
            if self.fails:
                raise RuntimeError(f"unmap of {self.name} failed")

    pb._imports = [Mapping("a", True), Mapping("b", False), Mapping("c", True)]
    real_barrier = dist.peer_buffers.barrier
    monkeypatch.setattr(dist.peer_buffers, "barrier", lambda g, t: (barriers.append(t), real_barrier(g, t)))
    with pytest.raises(RuntimeError, match="unmap of a failed"):  # the first error
        pb.close()
    assert closed == ["a", "b", "c"] and len(barriers) == 2
    assert pb.closed and pb._export is None and pb._imports == []
    pb.close()  # idempotent


def test_an_unmap_failing_after_a_failed_open_still_frees_and_is_told(group, shm_clean, monkeypatch):
    """An open that fails is undone -- unmap, barrier, free -- even when the unmap fails too;
    the open's error is raised, with a note about the unmap."""
    class Mapping:
        def close(self):
            raise RuntimeError("unmap failed")

    def open_one_then_fail(self, handles, nbytes):
        self._imports.append(Mapping())
        raise PeerAccessError("cannot open the next peer")

    released = []
    real_release = dist.PeerBuffers._release_local
    monkeypatch.setattr(dist.PeerBuffers, "_open_peers", open_one_then_fail)
    monkeypatch.setattr(dist.PeerBuffers, "_release_local", lambda self: (released.append(1), real_release(self)))
    with pytest.raises(PeerAccessError, match="cannot open the next peer") as info:
        dist.PeerBuffers(64, group, CPUBackend())
    chain, exc = [], info.value  # (the note is on the agreed error, the cause of the one raised)
    while exc is not None:
        chain += getattr(exc, "__notes__", [])
        exc = exc.__cause__
    assert any("unmapping the peers' memory afterwards failed too: RuntimeError('unmap failed')" in n for n in chain)
    assert released, "the rank's own memory must be freed"


def test_exception_inside_the_with_block_still_cleans_up(group, shm_clean):
    with pytest.raises(ZeroDivisionError):
        with dist.PeerBuffers(64, group, CPUBackend()) as pb:
            raise ZeroDivisionError("mid-block")
    assert pb.closed


# ---------------------------------------------------------------------------- atomics
@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.int32, np.uint32])
def test_acquire_release_roundtrip(dtype):
    a = np.zeros(4, dtype)
    _atomics.store_release(a, 2, 41)
    assert _atomics.load_acquire(a, 2) == 41 and a[2] == 41 and a[[0, 1, 3]].tolist() == [0, 0, 0]
    _atomics.fence()
    with pytest.raises(IndexError, match="flag index 4 is out of range"):
        _atomics.store_release(a, 4, 1)
    size = np.dtype(dtype).itemsize
    with pytest.raises(ValueError, match=f"{size}-byte aligned"):
        _atomics.load_acquire(np.zeros(40, np.uint8)[1:1 + 4 * size].view(dtype), 0)


def test_atomics_refuse_non_word_arrays():
    with pytest.raises(TypeError, match="int32/uint32/int64/uint64"):
        _atomics.load_acquire(np.zeros(4, np.float32), 0)
    with pytest.raises(TypeError, match="1-D"):
        _atomics.store_release(np.zeros((2, 2), np.int64), 0, 1)


# ---------------------------------------------------------------------------- signals
def test_signals_single_rank(group, shm_clean):
    be = CPUBackend()
    with dist.PeerSignals(group, backend=be, timeout_s=5) as sig:
        assert sig.names == dist.DEFAULT_NAMES
        assert sig.next_epoch() == 1 and sig.next_epoch() == 2
        assert sig.get("consumed", 0) == 0
        sig.wait("consumed", 5)  # no other rank: nothing to wait for
        sig.set("consumed", 0, 3)
        assert sig.get("consumed", 0) == 3
        sig.wait("consumed", 3, source=0)
        sig.wait("consumed", 2, source=[0])
        with pytest.raises(ValueError, match=r"must not decrease \(it is already 3\)"):
            sig.set("consumed", 0, 2)
        with pytest.raises(ValueError, match=r"unknown flag name='nope'"):
            sig.set("nope", 0, 1)
        with pytest.raises(ValueError, match=r"target_rank=1 must be a group rank in 0..0"):
            sig.set("consumed", 1, 1)
        q = be.create_queue()
        sig.set_all("inbox_ready", 1, after=q, include_self=True)  # synchronizes q first
        assert sig.get("inbox_ready", 0) == 1
        sig.wait_consumed()  # no peers: returns at once
        sig.set_meta([1, 2, 3])
        assert sig.meta(0) == (1, 2, 3, 0, 0, 0, 0, 0)
        with pytest.raises(ValueError, match="at most 8 values"):
            sig.set_meta(range(9))
        # 1.7 was stored as 1; 2**63, 2**64 and NaN were numpy's or int()'s own errors, unnamed.
        with pytest.raises(TypeError, match=r"value=1.7 must be an int \(flags count epochs\)"):
            sig.set("consumed", 0, 1.7)
        with pytest.raises(ValueError, match=r"value=9223372036854775808 must be an epoch in 0\.\."):
            sig.set("consumed", 0, 2**63)
        with pytest.raises(TypeError, match="value=nan must be an int"):
            sig.wait("consumed", float("nan"))
        with pytest.raises(ValueError, match=r"epoch=18446744073709551616 must be an epoch"):
            sig.abort(2**64)
        with pytest.raises(ValueError, match=r"18446744073709551616 does not fit the int64 a meta slot holds"):
            sig.set_meta([2**64])
        assert sig.get("consumed", 0) == 3


def test_signal_wait_times_out_naming_rank_flag_expected_and_seen(group, shm_clean):
    with dist.PeerSignals(group, timeout_s=5) as sig:
        sig.set("gather_ready", 0, 4)
        with pytest.raises(RuntimeError, match=r"rank 0 of group 'tp': timed out after 0.05 s waiting for flag "
                                               r"'gather_ready' from rank 0 to reach 7; it is 4"):
            sig.wait("gather_ready", 7, source=0, timeout_s=0.05)
        with pytest.raises(ValueError, match=r"set\(after=queue\) needs PeerSignals\(backend=...\)"):
            sig.set("gather_ready", 0, 5, after=object())


def test_signal_abort_fails_waiters_fast_only_for_unfinished_steps(group, shm_clean):
    with dist.PeerSignals(group, timeout_s=30) as sig:
        sig.set("inbox_ready", 0, 2)
        sig.abort(3)
        sig.wait("inbox_ready", 2, source=0)  # it finished step 2 before aborting step 3
        with pytest.raises(RuntimeError, match=r"waiting for flag 'inbox_ready' >= 3 from rank 0, but rank 0 aborted"):
            sig.wait("inbox_ready", 3, source=0)
        with pytest.raises(RuntimeError, match="timed out"):  # epoch 4 was not aborted: a normal timeout
            sig.wait("inbox_ready", 4, source=0, timeout_s=0.02)
        sig.abort()  # permanent
        with pytest.raises(RuntimeError, match="aborted"):
            sig.wait("inbox_ready", 10**9, source=0)


def test_signals_bad_names(group, shm_clean):
    for names, match in [((), "non-empty tuple"), (("a", "a"), "duplicates"), (("a", ""), "non-empty"),
                         ("abc", "non-empty tuple")]:
        with pytest.raises(ValueError, match=match):
            dist.PeerSignals(group, names=names)
    with dist.PeerSignals(group, names=["x"]) as sig:
        assert sig.names == ("x",)
    assert sig.closed
    with pytest.raises(RuntimeError, match="is closed"):
        _ = sig.get("x", 0)


def test_peer_buffers_too_large_say_how_much_on_every_rank(group):
    with pytest.raises(dist.PeerAccessError, match=r"PeerBuffers export: .*could not allocate 1125899906842624 bytes"):
        dist.PeerBuffers(1 << 50, group, CPUBackend())


def test_a_collective_on_a_freed_group_is_a_clear_error():
    from mpi4py import MPI

    dist.destroy_distributed()
    g = dist.init_distributed(comm=MPI.COMM_SELF.Dup())
    dist.destroy_distributed()
    with pytest.raises(RuntimeError, match="group 'tp' was freed .*destroy_distributed"):
        dist.barrier(g)


def test_views_refuse_fractional_shapes_and_object_dtypes(group, shm_clean):
    # (2.7,) was truncated to a 2-element view; object gave numpy's "array of references" error.
    with dist.PeerBuffers(64, group, CPUBackend()) as pb:
        with pytest.raises(TypeError, match=r"shape=\(2.7,\) must contain ints"):
            pb.views(np.float32, (2.7,))
        with pytest.raises(TypeError, match="dtype=object cannot view shared memory"):
            pb.views(object, (1,))


# ---------------------------------------------------------------------------- CUDA IPC exports
def test_cuda_ipc_export_pads_its_allocation_to_whole_2mib_blocks(monkeypatch, rng):
    # On a GPU, cudaMalloc may carve a small allocation out of a larger block and IPC would then
    # share the whole block: an export must be a block of its own.  The driver calls are faked
    # (this runs anywhere); the backend's allocation, the view and the wire message are real.
    import ctypes
    import struct

    from cuda.bindings import driver as cu

    from vtnumba.dist import cuda_ipc

    raw = rng.integers(0, 256, cuda_ipc.IPC_HANDLE_BYTES, dtype=np.uint8).tobytes()

    def address_range(ptr):
        return cu.CUresult.CUDA_SUCCESS, cu.CUdeviceptr(int(ptr)), 0

    def get_handle(base):
        handle = cu.CUipcMemHandle()
        ctypes.memmove(handle.getPtr(), raw, len(raw))
        return cu.CUresult.CUDA_SUCCESS, handle

    monkeypatch.setattr(cu, "cuMemGetAddressRange", address_range)
    monkeypatch.setattr(cu, "cuIpcGetMemHandle", get_handle)
    MiB = 1 << 20
    assert [cuda_ipc.ipc_allocation_bytes(n) for n in (0, 1, 96, 2 * MiB, 2 * MiB + 1)] == \
        [2 * MiB, 2 * MiB, 2 * MiB, 2 * MiB, 4 * MiB]
    be = CPUBackend()
    for nbytes, allocated in ((96, 2 * MiB), (2 * MiB + 4, 4 * MiB)):
        exp = cuda_ipc.CudaIpcExport(be, nbytes)
        try:
            assert exp.buffer.nbytes == allocated
            view = exp.array
            assert view.shape == (nbytes,) and np.shares_memory(view, exp.buffer.array)
            magic, handle, offset, size = struct.unpack("<4s64sQQ", exp.handle_bytes)
            assert (magic, handle, offset, size) == (b"CIPC", raw, 0, nbytes)  # the peer opens nbytes
        finally:
            exp.free()
        assert exp.buffer is None
