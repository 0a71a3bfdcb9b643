"""Every @cuda.jit kernel compiles to PTX for sm_80 and sm_90 (no GPU needed).

The simulator type-checks nothing, so this is what catches a kernel that would fail on a
GPU.  compile_ptx needs the real numba.cuda, and this test process runs with the simulator
on (tests/conftest.py), so one subprocess with NUMBA_ENABLE_CUDASIM=0 compiles them all.
NVVM comes from pip with the test extra ``numba-cuda[cu13]``.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

EXPECTED = {"naive", "smem", "regtile", "fused_add_norm", "peer_reduce_norm", "sum_sources", "gather_rows",
            "wide", "warptile", "dbuf", "copy_rows", "add_rows", "accumulate_rows", "activation", "add_bias", "attention", "write_flag", "wait_flag"}


def test_every_kernel_compiles_for_sm80_and_sm90():
    # One process per architecture, both at once: NVVM is single-threaded, and the suite's
    # other core would sit idle.
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    procs = [subprocess.Popen([sys.executable, "-m", "vtnumba.kernels.ptx", "--cc", cc, *extra], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cc, extra in (("80", []), ("90", ["--keep-ptx"]))]
    results, unlisted = [], set()
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            assert out, f"no output; stderr:\n{err[-3000:]}"
            report = json.loads(out)
            results += report["results"]
            unlisted.update(report["unlisted"])
            assert proc.returncode == 0 or not all(e["ok"] for e in report["results"]), err[-3000:]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
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
