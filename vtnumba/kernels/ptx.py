"""Compile every ``@cuda.jit`` kernel to PTX without a GPU, and read ``ptxas`` resource usage.

numba's simulator type-checks nothing: a kernel that mixes float64 into a float32 loop,
or indexes a tuple wrongly, runs happily there and fails on a GPU.  ``cuda.compile_ptx``
runs the real front end (typing, lowering, NVVM) for a given compute capability with no
GPU present (NVVM comes from pip with ``numba-cuda[cu13]``), so compiling each kernel for
sm_80 and sm_90 catches those errors on any machine.

It needs the real ``numba.cuda`` -- i.e. ``NUMBA_ENABLE_CUDASIM=0`` -- so the tests (which run
with the simulator on) call it in a subprocess::

    NUMBA_ENABLE_CUDASIM=0 python -m vtnumba.kernels.ptx --cc 80 90 [--ptxas]

which prints one JSON document: per kernel, signature and cc, whether it compiled (and
the error if not), and any kernel missing from the modules' ``PTX_SIGNATURES``; with
``--ptxas`` and a ``ptxas`` on PATH also registers, shared memory and spill bytes per
kernel.

**PTX version.**  NVVM writes a PTX ISA version matching its own release (NVVM 13.5 writes
``.version 9.5``); an older ``ptxas`` refuses newer versions outright.  The kernels use no
recent PTX features, so for the *resource report only* we lower the ``.version`` line to
what that ``ptxas`` says it supports, and say so in the result (``version_lowered``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types


def _cuda_modules():
    from vtnumba.backend import cuda_flags
    from vtnumba.kernels import activation_cuda, attention_cuda, matmul_cuda, norm_cuda, peer_cuda, reduce_cuda

    return [matmul_cuda, norm_cuda, peer_cuda, reduce_cuda, activation_cuda, attention_cuda, cuda_flags]


def kernel_signatures() -> list[tuple[str, object, str]]:
    """(name, kernel, signature) for every kernel in the package, from each module's PTX_SIGNATURES."""
    return [entry for mod in _cuda_modules() for entry in mod.PTX_SIGNATURES]


def unlisted_kernels() -> list[str]:
    """Kernels (not device functions) defined in the CUDA modules but missing from PTX_SIGNATURES.

    Keeps the compile check honest: a new kernel cannot silently escape it.
    """
    from numba.cuda.dispatcher import CUDADispatcher

    listed = {id(kernel) for _, kernel, _ in kernel_signatures()}
    missing = []
    for mod in _cuda_modules():
        for attr, obj in vars(mod).items():
            if isinstance(obj, CUDADispatcher) and not obj.targetoptions.get("device") and id(obj) not in listed:
                missing.append(f"{mod.__name__}.{attr}")
    return missing


@contextlib.contextmanager
def _device_functions_for(cc):
    """Let device-function callees compile without a GPU.

    numba-cuda compiles the ``@cuda.jit(device=True)`` functions a kernel calls for the
    *current device's* compute capability (``dispatcher.get_current_device()``), which needs
    a driver even inside ``compile_ptx``.  With no GPU present we answer that question with
    the capability being compiled for; with a GPU nothing is changed.
    """
    from numba import cuda
    from numba.cuda import dispatcher

    if cuda.is_available():
        yield
        return
    real = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = real


def compile_kernel_ptx(kernel, sig: str, cc: tuple[int, int]) -> str:
    """The PTX of one ``@cuda.jit`` kernel for ``sig`` and ``cc``, compiled as its launches are.

    ``cuda.compile_ptx`` compiles the Python function afresh and knows nothing of the options
    given to the decorator; the ones that change the PTX are passed on here -- the launch
    bounds (``.maxntid``/``.minnctapersm``, which set the registers ptxas may use) and
    ``fastmath``.
    """
    from numba import cuda

    opts = kernel.targetoptions
    with _device_functions_for(cc):
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=cc, launch_bounds=opts.get("launch_bounds"),
                                  fastmath=opts.get("fastmath", False))
    return ptx


def compile_all(ccs=((8, 0), (9, 0))) -> list[dict]:
    """Compile every kernel signature for every cc; one result dict per (kernel, signature, cc)."""
    from vtnumba.backend.arrays import simulator_active

    if simulator_active():
        raise RuntimeError("compile_all needs the real numba.cuda: run with NUMBA_ENABLE_CUDASIM=0")
    results = []
    for name, kernel, sig in kernel_signatures():
        for cc in ccs:
            entry = {"name": name, "sig": sig, "cc": f"{cc[0]}.{cc[1]}", "ok": False}
            try:
                ptx = compile_kernel_ptx(kernel, sig, cc)
                entry.update(ok=".entry" in ptx, ptx=ptx)
            except Exception as exc:  # noqa: BLE001 - reported, the caller decides
                entry["error"] = f"{type(exc).__name__}: {exc}"
            results.append(entry)
    return results


_RE_REG = re.compile(r"Used (\d+) registers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")
_RE_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_VERSION = re.compile(r"current version is '(\d+\.\d+)'")


def ptxas_usage(ptx: str, arch: str, ptxas: str | None = None) -> dict:
    """Run ``ptxas -v`` on one PTX module; returns registers / smem / spills (see module docstring)."""
    ptxas = ptxas or shutil.which("ptxas")
    if ptxas is None:
        raise FileNotFoundError("ptxas is not on PATH")
    report = {"arch": arch, "version_lowered": None}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        for _attempt in range(2):
            with open(path, "w") as f:
                f.write(ptx)
            proc = subprocess.run([ptxas, f"-arch={arch}", "-v", path, "-o", os.devnull],
                                  capture_output=True, text=True, timeout=120)
            text = proc.stdout + proc.stderr
            m = _RE_VERSION.search(text)
            if proc.returncode != 0 and m and report["version_lowered"] is None:
                report["version_lowered"] = m.group(1)
                ptx = re.sub(r"^\.version \d+\.\d+", f".version {m.group(1)}", ptx, count=1, flags=re.M)
                continue
            break
    if proc.returncode != 0:
        report["error"] = text.strip()[-500:]
        return report
    reg, smem, spill = _RE_REG.search(text), _RE_SMEM.search(text), _RE_SPILL.search(text)
    report.update(registers=int(reg.group(1)) if reg else None, smem_bytes=int(smem.group(1)) if smem else 0,
                  spill_store_bytes=int(spill.group(1)) if spill else None,
                  spill_load_bytes=int(spill.group(2)) if spill else None)
    return report


def main(argv=None) -> int:
    """``python -m vtnumba.kernels.ptx``: print the compile report as JSON; 1 if any kernel failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", nargs="+", default=["80", "90"], help="compute capabilities, e.g. 80 90")
    parser.add_argument("--ptxas", action="store_true", help="also report ptxas resource usage")
    parser.add_argument("--keep-ptx", action="store_true", help="include the PTX text in the output")
    args = parser.parse_args(argv)
    ccs = [(int(c[:-1]), int(c[-1])) for c in args.cc]
    results = compile_all(ccs)
    have_ptxas = shutil.which("ptxas") is not None
    for entry in results:
        if args.ptxas and have_ptxas and entry["ok"]:
            entry["ptxas"] = ptxas_usage(entry["ptx"], "sm_" + entry["cc"].replace(".", ""))
        if not args.keep_ptx:
            entry.pop("ptx", None)
    unlisted = unlisted_kernels()
    json.dump({"results": results, "unlisted": unlisted, "ptxas_available": have_ptxas}, sys.stdout)
    return 0 if all(e["ok"] for e in results) and not unlisted else 1


if __name__ == "__main__":
    sys.exit(main())
