"""numba's on-disk cache never serves machine code built from an older helper file."""

from vtnumba.kernels._common import drop_stale_numba_cache


def _entries(cache):
    return sorted(p.name for p in cache.iterdir() if p.suffix in (".nbi", ".nbc"))


def test_cache_entries_go_when_a_dependency_changes(tmp_path):
    module, helper = tmp_path / "norm.py", tmp_path / "_streaming.py"
    module.write_text("# kernels\n")
    helper.write_text("# helper v1\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()

    def fake_entries():
        for name in ("norm.kernel-10.py311.nbi", "norm.kernel-10.py311.1.nbc"):
            (cache / name).write_bytes(b"machine code")
        (cache / "other.kernel-3.py311.nbi").write_bytes(b"another module's entry")

    fake_entries()
    drop_stale_numba_cache(str(module), "_streaming.py")  # no record yet: start clean
    assert _entries(cache) == ["other.kernel-3.py311.nbi"]

    fake_entries()
    drop_stale_numba_cache(str(module), "_streaming.py")  # nothing changed: keep the cache
    assert _entries(cache) == ["norm.kernel-10.py311.1.nbc", "norm.kernel-10.py311.nbi", "other.kernel-3.py311.nbi"]

    helper.write_text("# helper v2\n")
    drop_stale_numba_cache(str(module), "_streaming.py")  # the helper changed: recompile
    assert _entries(cache) == ["other.kernel-3.py311.nbi"]
