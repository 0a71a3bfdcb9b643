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
limits the report to those kernels); with ``--sass`` also where the spills land
(:func:`read_sass`: spill instructions in the machine code, in loops and in the main loop).
The exit status is 1 if a kernel failed to compile, is unlisted, or got no resource or
SASS report it was asked for.

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
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types


#: The modules whose kernels the report covers (their PTX_SIGNATURES); one lives outside
#: ``vtnumba/kernels``, and :func:`kernel_source_files` must know of it too.
CUDA_MODULES = ("vtnumba.kernels.matmul_cuda", "vtnumba.kernels.norm_cuda", "vtnumba.kernels.peer_cuda",
                "vtnumba.kernels.reduce_cuda", "vtnumba.kernels.activation_cuda", "vtnumba.kernels.attention_cuda",
                "vtnumba.backend.cuda_flags")


def _cuda_modules():
    return [importlib.import_module(name) for name in CUDA_MODULES]


def kernel_source_files() -> list[str]:
    """Every source file the reported kernels are built from: the modules of :data:`CUDA_MODULES`
    and every module of ``vtnumba/kernels`` (where their device functions live) -- found
    without importing them (importing ``numba.cuda`` here would fix the target of the caller's
    process).  What a cache of the report must be keyed by."""
    import importlib.util

    folder = os.path.dirname(os.path.abspath(__file__))
    files = {os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".py")}
    files.update(importlib.util.find_spec(name).origin for name in CUDA_MODULES)
    return sorted(files)


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


def compile_all(ccs=((8, 0), (9, 0)), only=None, resources: bool = False, nvdisasm: str | None = None,
                keep_sass: bool = False) -> list[dict]:
    """Compile every kernel signature for every cc; one result dict per (kernel, signature, cc).

    ``only``: kernel names to compile (default all); ``resources``: also put each compiled
    kernel's :func:`resource_usage` under ``"ptxas"``; ``nvdisasm``: also put its
    :func:`sass_report` under ``"sass"`` (``keep_sass``: with the disassembly's text).
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
            cubin = None  # the linked machine code, when the resource report made it anyway
            if resources and entry["ok"]:
                try:
                    entry["ptxas"] = resource_usage(kernel, sig, cc, ptx, keep_cubin=bool(nvdisasm))
                    cubin = entry["ptxas"].pop("cubin", None)
                except Exception as exc:  # noqa: BLE001 - reported like a compile error
                    entry["ptxas"] = {"arch": f"sm_{cc[0]}{cc[1]}", "error": f"{type(exc).__name__}: {exc}"}
            if nvdisasm and entry["ok"]:
                try:
                    entry["sass"] = sass_report(kernel, sig, cc, nvdisasm, keep_text=keep_sass, cubin=cubin)
                except Exception as exc:  # noqa: BLE001 - reported like a compile error
                    entry["sass"] = {"arch": f"sm_{cc[0]}{cc[1]}", "error": f"{type(exc).__name__}: {exc}"}
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


def linked_usage(kernel, sig: str, cc: tuple[int, int], keep_cubin: bool = False) -> dict:
    """Registers / shared memory / spills of one kernel *linked as its launches link it*.

    The kernel and every function it links (``cuda.compile_all``: NVVM's LTO-IR for the
    kernel, NVRTC's for CUDA C++ such as ``cuda_fp16.h``'s operators) go to nvJitLink with
    ``-lto``, which optimizes across them -- the half-precision ``+`` is inlined into the
    loop as at launch -- and runs its own ``ptxas -v``.  ``modules`` says how many pieces
    were linked (1: the kernel alone).  ``keep_cubin``: also return the linked machine code
    (bytes) under ``"cubin"``, for :func:`disassemble`.
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
        if keep_cubin:
            cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
            nvjitlink.get_linked_cubin(handle, cubin)
            report["cubin"] = bytes(cubin)
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


# ---------------------------------------------------------------------------- where the spills land
def find_nvdisasm() -> str | None:
    """``nvdisasm`` (the CUDA disassembler): from pip's ``nvidia-cuda-nvdisasm`` wheel (the test
    extra installs it: ``nvidia/cu13/bin``, or ``nvidia/cuda_nvdisasm/bin`` for CUDA 12's wheel),
    which matches the pip nvJitLink that links the cubins -- an older toolkit's ``nvdisasm`` may
    not read them -- else one on PATH.  None if neither is there."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cuda_nvdisasm"):
            path = os.path.join(root, sub, "bin", "nvdisasm")
            if os.access(path, os.X_OK):
                return path
    return shutil.which("nvdisasm")


def disassemble(cubin: bytes, nvdisasm: str) -> str:
    """The SASS (the GPU's own instructions) of a linked cubin, as ``nvdisasm -c`` prints it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        proc = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {(proc.stderr or proc.stdout).strip()[-500:]}")
    return proc.stdout


_RE_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);(.*)$")
_RE_LABEL = re.compile(r"^(\.L_x_\d+):")
_RE_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_FMA_OPS = ("FFMA", "HFMA2", "DFMA")


def read_sass(text: str) -> dict:
    """Where a kernel's spills land, from its SASS.

    ``ptxas -v`` gives only the spilled *bytes*.  What a spill costs depends on where its
    instructions sit: a register parked in local memory once, before the main loop, and
    reloaded once per k-step beside hundreds of FMAs costs little; a reload inside the FMA
    run costs a lot.  nvdisasm marks spill traffic (``SpillRefill``; other local-memory
    traffic is a ``cuda.local.array`` the compiler could not keep in registers), and a branch
    to an earlier address closes a loop.  Returned: ``instructions``; ``fma`` (FFMA/HFMA2/
    DFMA); ``spill_stores`` / ``spill_loads`` (instructions); ``loops``; ``spills_in_loops``;
    and ``hot_loop``, the main loop -- the smallest loop holding at least 90 % of the most FMAs
    any loop holds (without FMAs in any loop, the one with the most instructions) -- with its addresses,
    ``instructions``, ``fma`` and ``spill_loads``/``spill_stores``: the spill traffic the
    kernel pays on every turn of its main loop.
    """
    instrs = []                 # (address, opcode, is_spill)
    labels: dict[str, int] = {}
    branches = []               # (address, label)
    pending: list[str] = []     # labels waiting for the next instruction's address
    base = 0                    # each function's addresses start at 0: lay them end to end
    for line in text.splitlines():
        if line.startswith(".text.") and line.rstrip().endswith(":") and instrs:
            base = instrs[-1][0] + 0x10  # (a callee the linker did not inline)
            continue
        m = _RE_LABEL.match(line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = _RE_INSTR.match(line)
        if not m:
            continue
        addr, op, operands, rest = base + int(m.group(1), 16), m.group(2), m.group(3), m.group(4)
        for lab in pending:
            labels[lab] = addr
        pending = []
        instrs.append((addr, op, "SpillRefill" in operands + rest))
        t = _RE_TARGET.search(operands)
        if op.startswith("BRA") and t:
            branches.append((addr, t.group(1)))
    # (A branch to itself is no loop: it is the trap ptxas puts after the last EXIT.)
    loops = sorted({(labels[lab], addr) for addr, lab in branches if lab in labels and labels[lab] < addr})

    def tally(lo: int, hi: int) -> dict:
        part = [(op, spill) for a, op, spill in instrs if lo <= a <= hi]
        return {"instructions": len(part), "fma": sum(op.split(".")[0] in _FMA_OPS for op, _ in part),
                "spill_stores": sum(spill and op.startswith("STL") for op, spill in part),
                "spill_loads": sum(spill and op.startswith("LDL") for op, spill in part)}

    whole = tally(0, instrs[-1][0]) if instrs else tally(0, -1)
    in_loops = sum(spill and any(lo <= a <= hi for lo, hi in loops) for a, _, spill in instrs)
    tallies = [(lo, hi, tally(lo, hi)) for lo, hi in loops]
    most = max((t["fma"] for _, _, t in tallies), default=0)
    if most:
        # The smallest loop that holds (nearly) all of the most FMAs any loop has: an outer loop
        # around it, with a few FMAs of its own, is not the one a turn of the math repeats.
        candidates = [(t["instructions"], lo, hi, t) for lo, hi, t in tallies if t["fma"] >= 0.9 * most]
    else:  # a kernel without FMA loops (a memory-bound one): the largest loop
        candidates = [(-t["instructions"], lo, hi, t) for lo, hi, t in tallies]
    hot = None
    if candidates:
        _, lo, hi, t = min(candidates, key=lambda c: c[0])
        hot = {**t, "start": f"{lo:#06x}", "end": f"{hi:#06x}"}
    return {**whole, "loops": len(loops), "spills_in_loops": in_loops, "hot_loop": hot}


def sass_report(kernel, sig: str, cc: tuple[int, int], nvdisasm: str, keep_text: bool = False,
                cubin: bytes | None = None) -> dict:
    """:func:`read_sass` of one kernel linked as its launches link it (nvJitLink, then nvdisasm;
    ``cubin``: that linked code, if the caller has it already)."""
    arch = f"sm_{cc[0]}{cc[1]}"
    if cubin is None:
        linked = linked_usage(kernel, sig, cc, keep_cubin=True)
        if "error" in linked:
            return {"arch": arch, "error": linked["error"]}
        cubin = linked["cubin"]
    text = disassemble(cubin, nvdisasm)
    report = {"arch": arch, **read_sass(text)}
    if keep_text:
        report["text"] = text
    return report


def resource_usage(kernel, sig: str, cc: tuple[int, int], ptx: str, keep_cubin: bool = False) -> dict:
    """The kernel's resources by the best means here: nvJitLink (``keep_cubin``: with the linked
    code), else ``ptxas`` on ``ptx``."""
    if nvjitlink_available():
        return linked_usage(kernel, sig, cc, keep_cubin=keep_cubin)
    return ptxas_usage(ptx, f"sm_{cc[0]}{cc[1]}")


def main(argv=None) -> int:
    """``python -m vtnumba.kernels.ptx``: print the compile report as JSON; 1 if anything failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", nargs="+", default=["80", "90"], help="compute capabilities, e.g. 80 90")
    parser.add_argument("--ptxas", action="store_true",
                        help="also report registers, shared memory and spills (nvJitLink, else ptxas on PATH)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="report only these kernels (default: all)")
    parser.add_argument("--keep-ptx", action="store_true", help="include the PTX text in the output")
    parser.add_argument("--sass", action="store_true",
                        help="also say where the spills land: count spill instructions in the machine code, in "
                             "loops and in the main loop, the one the FMAs repeat in (nvJitLink and nvdisasm)")
    parser.add_argument("--keep-sass", action="store_true", help="with --sass: include the SASS text in the output")
    args = parser.parse_args(argv)
    nvdisasm = None
    if args.keep_sass and not args.sass:
        parser.error("--keep-sass: only with --sass")
    if args.sass:
        if not nvjitlink_available():
            parser.error("--sass: nvJitLink cannot be loaded here (pip install 'numba-cuda[cu13]')")
        nvdisasm = find_nvdisasm()
        if nvdisasm is None:
            parser.error("--sass: nvdisasm is neither on PATH nor installed from pip "
                         "(pip install nvidia-cuda-nvdisasm; the test extra includes it)")
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
    results = compile_all(ccs, only=args.only, resources=args.ptxas, nvdisasm=nvdisasm, keep_sass=args.keep_sass)
    for entry in results:
        if not args.keep_ptx:
            entry.pop("ptx", None)
    unlisted = unlisted_kernels()
    via = "nvJitLink" if nvjitlink_available() else "ptxas" if shutil.which("ptxas") else None
    json.dump({"results": results, "unlisted": unlisted, "resources_via": via}, sys.stdout)
    failed = any(not e["ok"] or "error" in e.get("ptxas", {}) or "error" in e.get("sass", {}) for e in results)
    return 1 if failed or unlisted else 0


if __name__ == "__main__":
    sys.exit(main())
