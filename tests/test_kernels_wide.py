"""128-bit accesses (vtnumba.kernels._wide_cuda): when the launchers allow them, that the PTX has them,
and that the wide and streamed paths of the norms keep the NaN semantics of the host reference.

The kernels' results on both access paths are tested in test_kernels_matmul/norm/peer; here
are the pieces those tests take for granted.
"""

import re

import numpy as np
import pytest

from vtnumba.kernels import fused_add_layer_norm, fused_add_rms_norm, peer_reduce_norm

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def test_wide_ok_needs_aligned_starts_and_rows():
    from vtnumba.kernels._wide_cuda import wide_ok

    flat = np.zeros(1024 + 8, np.float32)
    base = flat[(-flat.ctypes.data % 16) // 4:]  # starts on a 16-byte boundary
    assert wide_ok(base[:64].reshape(4, 16), base[:8], None)
    assert not wide_ok(base[1:65].reshape(4, 16))  # 4 bytes past the boundary
    assert not wide_ok(base[:60].reshape(4, 15))  # rows of 15: row 1 starts misaligned
    assert wide_ok(base[4:68].reshape(4, 16))  # 16 bytes past: aligned again
    half = np.zeros(64, np.float16)
    half = half[(-half.ctypes.data % 8) // 2:]
    assert wide_ok(half[:16].reshape(2, 8)) and not wide_ok(half[2:18].reshape(2, 8))  # float16: 8-byte quads
    wide = base[:128].reshape(4, 32)
    assert not wide_ok(wide[:, :16])  # aligned start and a width of 16, but rows 32 apart: strided
    assert not wide_ok(base[:128:2].reshape(4, 16))  # every other element


# The instructions counted in each kernel's sm_90 PTX.
_OPS = ("ld.global.v4.f32", "ld.global.v4.u16", "ld.shared.v4.f32", "st.global.v4.f32", "ld.local", "st.local",
        "fma.rn.f32", ".maxntid 256,", ".minnctapersm 2",
        "cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group 1;", "cp.async.wait_all")
_KERNELS = {"regtile", "wide", "warptile", "dbuf", "async", "fused_add_norm", "peer_reduce_norm", "gather_rows"}


def _ptx_counts(entries) -> dict:
    """Per kernel (``name``, or ``name-f16`` for wide's float16 signature): how often each of
    _OPS occurs, and how many 128-bit loads come before the first arithmetic and before the
    first barrier."""
    out = {}
    for e in entries:
        name, sig = e["name"], e["sig"]
        if e["cc"] != "9.0" or name not in _KERNELS or ("float16" in sig and name != "wide"):
            continue  # one float16 rung: the loaders are shared
        ptx = e["ptx"]
        counts = {op: ptx.count(op) for op in _OPS}
        body = ptx[ptx.index(".entry"):]
        math = re.search(r"^\s*(add|sub|mul|fma)\.(rn\.)?f32", body, re.M)
        counts["v4 loads before math"] = body[:math.start() if math else len(body)].count("ld.global.v4.f32")
        barrier = body.find("bar.sync")
        counts["v4 loads before bar.sync"] = body[:barrier if barrier >= 0 else len(body)].count("ld.global.v4.f32")
        out[name + ("-f16" if "float16" in sig else "")] = counts
    return out


def test_the_ptx_has_128_bit_accesses_and_no_local_memory(kernel_ptx):
    # What the simulator cannot show: that load4/store4 become vector instructions, and that
    # the register-held tiles and row caches really stay in registers (no .local traffic).
    # (kernel_ptx: every kernel's PTX, compiled once per run -- tests/conftest.py.)
    assert all(e["ok"] for e in kernel_ptx["results"]), "a kernel does not compile: see test_kernels_ptx"
    counts = _ptx_counts(kernel_ptx["results"])
    assert set(counts) == _KERNELS | {"wide-f16"}, sorted(counts)
    for rung in ("wide", "warptile", "dbuf", "async"):  # (async: b.T's quads still come through registers)
        c = counts[rung]
        assert c["ld.global.v4.f32"] >= 2 and c["st.global.v4.f32"] >= 1, (rung, c)
    for rung in ("wide", "warptile", "dbuf", "async", "wide-f16"):
        c = counts[rung]
        # The k-step unrolled by hand (matmul_cuda._tile_products): all 8 k of a tile written
        # out -- 8 x 64 multiply-adds, 8 x 4 wide shared loads -- where a loop would have one k's.
        assert c["fma.rn.f32"] >= 8 * 64 and c["ld.shared.v4.f32"] >= 8 * 4, (rung, c)
        # Launch bounds of two 256-thread blocks per SM: ptxas must fit a thread in 128 registers.
        assert c[".maxntid 256,"] == 1 and c[".minnctapersm 2"] == 1, (rung, c)
    assert counts["regtile"]["fma.rn.f32"] == 64  # rung 3 keeps its loop: the unrolling is rung 4's step
    # Rung 7's copies are cp.async (A's quad and B's, in the prologue and in the loop), each
    # k-step waits with one group left in flight, and nothing is in flight when the block ends;
    # no other rung has any.
    c = counts["async"]
    assert c["cp.async.cg.shared.global"] >= 2 and c["cp.async.commit_group"] >= 2, c
    assert c["cp.async.wait_group 1;"] == 1 and c["cp.async.wait_all"] == 1, c
    assert not any(counts[r]["cp.async.cg.shared.global"] for r in ("regtile", "wide", "warptile", "dbuf"))
    assert counts["wide-f16"]["ld.global.v4.u16"] >= 2  # 4 halves = one 64-bit load
    for name in ("fused_add_norm", "peer_reduce_norm", "gather_rows"):
        assert counts[name]["ld.global.v4.f32"] >= 1 and counts[name]["st.global.v4.f32"] >= 1, (name, counts[name])
    # Loads first (norm_cuda's docstring): the first arithmetic comes after the wide loads of
    # the thread's 8 cached quads of y (or source 0) and its 8 of the residual, so all of them
    # are in flight together.  Written quad by quad, an add followed every quad's two loads
    # (2 wide loads before the first add).
    for name in ("fused_add_norm", "peer_reduce_norm"):
        assert counts[name]["v4 loads before math"] >= 2 * 8, (name, counts[name])
    # ... and weight's cached quads are loaded before the reduction's first barrier (finish_row),
    # with y's, the residual's and bias's: 4 x 8 wide loads at least (27 when weight's came after).
    assert counts["fused_add_norm"]["v4 loads before bar.sync"] >= 4 * 8, counts["fused_add_norm"]
    spilled = {k: v for k, v in counts.items() if v["ld.local"] or v["st.local"]}
    assert not spilled, f"kernels with local-memory traffic: {spilled}"


# H = 64: the 128-bit path, the row in registers; 8200: a row longer than the register cache.
@pytest.mark.parametrize("H,norm", [(64, "rms"), (64, "layer"), (8200, "layer")])
def test_nan_propagates_on_the_wide_and_streamed_paths(device_backend, rng, H, norm):
    to, back = device_backend.asarray, device_backend.to_host
    rows = 2
    y = rng.standard_normal((rows, H)).astype(np.float32)
    w, b = rng.standard_normal(H).astype(np.float32), rng.standard_normal(H).astype(np.float32)
    y[1, H - 3] = np.nan  # in the last quad: on the streamed path for H = 8200
    if norm == "rms":
        host_out, _ = fused_add_rms_norm(y, None, w, 1e-5)
        out, _ = fused_add_rms_norm(to(y), None, to(w), 1e-5)
    else:
        host_out, _ = fused_add_layer_norm(y, None, w, b, 1e-5)
        out, _ = fused_add_layer_norm(to(y), None, to(w), to(b), 1e-5)
    out = back(out)
    assert np.isnan(out[1]).all() and np.isnan(host_out[1]).all()
    np.testing.assert_allclose(out[0], host_out[0], rtol=2e-5, atol=2e-6)


def test_peer_nan_on_the_wide_path(device_backend, rng):
    to, back = device_backend.asarray, device_backend.to_host
    R, H = 3, 64
    srcs = [rng.standard_normal((R, H)).astype(np.float32) for _ in range(2)]
    srcs[1][0, 5] = np.nan
    w = rng.standard_normal(H).astype(np.float32)
    out, new_res = to(np.full((R, H), 7.0, np.float32)), to(np.full((R, H), 7.0, np.float32))
    peer_reduce_norm([to(s) for s in srcs], None, None, to(w), None, 1e-6, out, new_res)
    out = back(out)
    assert np.isnan(out[0]).all() and np.isfinite(out[1:]).all()
