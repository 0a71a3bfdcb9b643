"""ECSharedRegion: the /dev/shm file both sides map -- layout, lifecycle, validation."""

import os
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from vtnumba.ec import (
    ECRegionConfig,
    ECRegionError,
    ECRegionHandle,
    create_ec_shared_region,
    open_ec_shared_region,
    region_path,
)
from vtnumba.ec.region import HEADER_BYTES

pytestmark = pytest.mark.usefixtures("no_new_ec_region_files")


@pytest.fixture
def engine(request):
    return f"t{os.getpid()}_{abs(hash(request.node.nodeid)) % 10**8}"


def test_create_layout_mode_and_cleanup(engine):
    cfg = ECRegionConfig(engine_id=engine, hidden_size=24, dtype="float16", region_bytes=10_000, create=True)
    region = create_ec_shared_region(cfg)
    path = region_path(engine)
    assert region.path == path == f"/dev/shm/vtnumba_ec_{engine}.mmap"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert region.block_size_bytes == 48
    assert region.num_blocks == 10_000 // 48
    assert region.blocks.shape == (208, 48) and region.blocks.dtype == np.int8
    assert os.path.getsize(path) == HEADER_BYTES + 208 * 48
    assert region.base_ptr % 4096 == 0  # the blocks start page-aligned
    assert region.is_creator
    region.cleanup()
    assert not os.path.exists(path) and region.closed
    region.cleanup()  # twice is harmless


def test_a_region_dropped_without_cleanup_leaves_no_live_range(engine):
    """The copy engine accepts addresses of live memory only: once a region nobody cleaned up is
    unmapped (its last reference gone), its blocks must stop counting as live -- while a view of
    them is still held, they still are."""
    import gc

    from vtnumba.memory.copy_engine import is_live

    region = create_ec_shared_region(engine_id=engine, hidden_size=8, dtype="float32", region_bytes=4096,
                                     create=True, anonymous=True)
    ptr, nbytes = region.base_ptr, region.total_bytes
    view = region.blocks[1:3]
    assert is_live(ptr, nbytes)
    with pytest.warns(ResourceWarning, match="without close"):
        del region
        gc.collect()
    assert is_live(ptr, nbytes), "a view still maps the blocks"
    view[:] = 7  # (still mapped: writable)
    del view
    gc.collect()
    assert not is_live(ptr, nbytes), "the unmapped blocks are still registered as live memory"


def _open_descriptors():
    return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")}


@pytest.mark.parametrize("anonymous", [False, True])
def test_a_region_dropped_without_cleanup_gives_back_its_descriptor_and_name(engine, anonymous):
    # A dropped creator kept its descriptor -- an anonymous region's memory with it -- and a named
    # one its /dev/shm file until the process ended; an opener kept its descriptor.
    import gc

    before = _open_descriptors()
    region = create_ec_shared_region(engine_id=engine, hidden_size=8, dtype="float32", region_bytes=4096,
                                     create=True, anonymous=anonymous)
    opener = open_ec_shared_region(region.handle, hidden_size=8, dtype="float32")
    assert _open_descriptors() - before, "the region holds no descriptor to give back"
    with pytest.warns(ResourceWarning, match=r"garbage-collected without close\(\), so vtnumba closed its descriptor"):
        del opener
        gc.collect()
    what = "closed its descriptor now" if anonymous else "closed its descriptor and removed its file now"
    with pytest.warns(ResourceWarning, match=what):
        del region
        gc.collect()
    assert _open_descriptors() - before == set()
    assert not os.path.exists(region_path(engine))  # (and the fixture checks no file is left)


def test_a_region_cleaned_up_or_unlinked_warns_of_nothing_when_dropped(engine, recwarn):
    import gc

    for anonymous in (False, True):
        region = create_ec_shared_region(engine_id=engine, hidden_size=8, dtype="float32", region_bytes=4096,
                                         create=True, anonymous=anonymous)
        region.cleanup()
        del region
        gc.collect()
    assert not [w for w in recwarn if issubclass(w.category, ResourceWarning)]


def test_opener_sees_creator_writes_and_only_creator_unlinks(engine, rng):
    with create_ec_shared_region(engine_id=engine, hidden_size=8, dtype="float32", region_bytes=4096,
                                 create=True) as creator:
        opener = create_ec_shared_region(engine_id=engine, hidden_size=8, dtype=np.float32)  # adopts the size
        assert opener.num_blocks == creator.num_blocks == 128 and not opener.is_creator
        data = rng.integers(-128, 127, size=(3, 32), dtype=np.int8)
        creator.blocks[5:8] = data
        np.testing.assert_array_equal(opener.blocks[5:8], data)  # same physical pages
        opener.blocks[100] = 7
        assert (creator.blocks[100] == 7).all()
        opener.cleanup()
        assert os.path.exists(creator.path), "an opener must not unlink the creator's file"
    assert not os.path.exists(region_path(engine))


def test_early_unlink_keeps_the_mappings(engine):
    creator = create_ec_shared_region(engine_id=engine, hidden_size=4, dtype="float32", region_bytes=1024,
                                      create=True)
    opener = create_ec_shared_region(engine_id=engine, hidden_size=4, dtype="float32")
    assert creator.unlink() and not os.path.exists(creator.path)
    assert not creator.unlink()  # idempotent
    assert not opener.unlink()  # only the creator unlinks
    creator.blocks[3] = 42
    assert (opener.blocks[3] == 42).all()
    opener.cleanup()
    creator.cleanup()


def test_second_creator_is_refused(engine):
    with create_ec_shared_region(engine_id=engine, hidden_size=4, region_bytes=1024, create=True):
        with pytest.raises(ECRegionError, match=f"engine_id='{engine}'.*already exists"):
            create_ec_shared_region(engine_id=engine, hidden_size=4, region_bytes=1024, create=True)


def test_region_smaller_than_one_block(engine):
    with pytest.raises(ValueError, match=r"region_bytes=100 is smaller than one block.*256 bytes"):
        create_ec_shared_region(engine_id=engine, hidden_size=64, dtype="float32", region_bytes=100, create=True)
    assert not os.path.exists(region_path(engine))


@pytest.mark.parametrize("kwargs, words", [
    (dict(hidden_size=16, dtype="float32"), ["hidden_size=16", "hidden_size=8"]),
    (dict(hidden_size=8, dtype="float16"), ["dtype=float16", "dtype=float32"]),
    (dict(hidden_size=8, dtype="float32", region_bytes=999_999), ["region_bytes=999999", "producer's region"]),
])
def test_consumer_config_mismatch(engine, kwargs, words):
    with create_ec_shared_region(engine_id=engine, hidden_size=8, dtype="float32", region_bytes=4096,
                                 create=True):
        with pytest.raises(ValueError) as ei:
            create_ec_shared_region(engine_id=engine, **kwargs)
        for w in words:
            assert w in str(ei.value)


def test_opener_of_a_missing_region(engine):
    with pytest.raises(ECRegionError, match="does not exist.*create=True"):
        create_ec_shared_region(engine_id=engine, hidden_size=4)


def test_opener_waits_for_the_creator(engine):
    box = {}

    def create_later():
        time.sleep(0.2)
        box["r"] = create_ec_shared_region(engine_id=engine, hidden_size=4, region_bytes=2048, create=True)

    t = threading.Thread(target=create_later)
    t.start()
    opener = create_ec_shared_region(engine_id=engine, hidden_size=4, open_timeout_s=10)
    t.join()
    assert opener.num_blocks == box["r"].num_blocks == 128
    opener.cleanup()
    box["r"].cleanup()


def test_pin_memory_is_a_reported_noop_off_gpu(engine):
    from vtnumba.backend.cpu import CPUBackend

    with create_ec_shared_region(engine_id=engine, hidden_size=4, region_bytes=1024, create=True) as r:
        assert r.pin_memory(CPUBackend()) is False
        assert "no-op" in r.pin_status and not r.is_pinned


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(engine_id="a/b", hidden_size=4), ValueError, ["engine_id='a/b'"]),
    (dict(engine_id="ok", hidden_size=0), ValueError, ["hidden_size=0"]),
    (dict(engine_id="ok", hidden_size=4, dtype="bfloat16"), TypeError, ["bfloat16"]),
    (dict(engine_id="ok", hidden_size=4, dtype="nonsense"), TypeError, ["nonsense"]),
    (dict(engine_id="ok", hidden_size=4, dtype="U4"), TypeError, ["dtype=<U4 cannot hold embeddings"]),
    (dict(engine_id="ok", hidden_size=4, dtype=[("a", "f4")]), TypeError, ["cannot hold embeddings"]),
    (dict(engine_id="ok", hidden_size=4, create=True), ValueError, ["region_bytes=None", "creator"]),
    (dict(engine_id="ok", hidden_size=4, region_bytes=-1), ValueError, ["region_bytes=-1"]),
    (dict(engine_id="ok", hidden_size=4, region_bytes=2 ** 64), ValueError, ["region_bytes=18446744073709551616"]),
])
def test_bad_config(kwargs, exc, words):
    with pytest.raises(exc) as ei:
        ECRegionConfig(**kwargs)
    for w in words:
        assert w in str(ei.value)


def test_check_block_ids(engine):
    with create_ec_shared_region(engine_id=engine, hidden_size=4, region_bytes=16 * 10, create=True) as r:
        np.testing.assert_array_equal(r.check_block_ids([0, 9]), [0, 9])
        with pytest.raises(ValueError, match="block id 10, outside the region's 0..9"):
            r.check_block_ids([3, 10], "saves['h']")
        with pytest.raises(ValueError, match="block id -1"):
            r.check_block_ids([-1])
        with pytest.raises(TypeError, match="int block ids"):
            r.check_block_ids(["x"])


def test_use_after_cleanup(engine):
    r = create_ec_shared_region(engine_id=engine, hidden_size=4, region_bytes=1024, create=True)
    r.cleanup()
    with pytest.raises(RuntimeError, match="cleaned up"):
        _ = r.base_ptr
    with pytest.raises(RuntimeError, match="after cleanup"):
        r.pin_memory()


def test_cleanup_with_a_live_view_does_not_crash(engine):
    r = create_ec_shared_region(engine_id=engine, hidden_size=4, region_bytes=1024, create=True)
    view = r.blocks[2]
    view[:] = 5
    with pytest.warns(ResourceWarning, match="still alive"):
        r.cleanup()
    assert not os.path.exists(r.path)
    assert (view == 5).all()  # the mapping lives on with the view, nothing dangles


def test_cleanup_finishes_when_a_worker_wait_fails(engine):
    # After a dead CUDA context every wait raises; the teardown must still unmap and close,
    # and say why at the end (before, each retry raised again and nothing was released).
    class BrokenWorker:
        backend = type("B", (), {"closed": False})()

        def wait(self):
            raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS")

    r = create_ec_shared_region(engine_id=engine, hidden_size=4, region_bytes=1024, create=True)
    fd = r._fd  # (named: unlinking leaves the descriptor to the unmapping)
    broken = BrokenWorker()
    r._workers.add(broken)
    with pytest.raises(RuntimeError, match="ILLEGAL_ADDRESS"):
        r.cleanup()
    assert r.closed and r._fd is None and r._range is None
    with pytest.raises(OSError):
        os.fstat(fd)  # the descriptor was closed
    r._workers.discard(broken)
    r.cleanup()  # nothing left to do


@pytest.mark.parametrize("how", ["cleanup", "dropped"])
def test_registered_pages_are_unregistered_before_the_mapping_goes(engine, monkeypatch, how):
    # The driver calls stand in for a GPU: what is checked is the order -- unregister while the
    # pages are still mapped -- on cleanup() and on a region dropped without it.
    import gc
    import weakref
    from types import SimpleNamespace

    from cuda.bindings import driver as cu

    import vtnumba.backend.cuda

    events = []

    def register(address, nbytes, flags):
        events.append(("register", address))
        return (cu.CUresult.CUDA_SUCCESS,)

    def unregister(address):
        mapped = any(r.address == address and r.mapping() is not None and not r.mapping().closed for r in regions)
        events.append(("unregister", address, mapped))
        return (cu.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(cu, "cuMemHostRegister", register)
    monkeypatch.setattr(cu, "cuMemHostUnregister", unregister)
    monkeypatch.setattr(vtnumba.backend.cuda, "current_context", lambda: None)  # no driver to ask here
    gpu = SimpleNamespace(capabilities=SimpleNamespace(host_addressable=False))
    r = create_ec_shared_region(engine_id=engine, hidden_size=4, region_bytes=8192, create=True)
    address = int(r._base.ctypes.data)
    regions = [SimpleNamespace(address=address, mapping=weakref.ref(r._mmap))]
    assert r.pin_memory(gpu) and r.is_pinned and events == [("register", address)]
    if how == "cleanup":
        r.cleanup()
    else:
        r.unlink()  # (the name: so the test leaves no file; the mapping stays)
        with pytest.warns(ResourceWarning, match="closed its descriptor now"):
            del r
            gc.collect()
    assert events == [("register", address), ("unregister", address, True)]
    mapping = regions[0].mapping()
    assert mapping is None or mapping.closed  # and then it was unmapped


# ------------------------------------------------------------------------------ input the region refuses
@pytest.mark.parametrize("bad", ["abc\n", "a\nb", "", "x" * 129, "a b", "../x"])
def test_engine_id_must_match_entirely(bad):
    # "$" in re.match also matches before a trailing newline: fullmatch does not.
    with pytest.raises(ValueError, match="engine_id="):
        region_path(bad)


def test_block_ids_must_be_whole_numbers(engine):
    with create_ec_shared_region(engine_id=engine, hidden_size=4, region_bytes=16 * 10, create=True) as r:
        for bad in ([1.7], [1.0], np.array([2.5]), [True]):
            with pytest.raises(TypeError, match="whole-number int block ids"):
                r.check_block_ids(bad)
        assert r.check_block_ids([]).dtype == np.int64  # an empty list is fine
        np.testing.assert_array_equal(r.check_block_ids(np.array([3, 4], np.uint32)), [3, 4])


# ------------------------------------------------------------------------------ what an opener refuses
def test_opener_refuses_a_symlink(engine, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"\0" * 8192)
    os.chmod(target, 0o600)
    os.symlink(target, region_path(engine))
    try:
        with pytest.raises(ECRegionError, match="symlink is refused"):
            create_ec_shared_region(engine_id=engine, hidden_size=4)
        # A creator does not follow it either: the name is taken.
        with pytest.raises(ECRegionError, match="already exists"):
            create_ec_shared_region(engine_id=engine, hidden_size=4, region_bytes=1024, create=True)
    finally:
        os.unlink(region_path(engine))


def test_opener_refuses_a_file_with_another_mode(engine):
    with create_ec_shared_region(engine_id=engine, hidden_size=4, region_bytes=1024, create=True) as r:
        os.chmod(r.path, 0o644)
        with pytest.raises(ECRegionError, match="mode 0o644, expected 0o600"):
            create_ec_shared_region(engine_id=engine, hidden_size=4)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_opener_refuses_another_users_file(engine):
    with create_ec_shared_region(engine_id=engine, hidden_size=4, region_bytes=1024, create=True) as r:
        os.chown(r.path, 12345, -1)
        with pytest.raises(ECRegionError, match="belongs to uid 12345, not to this user"):
            create_ec_shared_region(engine_id=engine, hidden_size=4)


# ------------------------------------------------------------------------------ anonymous regions
def test_anonymous_region_has_no_name_and_opens_through_its_handle(engine):
    with create_ec_shared_region(engine_id=engine, hidden_size=8, dtype="float16", region_bytes=4096, create=True,
                                 anonymous=True) as creator:
        assert creator.path is None and not [f for f in os.listdir("/dev/shm") if engine in f]
        h = creator.handle
        assert (h.pid, h.engine_id) == (os.getpid(), engine) and h.proc_path == f"/proc/{os.getpid()}/fd/{h.fd}"
        opener = open_ec_shared_region(h, hidden_size=8, dtype="float16")
        assert opener.num_blocks == creator.num_blocks and not opener.is_creator
        creator.blocks[3] = 9
        assert (opener.blocks[3] == 9).all()  # same pages
        assert creator.unlink()  # the descriptor is closed: nobody else can open it ...
        with pytest.raises(RuntimeError, match="no longer shared"):
            _ = creator.handle
        with pytest.raises(ECRegionError, match="does not exist: the creator"):
            open_ec_shared_region(h, hidden_size=8, dtype="float16")
        opener.blocks[4] = 7
        assert (creator.blocks[4] == 7).all()  # ... and the mappings live on
        opener.cleanup()


def test_handle_to_another_inode_is_refused(engine):
    with create_ec_shared_region(engine_id=engine, hidden_size=8, region_bytes=4096, create=True,
                                 anonymous=True) as creator:
        h = creator.handle
        forged = ECRegionHandle(h.engine_id, h.pid, h.fd, h.dev, h.ino + 1)  # a reused pid/fd number
        with pytest.raises(ECRegionError, match="is not the region the creator announced"):
            open_ec_shared_region(forged, hidden_size=8)
        with pytest.raises(ValueError, match="hidden_size=16 but the producer"):
            open_ec_shared_region(h, hidden_size=16)


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("anonymous", [False, True])
def test_a_region_with_no_room_is_refused_by_name_and_leaves_no_file(engine, anonymous, monkeypatch):
    """A /dev/shm with less room than the region (a container's is often 64 MB): ftruncate and
    mmap succeed on tmpfs whatever the room, and the first page without room killed the process
    with SIGBUS, leaving the file.  The reservation (posix_fallocate) fails instead; it is made
    to fail here as a full tmpfs makes it (checked by hand on an 8 MiB tmpfs: ENOSPC)."""
    import errno

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(ECRegionError) as info:
        create_ec_shared_region(engine_id=engine, hidden_size=256, region_bytes=32 << 20, create=True,
                                anonymous=anonymous)
    said = str(info.value)
    assert f"region_bytes={32 << 20}: could not reserve" in said and "No space left on device" in said, said
    assert ("/dev/shm has less room than that" in said) != anonymous, said
    assert not os.path.exists(region_path(engine))


def test_named_creator_dying_from_an_exception_leaves_no_file(engine):
    proc = _run_python(f"from vtnumba.ec import create_ec_shared_region\n"
                       f"r = create_ec_shared_region(engine_id={engine!r}, hidden_size=4, region_bytes=1024, "
                       f"create=True)\n"
                       f"1 / 0  # an uncaught exception, before any cleanup\n")
    assert "ZeroDivisionError" in proc.stderr
    assert not os.path.exists(region_path(engine))  # the atexit hook unlinked it


@pytest.mark.parametrize("anonymous", [False, True])
def test_sigkill_inside_the_window_named_is_cleaned_by_the_janitor_anonymous_has_nothing(engine, anonymous):
    """The documented trade-off: nothing runs in a killed process, so a *named* region killed
    inside its window (created, not yet unlinked) leaves its file until the janitor of
    :mod:`vtnumba.memory.shared_files` -- a process of its own, which sees the creator's pipe
    close -- removes it, moments later; an anonymous region never has a file at all."""
    proc = _run_python(f"import os, signal\n"
                       f"from vtnumba.ec import create_ec_shared_region\n"
                       f"r = create_ec_shared_region(engine_id={engine!r}, hidden_size=4, region_bytes=1024, "
                       f"create=True, anonymous={anonymous})\n"
                       f"print(os.path.exists(r.path) if r.path else None, flush=True)\n"
                       f"os.kill(os.getpid(), signal.SIGKILL)\n")
    assert proc.returncode == -9
    assert proc.stdout.strip() == ("None" if anonymous else "True")  # the file existed while it ran

    def left():
        return {f for f in os.listdir("/dev/shm") if engine in f}  # this test's engine id only

    deadline = time.monotonic() + 30
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    leftover = left()
    for f in leftover:
        os.unlink(os.path.join("/dev/shm", f))
    assert not leftover, "the janitor did not remove the killed creator's file"


def test_an_anonymous_region_larger_than_memory_is_refused(engine):
    # memfd memory has no size limit: posix_fallocate took pages until the OOM killer ended the
    # process (a named region's tmpfs refuses with ENOSPC instead).
    from vtnumba.ec.region import available_memory_bytes

    room = available_memory_bytes()
    assert room is not None and room > 0
    with pytest.raises(ECRegionError, match=r"region_bytes=\d+: \d+ bytes of shared memory .* more than this "
                                            r"machine has free"):
        create_ec_shared_region(engine_id=engine, hidden_size=4, region_bytes=room + (1 << 30), create=True,
                                anonymous=True)


def test_a_byte_order_mismatch_says_which(engine):
    with create_ec_shared_region(engine_id=engine, hidden_size=4, dtype=">f4", region_bytes=1024, create=True) as r:
        with pytest.raises(ValueError, match=r"this side expects dtype=<f4, .* with dtype=>f4"):
            create_ec_shared_region(engine_id=engine, hidden_size=4, dtype="float32")


@pytest.mark.parametrize("anonymous", [False, True])
def test_an_interrupted_cleanup_never_leaves_a_closed_descriptor_to_close_again(engine, anonymous, monkeypatch):
    # A Ctrl-C lands right after a C call returns: os.close had run, the field still named the
    # number, and the finalizer (or a second cleanup) closed it again -- someone else's by then.
    import gc

    region = create_ec_shared_region(engine_id=engine, hidden_size=8, dtype="float32", region_bytes=4096,
                                     create=True, anonymous=anonymous)
    real_close = os.close
    interrupted = []

    def close_then_interrupt(fd):
        real_close(fd)
        if not interrupted:
            interrupted.append(fd)
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "close", close_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        region.cleanup()
    monkeypatch.setattr(os, "close", real_close)
    assert region._left.fd is None, "the closed descriptor is still listed, to be closed again"
    other = os.open(os.devnull, os.O_RDONLY)  # (likely the number just freed)
    try:
        region.cleanup()
        del region
        gc.collect()
        os.fstat(other)  # still open: nobody closed it as the region's
    finally:
        real_close(other)
