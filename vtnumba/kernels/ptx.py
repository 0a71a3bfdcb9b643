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
``--ptxas`` also registers, shared memory and spill bytes per kernel (``--only NAME ...``
limits the report to those kernels).  The exit status is 1 if a kernel failed to compile,
is unlisted, or (with ``--ptxas``) got no resource report.

**Resources as a launch links the kernel.**  Some kernels call functions that numba does not
compile into their PTX: float16 arithmetic, for one, is CUDA C++ from ``cuda_fp16.h``
that numba compiles with NVRTC and links in at the first launch.  The kernel's PTX alone
then declares an ``.extern .func`` that ``ptxas`` cannot resolve.  So the report compiles
the kernel *and every function it links* to LTO-IR (``cuda.compile_all``) and links them
with nvJitLink (``-lto -Xptxas=-v``), the library numba links with; its ``ptxas`` is the
one that matches NVVM, so no GPU, no toolkit and no PTX version juggling are needed
(``via: "nvJitLink"``).

Where nvJitLink cannot be loaded, a ``ptxas`` on PATH assembles the kernel's PTX instead
(``via: "ptxas"``).  NVVM writes a PTX ISA version matching its own release (NVVM 13.5
writes ``.version 9.5``) and an older ``ptxas`` refuses newer versions outright; the
kernels use no recent PTX features, so for the resource report only the ``.version`` line
is lowered to what that ``ptxas`` supports (``version_lowered``).  A kernel that links
other code gets an error naming the unresolved functions there, not numbers.
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


def compile_all(ccs=((8, 0), (9, 0)), only=None, resources: bool = False) -> list[dict]:
    """Compile every kernel signature for every cc; one result dict per (kernel, signature, cc).

    ``only``: kernel names to compile (default all); ``resources``: also put each compiled
    kernel's :func:`resource_usage` under ``"ptxas"``.
    """
    from vtnumba.backend.arrays import simulator_active

    if simulator_active():
        raise RuntimeError("compile_all needs the real numba.cuda: run with NUMBA_ENABLE_CUDASIM=0")
    results = []
    for name, kernel, sig in kernel_signatures():
        if only is not None and name not in only:
            continue
        for cc in ccs:
            entry = {"name": name, "sig": sig, "cc": f"{cc[0]}.{cc[1]}", "ok": False}
            try:
                ptx = compile_kernel_ptx(kernel, sig, cc)
                entry.update(ok=".entry" in ptx, ptx=ptx)
            except Exception as exc:  # noqa: BLE001 - reported, the caller decides
                entry["error"] = f"{type(exc).__name__}: {exc}"
            if resources and entry["ok"]:
                try:
                    entry["ptxas"] = resource_usage(kernel, sig, cc, ptx)
                except Exception as exc:  # noqa: BLE001 - reported like a compile error
                    entry["ptxas"] = {"arch": f"sm_{cc[0]}{cc[1]}", "error": f"{type(exc).__name__}: {exc}"}
            results.append(entry)
    return results


_RE_REG = re.compile(r"Used (\d+) registers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")
_RE_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_VERSION = re.compile(r"current version is '(\d+\.\d+)'")
_RE_EXTERN = re.compile(r"^\.extern \.func[^\n]*?(\w+)\s*\(", re.M)


def _read_ptxas_log(text: str) -> dict:
    """registers / smem_bytes / spill bytes from the lines ``ptxas -v`` writes for one kernel."""
    reg, smem, spill = _RE_REG.search(text), _RE_SMEM.search(text), _RE_SPILL.search(text)
    return {"registers": int(reg.group(1)) if reg else None, "smem_bytes": int(smem.group(1)) if smem else 0,
            "spill_store_bytes": int(spill.group(1)) if spill else None,
            "spill_load_bytes": int(spill.group(2)) if spill else None}


def nvjitlink_available() -> bool:
    """Whether nvJitLink (pip's ``nvidia-nvjitlink``, brought by ``numba-cuda[cu13]``) loads here."""
    try:
        from cuda.bindings import nvjitlink

        nvjitlink.version()
    except Exception:  # noqa: BLE001 - any failure to load means: not available
        return False
    return True


def linked_usage(kernel, sig: str, cc: tuple[int, int]) -> dict:
    """Registers / shared memory / spills of one kernel *linked as its launches link it*.

    The kernel and every function it links (``cuda.compile_all``: NVVM's LTO-IR for the
    kernel, NVRTC's for CUDA C++ such as ``cuda_fp16.h``'s operators) go to nvJitLink with
    ``-lto``, which optimizes across them -- the half-precision ``+`` is inlined into the
    loop as at launch -- and runs its own ``ptxas -v``.  ``modules`` says how many pieces
    were linked (1: the kernel alone).
    """
    from cuda.bindings import nvjitlink
    from numba import cuda

    opts = kernel.targetoptions
    arch = f"sm_{cc[0]}{cc[1]}"
    report = {"arch": arch, "via": "nvJitLink"}
    with _device_functions_for(cc):
        # abi="numba": a kernel's own calling convention (the C ABI is for device functions).
        codes, _ = cuda.compile_all(kernel.py_func, sig, device=False, abi="numba", cc=cc, output="ltoir",
                                    launch_bounds=opts.get("launch_bounds"), fastmath=opts.get("fastmath", False))
    kinds = {"ltoir": nvjitlink.InputType.LTOIR, "ptx": nvjitlink.InputType.PTX,
             "cubin": nvjitlink.InputType.CUBIN, "fatbin": nvjitlink.InputType.FATBIN}
    handle = nvjitlink.create(3, [f"-arch={arch}", "-lto", "-Xptxas=-v"])
    try:
        for i, code in enumerate(codes):
            data = getattr(code, "code", code)  # NVVM gives bytes; NVRTC a cuda.core ObjectCode
            kind = kinds[getattr(code, "code_type", "ltoir")]
            nvjitlink.add_data(handle, kind, data, len(data), f"module{i}")
        try:
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError:
            log = bytearray(nvjitlink.get_error_log_size(handle))
            nvjitlink.get_error_log(handle, log)
            report["error"] = log.decode(errors="replace").strip()[-500:] or "nvJitLink failed without a log"
            return report
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
    finally:
        nvjitlink.destroy(handle)
    report.update(modules=len(codes), **_read_ptxas_log(log.decode(errors="replace")))
    return report


def ptxas_usage(ptx: str, arch: str, ptxas: str | None = None) -> dict:
    """Run ``ptxas -v`` on one PTX module; returns registers / smem / spills (see module docstring).

    The fallback where nvJitLink cannot be loaded: it sees the kernel's PTX alone, so a
    kernel that links other code (``.extern .func``) gets an error naming those functions.
    """
    ptxas = ptxas or shutil.which("ptxas")
    if ptxas is None:
        raise FileNotFoundError("ptxas is not on PATH")
    report = {"arch": arch, "via": "ptxas", "version_lowered": None}
    externs = _RE_EXTERN.findall(ptx)
    if externs:
        report["error"] = (f"the kernel links {', '.join(externs)} at launch, which ptxas alone cannot "
                           "resolve: install nvidia-nvjitlink (numba-cuda[cu13]) for its linked resources")
        return report
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
    report.update(_read_ptxas_log(text))
    return report


def resource_usage(kernel, sig: str, cc: tuple[int, int], ptx: str) -> dict:
    """The kernel's resources by the best means here: nvJitLink, else ``ptxas`` on ``ptx``."""
    if nvjitlink_available():
        return linked_usage(kernel, sig, cc)
    return ptxas_usage(ptx, f"sm_{cc[0]}{cc[1]}")


def main(argv=None) -> int:
    """``python -m vtnumba.kernels.ptx``: print the compile report as JSON; 1 if anything failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", nargs="+", default=["80", "90"], help="compute capabilities, e.g. 80 90")
    parser.add_argument("--ptxas", action="store_true",
                        help="also report registers, shared memory and spills (nvJitLink, else ptxas on PATH)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="report only these kernels (default: all)")
    parser.add_argument("--keep-ptx", action="store_true", help="include the PTX text in the output")
    args = parser.parse_args(argv)
    ccs = []
    for c in args.cc:
        if not (c.isdigit() and len(c) >= 2):
            parser.error(f"--cc: {c!r} is not a compute capability written as digits, e.g. 80 or 90")
        ccs.append((int(c[:-1]), int(c[-1])))
    if args.only:
        known = {name for name, _, _ in kernel_signatures()}
        unknown = sorted(set(args.only) - known)
        if unknown:
            parser.error(f"--only: no kernel named {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    results = compile_all(ccs, only=args.only, resources=args.ptxas)
    for entry in results:
        if not args.keep_ptx:
            entry.pop("ptx", None)
    unlisted = unlisted_kernels()
    via = "nvJitLink" if nvjitlink_available() else "ptxas" if shutil.which("ptxas") else None
    json.dump({"results": results, "unlisted": unlisted, "resources_via": via}, sys.stdout)
    failed = any(not e["ok"] or "error" in e.get("ptxas", {}) for e in results)
    return 1 if failed or unlisted else 0


if __name__ == "__main__":
    sys.exit(main())
