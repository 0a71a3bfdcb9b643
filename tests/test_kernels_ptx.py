"""Every @cuda.jit kernel compiles to PTX for sm_80 and sm_90 (no GPU needed).

The simulator type-checks nothing, so this is what catches a kernel that would fail on a
GPU.  The ``kernel_ptx`` fixture (tests/conftest.py) compiles them all once per run, in
subprocesses with the real numba.cuda; test_kernels_wide reads the same PTX.  NVVM comes from
pip with the test extra ``numba-cuda[cu13]``.
"""

import io
import os
import re

import pytest

EXPECTED = {"naive", "smem", "regtile", "fused_add_norm", "peer_reduce_norm", "sum_sources", "gather_rows",
            "wide", "warptile", "dbuf", "async", "copy_rows", "add_rows", "accumulate_rows", "activation", "add_bias",
            "attention", "write_flag", "wait_flag"}


def test_every_kernel_compiles_for_sm80_and_sm90(kernel_ptx):
    results, unlisted = kernel_ptx["results"], kernel_ptx["unlisted"]
    for proc in kernel_ptx["processes"]:
        assert proc["output"], f"cc {proc['cc']}: no output; stderr:\n{proc['stderr'][-3000:]}"
        # A process that failed for another reason than a kernel's compile error says why here.
        assert proc["returncode"] == 0 or not all(e["ok"] for e in results), proc["stderr"][-3000:]
    failed = [f"{e['name']} {e['sig']} cc{e['cc']}: {e.get('error')}" for e in results if not e["ok"]]
    assert not failed, "\n".join(failed)
    assert not unlisted, f"kernels without a PTX signature: {sorted(unlisted)}"
    assert {e["name"] for e in results} == EXPECTED
    assert {e["cc"] for e in results} == {"8.0", "9.0"}
    # The flag-wait kernel must read the word afresh on every turn of its loop, and at L2
    # (an atomic): a load the compiler hoisted out of the loop, or one an SM's L1 answers,
    # could spin forever on a value the peer has long changed.
    ptx = next(e["ptx"] for e in results if e["name"] == "wait_flag" and e["cc"] == "9.0")
    loops = re.findall(r"^(\$L__BB\d+_\d+):$(.*?)^\s*@%p\d+ bra\s+\1;", ptx, re.M | re.S)
    assert loops and all("atom.global.add.u32" in body for _, body in loops), ptx


def test_flag_write_kernel_publishes_with_an_atomic_after_the_system_fence(kernel_ptx):
    # A fence followed by a plain (weak) store is no release in the PTX memory model -- the
    # waiter's atomic polls would race with it.  The word must be written by an atomic, and
    # only after the membar.sys that makes the stream's earlier writes visible.
    ptx = next(e["ptx"] for e in kernel_ptx["results"] if e["name"] == "write_flag" and e["cc"] == "9.0")
    fence, publish = ptx.find("membar.sys"), ptx.find("atom.global.exch.b32")
    assert fence >= 0 and publish > fence, ptx
    assert not re.search(r"^\s*st\.global\.u32", ptx, re.M), ptx


def _ptx_cli(*args):
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-m", "vtnumba.kernels.ptx", *args], env=env, capture_output=True,
                          text=True, timeout=300)
    return proc, (json.loads(proc.stdout) if proc.returncode in (0, 1) and proc.stdout else None)


def test_resources_of_a_kernel_that_links_float16_code_at_launch():
    # The float16 '+' is CUDA C++ (cuda_fp16.h) that numba links in at launch: the kernel's PTX
    # alone declares it .extern, and ptxas alone fails on it.  The report links it as launches
    # do (nvJitLink), so both dtypes get real figures -- and a failed report fails the command.
    from vtnumba.kernels.ptx import nvjitlink_available

    if not nvjitlink_available():  # (the test extra installs it; a GPU image may have only ptxas)
        pytest.skip("nvJitLink cannot be loaded here; the ptxas fallback is tested below")
    proc, report = _ptx_cli("--cc", "90", "--ptxas", "--only", "add_rows")
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    assert report["resources_via"] == "nvJitLink", report
    entries = {("float16" if "float16" in e["sig"] else "float32"): e["ptxas"] for e in report["results"]}
    assert set(entries) == {"float32", "float16"} and {e["name"] for e in report["results"]} == {"add_rows"}
    for dtype, usage in entries.items():
        assert "error" not in usage, (dtype, usage)
        assert usage["via"] == "nvJitLink" and 0 < usage["registers"] <= 255, usage
        assert usage["spill_store_bytes"] == 0 and usage["smem_bytes"] == 0, usage
    assert entries["float32"]["modules"] == 1 and entries["float16"]["modules"] == 2, entries


def test_ptx_cli_refuses_unknown_kernels_and_capabilities_naming_the_argument():
    proc, _ = _ptx_cli("--only", "add_rowz")
    assert proc.returncode == 2 and "--only: no kernel named add_rowz" in proc.stderr and "add_rows" in proc.stderr
    proc, _ = _ptx_cli("--cc", "sm90")
    assert proc.returncode == 2 and "--cc: 'sm90'" in proc.stderr


def test_ptxas_fallback_names_the_functions_it_cannot_resolve():
    # Without nvJitLink, ptxas sees only the kernel's PTX: a kernel that links other code gets
    # an error naming it, never numbers for a module that would not assemble.
    from vtnumba.kernels.ptx import ptxas_usage

    ptx = (".version 9.0\n.target sm_90\n.address_size 64\n"
           ".extern .func  (.param .b32 func_retval0) _ZplRK6__halfS1__nbst\n(\n.param .b64 p0\n)\n;\n")
    usage = ptxas_usage(ptx, "sm_90", ptxas="/nonexistent/ptxas")
    assert usage["via"] == "ptxas" and "_ZplRK6__halfS1__nbst" in usage["error"] and "registers" not in usage


# A made-up listing in nvdisasm's format: a spill store before the loops, an outer loop with a
# predicated back branch around an inner loop of FMAs that reloads a spill, and the trap
# (a branch to itself) ptxas puts after EXIT.
_SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   STL [R1+0x4], R9                                      (*"SpillRefill"*);
.L_x_0:
        /*0020*/                   LDL R9, [R1+0x4]                                      (*"SpillRefill"*);
        /*0030*/                   LDS.128 R12, [R2] ;
.L_x_1:
        /*0040*/                   FFMA R4, R12, R13, R4 ;
        /*0050*/                   FFMA R5, R12, R14, R5 ;
        /*0060*/                   LDL R10, [R1+0x8]                                     (*"SpillRefill"*);
        /*0070*/               @P1 BRA `(.L_x_1) ;
        /*0080*/                   STL [R1+0x10], R20 ;
        /*0090*/              @!P0 BRA P2, `(.L_x_0) ;
        /*00a0*/                   EXIT ;
.L_x_2:
        /*00b0*/                   BRA `(.L_x_2);
"""


def test_read_sass_finds_the_loops_and_where_the_spills_land():
    from vtnumba.kernels.ptx import read_sass

    got = read_sass(_SASS)
    assert got["instructions"] == 12 and got["fma"] == 2 and got["loops"] == 2, got
    # (The STL without the SpillRefill mark is a local array's store, not a spill.)
    assert (got["spill_stores"], got["spill_loads"], got["spills_in_loops"]) == (1, 2, 2), got
    assert got["hot_loop"] == {"instructions": 4, "fma": 2, "spill_stores": 0, "spill_loads": 1,
                               "start": "0x0040", "end": "0x0070"}, got
    # No FMA anywhere (a memory-bound kernel): the main loop is the largest one.
    plain = read_sass(_SASS.replace("FFMA", "FADD"))
    assert plain["fma"] == 0 and plain["hot_loop"]["start"] == "0x0020" and plain["hot_loop"]["end"] == "0x0090"
    assert read_sass("")["hot_loop"] is None
    # A second function (a callee not inlined) starts again at address 0: its loop is its own.
    callee = ".text.callee:\n.L_x_3:\n        /*0000*/                   FFMA R1, R2, R3, R1 ;\n" \
             "        /*0010*/               @P0 BRA `(.L_x_3) ;\n"
    two = read_sass(_SASS + callee)
    assert two["loops"] == 3 and two["instructions"] == 14 and two["fma"] == 3, two
    assert two["hot_loop"]["start"] == "0x0040" and two["spills_in_loops"] == 2, two


def test_sass_report_says_where_the_matmul_rungs_spills_land():
    # Linked as a launch links them and disassembled: the counts must agree with ptxas's
    # spill bytes, and the main loop must be the k-tile (TM x TN x BK = 512 FFMA a thread).
    from vtnumba.kernels.ptx import find_nvdisasm, nvjitlink_available

    if not (nvjitlink_available() and find_nvdisasm()):  # (the test extra installs both)
        pytest.skip("nvJitLink or nvdisasm is missing here")
    proc, report = _ptx_cli("--cc", "90", "--ptxas", "--sass", "--keep-sass", "--only", "async", "dbuf")
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    for e in report["results"]:
        usage, sass = e["ptxas"], e["sass"]
        assert "error" not in sass, sass
        assert (usage["spill_store_bytes"] > 0) == (sass["spill_stores"] > 0), (e["name"], usage, sass)
        hot = sass["hot_loop"]
        assert hot["fma"] == 512 and hot["instructions"] > hot["fma"], (e["name"], hot)
        assert hot["spill_loads"] <= sass["spills_in_loops"] <= sass["spill_loads"] + sass["spill_stores"], sass
        assert "FFMA" in sass["text"] and "cubin" not in usage
    proc, _ = _ptx_cli("--keep-sass")
    assert proc.returncode == 2 and "--keep-sass: only with --sass" in proc.stderr


def test_bench_kernels_keeps_its_ptxas_report_until_the_kernels_or_compilers_change(tmp_path, monkeypatch):
    # bench kernels --quick --ptxas compiled every kernel for sm_80 and sm_90 on every run: two
    # minutes on an idle 2-core machine, over ten under load, for a report that only changes with
    # the kernels' source or the compilers.
    import json
    import subprocess
    import types

    from vtnumba.bench import kernels as bench_kernels
    from vtnumba.bench import runner

    monkeypatch.setattr(runner, "OUT_DIR", str(tmp_path))
    report = {"results": [{"name": "add_rows", "sig": "(float32[:, ::1],)", "cc": "9.0",
                           "ptxas": {"registers": 12, "smem_bytes": 0, "spill_store_bytes": 0, "spill_load_bytes": 0}}]}
    runs = []

    def fake_run(cmd, **kw):
        runs.append(cmd)
        return types.SimpleNamespace(stdout=json.dumps(report), stderr="", returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    first_notes, second_notes = [], []
    first = bench_kernels._ptxas_resources(first_notes)
    second = bench_kernels._ptxas_resources(second_notes)
    assert len(runs) == 1 and first == second and first[0]["kernel"] == "add_rows"
    assert any("ptxas report from" in n for n in second_notes) and not any("from" in n for n in first_notes)
    # Another command (or kernel source, or compiler version) is another key.
    cmd = runs[0]
    assert bench_kernels._ptxas_cache_path(cmd) != bench_kernels._ptxas_cache_path(cmd + ["--sass"])
    # Every file a reported kernel is built from is part of the key -- the flag kernels' module,
    # outside vtnumba/kernels, too (an edit there once left a stale report called current).
    from vtnumba.backend import cuda_flags
    from vtnumba.kernels import _async_copy_cuda, matmul_cuda, ptx

    sources = ptx.kernel_source_files()
    for mod in (cuda_flags, matmul_cuda, _async_copy_cuda):
        assert os.path.abspath(mod.__file__) in sources
    real_open, key = open, bench_kernels._ptxas_cache_path(cmd)

    def edited(path, *a, **k):
        f = real_open(path, *a, **k)
        if os.path.abspath(path) == os.path.abspath(cuda_flags.__file__):
            return io.BytesIO(f.read() + b"# an edit\n")
        return f

    monkeypatch.setattr("builtins.open", edited)
    assert bench_kernels._ptxas_cache_path(cmd) != key
    monkeypatch.setattr("builtins.open", real_open)
    # A failed report is not kept: the next run tries again.
    monkeypatch.setattr(runner, "OUT_DIR", str(tmp_path / "other"))
    report["results"][0]["ptxas"] = {"arch": "sm_90", "error": "no ptxas"}
    bench_kernels._ptxas_resources([])
    bench_kernels._ptxas_resources([])
    assert len(runs) == 3
