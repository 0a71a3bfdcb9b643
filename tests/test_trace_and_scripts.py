"""Tracing (per-rank files, merge, validation, PNG), the bench schema, and gpu_check's dry run."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ON_GPU

from vtnumba import trace
from vtnumba.apps.trace_tools import (
    draw_timeline,
    find_arrows,
    first_call_outliers,
    kind_of,
    merge_trace_data,
    rank_files,
    validate_trace,
)
from vtnumba.bench.schema import row, suite, validate_all, validate_suite
from vtnumba.bench.timing import Stats

ROOT = Path(__file__).resolve().parent.parent
# The mpiexec that belongs to this interpreter's MPI (the mpich wheel puts it beside python),
# so the tests also run when the venv's bin/ is not on PATH.
_BESIDE = Path(sys.executable).parent / "mpiexec"
MPIEXEC = str(_BESIDE) if _BESIDE.exists() else "mpiexec"


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}
    env.update(extra)
    return env


def test_recorder_spans_and_queue_ops(tmp_path):
    from vtnumba import CPUBackend

    rec = trace.enable(str(tmp_path / "t"), rank=0)
    try:
        b = CPUBackend(threaded=True)
        q = b.create_queue("work")
        buf = b.alloc(1 << 16)
        b.memset(q, buf, 1)
        b.copy(q, buf, __import__("numpy").ones(1 << 16, "uint8"), 1 << 16)
        with trace.span("exchange", "mpi", "mpi:test", bytes=3):
            pass
        b.synchronize(q)
        path = trace.flush()
    finally:
        trace.disable()
    data = json.loads(Path(path).read_text())
    names = [e["name"] for e in data["traceEvents"] if e["ph"] == "X"]
    queue_ops = [e["name"] for e in data["traceEvents"] if e["ph"] == "X" and e["track"] == "cpu:work"]
    assert queue_ops == ["memset", "copy"] and "exchange" in names and "synchronize" in names
    validate_trace(data)
    assert rec.rank == 0 and path.endswith(".rank0.json")


def _x(name, pid, tid, ts, dur, cat="queue", **args):
    ev = {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": float(ts), "dur": float(dur), "cat": cat}
    if args:
        ev["args"] = args
    return ev


def test_timeline_kinds_arrows_and_first_calls(tmp_path):
    """Copies, kernels and waits are told apart; record -> wait and flow arrows; a compiling first call."""
    assert [kind_of(_x(n, 0, 1, 0, 1)) for n in ("copy", "memset", "fused_add_rms_norm", "wait_event",
                                                 "wait_value32", "record_event", "write_value32")] == \
        ["copy", "copy", "kernel", "wait", "wait", "record", "signal"]
    assert kind_of(_x("synchronize", 0, 9, 0, 1, cat="host")) == "wait"
    assert kind_of(_x("allgather", 0, 9, 0, 1, cat="mpi")) == "mpi"
    assert kind_of(_x("tpsp pipeline", 0, 9, 0, 1, cat="tpsp")) == "call"
    spans = [
        _x("record_event", 0, 1, 10, 1, event=7),     # an earlier recording of event 7
        _x("record_event", 0, 1, 50, 1, event=7),     # the one that released the wait below
        _x("wait_event", 0, 2, 5, 46.5, event=7),     # queued early, released at 51.5
        _x("wait_event", 1, 2, 5, 46.5, event=7),     # another rank: event ids are per process
        _x("set flag", 0, 3, 60, 1, cat="peer", flow_out="mail:1:2"),
        _x("wait for flag", 1, 3, 0, 61.5, cat="peer", flow_in="mail:1:2"),
    ]
    arrows = [(a["name"], a["ts"], b["name"], b["pid"]) for a, b in find_arrows(spans)]
    assert arrows == [("record_event", 50.0, "wait_event", 0), ("set flag", 60.0, "wait for flag", 1)]
    calls = [_x("matmul", 0, 4, 0, 900_000), _x("matmul", 0, 4, 1e6, 1000), _x("matmul", 0, 4, 2e6, 1100)]
    assert first_call_outliers(calls) == {0}
    assert first_call_outliers(calls[1:]) == set(), "two calls are too few to call one an outlier"
    merged = merge_trace_data([{"traceEvents": spans + calls, "otherData": {"rank": 0}}])
    flows = [e for e in merged["traceEvents"] if e["ph"] in ("s", "f")]
    assert len(flows) == 4 and {e["id"] for e in flows} == {0, 1}, "each arrow is a Chrome flow for Perfetto"
    validate_trace(merged)
    for mode in ("label", "drop", "keep"):
        png = draw_timeline(merged, str(tmp_path / f"t-{mode}.png"), first_calls=mode, labels=True)
        assert Path(png).read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="first_calls="):
        draw_timeline(merged, str(tmp_path / "bad.png"), first_calls="hide")


def test_recording_block_restores_the_previous_recorder(tmp_path):
    from vtnumba import CPUBackend

    outer = trace.enable(str(tmp_path / "outer"), rank=0)
    try:
        b = CPUBackend(threaded=True)
        q = b.create_queue("work")
        e = b.create_event()
        with trace.recording(rank=3) as rec:
            b.record_event(e, q)
            b.queue_wait_event(q, e)
            b.synchronize(q)
        assert trace.RECORDER is outer
        data = rec.to_json()
        names = [ev["name"] for ev in data["traceEvents"] if ev["ph"] == "X"]
        assert {"record_event", "wait_event", "synchronize"} <= set(names)
        assert all(ev["pid"] == 3 for ev in data["traceEvents"] if ev["ph"] == "X")
        assert not outer.events, "the block's operations went to the block's recorder only"
        assert find_arrows([ev for ev in data["traceEvents"] if ev["ph"] == "X"])
        b.close()
    finally:
        trace.disable()


def test_tracing_off_records_nothing():
    assert trace.RECORDER is None
    with trace.span("x", "mpi", "t"):
        pass
    trace.record("y", "queue", "t", 0, 1)
    assert trace.RECORDER is None


def test_validate_trace_catches_overlap_on_one_queue():
    evs = [{"name": "a", "ph": "X", "pid": 0, "tid": 1, "ts": 0.0, "dur": 10.0, "cat": "queue"},
           {"name": "b", "ph": "X", "pid": 0, "tid": 1, "ts": 5.0, "dur": 1.0, "cat": "queue"}]
    with pytest.raises(ValueError, match="b starts before a ended"):
        validate_trace({"traceEvents": evs})
    with pytest.raises(ValueError, match="lacks 'pid'"):
        validate_trace({"traceEvents": [{"name": "a", "ph": "X", "tid": 1}]})
    for bad in ({"dur": -1.0, "ts": 0.0}, {"dur": 1.0}):
        with pytest.raises(ValueError, match=r"traceEvents\[0\] \(a\) lacks 'ts' or 'dur', or has a negative 'dur'"):
            validate_trace({"traceEvents": [{"name": "a", "ph": "X", "pid": 0, "tid": 1, **bad}]})
    late = {"name": "c", "ph": "X", "pid": 0, "tid": 1, "ts": 20.0, "dur": 1.0, "cat": "queue"}
    validate_trace({"traceEvents": [late, evs[0]]})  # listed out of order, not overlapping: fine


def test_traced_two_rank_run_merges_and_draws(tmp_path):
    prefix = tmp_path / "rt"
    proc = subprocess.run([sys.executable, "-m", "vtnumba", "trace", "--out", str(prefix), "--", MPIEXEC, "-n", "2",
                           sys.executable, "-m", "vtnumba", "demo", "runtime", "--target", "cpu"],
                          capture_output=True, text=True, env=clean_env(), timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(rank_files(str(prefix))) == 2
    merged = json.loads((tmp_path / "rt.json").read_text())
    validate_trace(merged)
    pids = {e["pid"] for e in merged["traceEvents"] if e["ph"] == "X"}
    assert pids == {0, 1}
    tracks = {e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "thread_name"}
    assert {"cpu:copy", "cpu:compute"} <= tracks
    # Queue order is kept: on the copy queue, the copy comes after the gate it waited for.
    copy_q = [e["name"] for e in sorted(merged["traceEvents"], key=lambda e: e.get("ts", 0))
              if e["ph"] == "X" and e["pid"] == 0 and e["track"] == "cpu:copy"]
    assert copy_q.index("gate") < copy_q.index("copy")
    png = tmp_path / "rt.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"


def test_trace_without_command_is_an_error():
    proc = subprocess.run([sys.executable, "-m", "vtnumba", "trace"], capture_output=True, text=True, env=clean_env())
    assert proc.returncode == 2 and "needs a command" in proc.stderr


def test_trace_out_must_be_a_prefix_not_a_folder(tmp_path):
    # A folder ran the whole command, and then blamed it for writing no trace files.
    for out in (str(tmp_path), str(tmp_path) + "/"):
        proc = subprocess.run([sys.executable, "-m", "vtnumba", "trace", "--out", out, "--", sys.executable, "-c",
                               "print('ran')"], capture_output=True, text=True, env=clean_env(), timeout=60)
        assert proc.returncode == 2 and "ran" not in proc.stdout, proc.stdout + proc.stderr
        assert "is a folder; --out is a file name prefix" in proc.stderr, proc.stderr


def test_trace_of_a_command_that_records_nothing_says_so(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "vtnumba", "trace", "--out", str(tmp_path / "t"), "--",
                           sys.executable, "-c", "print('no vtnumba here')"], capture_output=True, text=True,
                          env=clean_env(), timeout=60)
    assert proc.returncode == 1 and "no vtnumba here" in proc.stdout
    assert proc.stderr.startswith("vtnumba trace: no trace files") and "Traceback" not in proc.stderr, proc.stderr


def test_trace_of_a_failing_command_gives_its_status_and_leaves_no_stale_picture(tmp_path):
    # A command killed by SIGKILL made trace exit 247 (256 - 9), not the shell's 137; and the
    # previous run's merged trace and picture stayed beside the failed run, looking current.
    (tmp_path / "t.json").write_text("{}")
    (tmp_path / "t.png").write_bytes(b"old")
    proc = subprocess.run([sys.executable, "-m", "vtnumba", "trace", "--out", str(tmp_path / "t"), "--",
                           sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                          capture_output=True, text=True, env=clean_env(), timeout=60)
    assert proc.returncode == 137 and "the command was killed by signal 9" in proc.stderr, proc.stderr
    assert not (tmp_path / "t.json").exists() and not (tmp_path / "t.png").exists()
    failed = subprocess.run([sys.executable, "-m", "vtnumba", "trace", "--out", str(tmp_path / "t"), "--",
                             sys.executable, "-c", "raise SystemExit(3)"], capture_output=True, text=True,
                            env=clean_env(), timeout=60)
    assert failed.returncode == 3 and "the command exited with 3" in failed.stderr


def test_trace_says_what_is_wrong_with_what_was_recorded_never_a_traceback(tmp_path):
    # Each of these ended in a Python traceback: a command that queued nothing, a stray file
    # matching the rank-file pattern, rank files that are not traces.  And --out x.json wrote
    # x.rank0.json beside x.json.json.
    def trace(out, *cmd):
        return subprocess.run([sys.executable, "-m", "vtnumba", "trace", "--out", str(out), "--", *cmd],
                              capture_output=True, text=True, env=clean_env(), timeout=120)

    empty = trace(tmp_path / "e.json", sys.executable, "-c", "import vtnumba.trace")  # a rank file, no operation
    assert empty.returncode == 1 and "Traceback" not in empty.stderr, empty.stderr
    assert "rank file(s) hold no operations" in empty.stderr, empty.stderr
    assert rank_files(str(tmp_path / "e")) == [str(tmp_path / "e.rank0.json")]  # (--out e.json: prefix e)
    (tmp_path / "s.rankold.json").write_text("{}")  # not a rank's file: ignored, and left alone
    (tmp_path / "s.rank0.json").write_text("not json")  # an old run's: removed before the command runs
    stray = trace(tmp_path / "s", sys.executable, "-c", "pass")
    assert stray.returncode == 1 and stray.stderr.startswith("vtnumba trace: no trace files"), stray.stderr
    assert (tmp_path / "s.rankold.json").exists() and not (tmp_path / "s.rank0.json").exists()
    writes_junk = f"open({str(tmp_path / 'j.rank0.json')!r}, 'w').write('[1, 2]')"
    junk = trace(tmp_path / "j", sys.executable, "-c", writes_junk)
    assert junk.returncode == 1 and "j.rank0.json is not a trace file (no 'traceEvents' list)" in junk.stderr, \
        junk.stderr
    assert rank_files(str(tmp_path / "s")) == []
    assert rank_files(str(tmp_path / "j.json")) == [str(tmp_path / "j.rank0.json")]


def test_bench_schema_validation():
    st = Stats(0.01, 0.009, 0.012, 10)
    s = suite("x", "cpu", 1, [row("c", "impl", 1024, "bytes", "GB/s", 1.5, st)], {"a / b": 2.0}, {"memcpy GB/s": 20})
    validate_suite(s)
    validate_all({"machine": {}, "suites": [s]})
    bad = dict(s, results=[{"case": "c"}])
    with pytest.raises(ValueError, match="field 'impl'"):
        validate_suite(bad)
    with pytest.raises(ValueError, match="lacks 'ratios'"):
        validate_suite({k: v for k, v in s.items() if k != "ratios"})
    # (None, a string row, suites=5, machine=5 were Python's own TypeErrors, or passed)
    with pytest.raises(ValueError, match="a suite result should be a dict, got NoneType"):
        validate_suite(None)
    with pytest.raises(ValueError, match=r"results\[0\] should be a dict \(one row\), got str"):
        validate_suite(dict(s, results=["row"]))
    with pytest.raises(ValueError, match="field 'suites' should be a list, got int"):
        validate_all({"machine": {}, "suites": 5})
    with pytest.raises(ValueError, match="field 'machine' should be a dict, got int"):
        validate_all({"machine": 5, "suites": [s]})


GPU_RESULT_FILES = {"0-summary.txt", "1-info.txt", "2-serial-tests.log", "3-mpi-tests.log", "4-benchmarks.log",
                    "5-bench.json", "6-sanitizer.log", "7-setup.log"}


@pytest.mark.skipif(ON_GPU, reason="the dry run is for machines without a GPU")
def test_gpu_check_dry_run_without_gpu(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          env=clean_env(OUT=str(tmp_path), PYTHON=sys.executable), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no GPU" in proc.stdout
    summary = (tmp_path / "0-summary.txt").read_text().splitlines()
    assert summary[0].startswith("no GPU: ") and "(dry run)" in summary[0], summary
    assert any(line.startswith("setup ") for line in summary), summary
    setup_log = (tmp_path / "7-setup.log").read_text()
    assert "wheel list: gpu_wheels.sh pins all" in setup_log, setup_log
    produced = {p.name for p in tmp_path.iterdir()}
    assert produced <= GPU_RESULT_FILES and len(produced) <= 8, produced


@pytest.mark.skipif(ON_GPU, reason="the dry run is for machines without a GPU")
def test_gpu_check_without_venv_or_wheels_tries_the_machines_python(tmp_path):
    # A checkout shipped to a GPU machine without .venv/ and without .whl/: the machine's
    # Python is tried as it is, and the import check decides (here it has everything).
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    for name in ("gpu_check.sh", "gpu_wheels.sh"):
        shutil.copy(ROOT / "scripts" / name, checkout / "scripts" / name)
    (checkout / "vtnumba").symlink_to(ROOT / "vtnumba")
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(checkout / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          env=clean_env(OUT=str(out), PYTHON=sys.executable, GPU_CHECK_VENV=str(tmp_path / "venv")),
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    setup_log = (out / "7-setup.log").read_text()
    assert f"not every carried wheel is in .whl/ -- trying {sys.executable} as it is" in setup_log, setup_log
    setup = next(line for line in (out / "0-summary.txt").read_text().splitlines() if line.startswith("setup "))
    assert " ok " in setup and "numba-cuda" in setup, setup
    # A Python without numba: the setup line fails and says why (still a dry run here: no GPU).
    bare = shutil.which("python3", path="/usr/bin:/bin")
    if bare and subprocess.run([bare, "-c", "import numba"], capture_output=True).returncode != 0:
        proc = subprocess.run(["bash", str(checkout / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                              env=clean_env(OUT=str(out), PYTHON=bare, GPU_CHECK_VENV=str(tmp_path / "venv")),
                              timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        setup = next(line for line in (out / "0-summary.txt").read_text().splitlines() if line.startswith("setup "))
        assert " FAILED " in setup and "import check failed" in setup, setup


def _bash_array(script: Path, name: str) -> list[str]:
    """The words of a one-line-or-more bash array assignment ``NAME=(...)``, comments dropped."""
    text = script.read_text()
    rest = text[text.index(f"\n{name}=(") + len(name) + 3:]
    words = []
    for line in rest.splitlines():
        code = line.split("#", 1)[0]
        words += code.split(")", 1)[0].split()
        if ")" in code:
            return words
    raise AssertionError(f"{script.name}: {name}=( is never closed")


def test_gpu_scripts_parse_and_agree_on_the_wheels():
    scripts = ROOT / "scripts"
    for name in ("gpu_check.sh", "gpu_wheels.sh"):
        proc = subprocess.run(["bash", "-n", str(scripts / name)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{name}: {proc.stderr}"
    listed = subprocess.run(["bash", str(scripts / "gpu_wheels.sh"), "--list"], capture_output=True, text=True,
                            check=True).stdout.split()
    assert listed == _bash_array(scripts / "gpu_wheels.sh", "WHEELS")
    pins = {}
    for spec in listed:
        name, sep, version = spec.partition("==")
        assert sep and version, f"{spec!r} is not pinned with =="
        pins[name.lower().replace("_", "-")] = version
    installed = _bash_array(scripts / "gpu_check.sh", "CARRIED_WHEELS")
    assert installed, "gpu_check.sh lists no carried wheels"
    # Every package gpu_check installs is pinned for download, and nothing is downloaded in vain.
    assert set(installed) == set(pins), (installed, pins)


def test_gpu_check_benchmarks_run_at_the_sizes_of_the_aims():
    # Issue 17 states its GPU aims at fixed sizes; gpu_check.sh's quick suites must measure
    # exactly those (and its flags must be ones the CLI takes: the dry run never gets there).
    import argparse

    from vtnumba.apps.cli import build_parser
    from vtnumba.bench import kernels, tpsp

    script = ROOT / "scripts" / "gpu_check.sh"
    parse = build_parser().parse_args
    args = parse(["bench", "tpsp", "--quick", *_bash_array(script, "TPSP_AIM_ARGS")])
    tokens, hidden, k_total, _ = tpsp._settings(args, 2, "cuda")
    assert 4096 in tokens and hidden == k_total == 4096
    args = parse(["bench", "kernels", "--quick", *_bash_array(script, "KERNELS_AIM_ARGS")])
    assert 4096 in kernels._settings(args)["device_mm_sizes"]
    args = parse(["bench", "peer", "--quick", *_bash_array(script, "PEER_AIM_ARGS")])
    assert 64 in args.sizes
    text = script.read_text()
    for name in ("TPSP_AIM_ARGS", "KERNELS_AIM_ARGS", "PEER_AIM_ARGS"):
        assert f'"${{{name}[@]}}"' in text, f"{name} is defined but not passed to its suite"
    # Without the flag the sizes stay the defaults; a bad size is refused by name.
    assert kernels._settings(argparse.Namespace(quick=True))["device_mm_sizes"] is None
    with pytest.raises(ValueError, match="--device-matmul-sizes: 0 is not a positive"):
        kernels._settings(argparse.Namespace(quick=True, device_matmul_sizes=[4096, 0]))


def test_gpu_check_runs_tpsp_on_the_fastest_rung_it_measured(tmp_path):
    # The TPSP overlap aim is judged on the matmul rung the kernels suite has just measured
    # fastest at 4096^3 (a slower rung would hide the exchange more easily): gpu_check.sh reads
    # it from the suite's JSON, as the runner writes it, and falls back to the default rung.
    import json

    from vtnumba.kernels.matmul import DEFAULT_VARIANT, VARIANTS

    script = ROOT / "scripts" / "gpu_check.sh"
    text = script.read_text()
    assert f"\nDEFAULT_RUNG={DEFAULT_VARIANT} " in text, "gpu_check.sh's DEFAULT_RUNG is not DEFAULT_VARIANT"
    function = text[text.index("fastest_rung() {"):]
    function = function[:function.index("\n}\n") + 3]
    fast = [v for v in VARIANTS if v != DEFAULT_VARIANT][-1]
    ratios = {"matmul_fp32 n=2048 best rung (naive) / cuBLAS": 0.9,   # another size: not the aim's
              f"matmul_fp32 n=4096 best rung ({fast}) / cuBLAS": 0.4,
              f"matmul_fp32 n=4096 {fast} / cuBLAS": 0.4}
    suite = tmp_path / "bench-kernels.json"
    suite.write_text(json.dumps({"machine": {}, "suites": [{"suite": "kernels", "ratios": ratios}]}, indent=2))

    def rung(path):
        proc = subprocess.run(["bash", "-c", function + 'fastest_rung "$1"', "-", str(path)],
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert rung(suite) == fast
    assert rung(tmp_path / "missing.json") == ""  # the kernels suite failed: the default rung
    # The caller's shell cannot choose it; only TPSP's bench runs on it (not the model stage, nor the tests).
    assert "unset NUMBA_ENABLE_CUDASIM VTNUMBA_MATMUL_VARIANT" in text
    after = "unset VTNUMBA_MATMUL_VARIANT  # everything after TPSP's bench"
    assert text.index("export VTNUMBA_MATMUL_VARIANT=$best_rung") < text.index('run_bench "bench tpsp (2 ranks)"') \
        < text.index(after) < text.index('run_bench "bench peer') < text.index('"tpsp_model.py (2 ranks)"')


def _gpu_check_merge_program() -> str:
    """The Python program gpu_check.sh runs (as a heredoc) to merge the suites' JSON and judge the aims."""
    lines = (ROOT / "scripts" / "gpu_check.sh").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('timeout 60 "$PY" - "$WORK"'))
    end = lines.index("PYEOF", start)
    return "\n".join(lines[start + 1:end]) + "\n"


def test_gpu_check_judges_every_aim_and_fails_on_a_missing_one(tmp_path):
    # The aims block of the summary: each GPU aim of issue 17 found by its ratio's name in the
    # suites' JSON (the names the suites emit), compared with its threshold; an aim no suite
    # reported makes the merge exit 3, which the script counts as a failed stage.
    program = tmp_path / "merge.py"
    program.write_text(_gpu_check_merge_program())
    ratios = {
        "kernels": {"matmul_fp32 n=4096 best rung (dbuf) / cuBLAS": 0.41,
                    "matmul_fp32 n=2048 best rung (dbuf) / cuBLAS": 0.9,  # another size: not the aim
                    "rmsnorm fused cuda GB/s / device copy traffic GB/s": 0.83},
        "peer": {"reduce_scatter peer-in-buffer busbw / copy traffic @64MiB": 0.5,
                 "reduce_scatter peer-staged busbw / copy traffic @64MiB": 0.65,  # the best variant counts
                 "all_gather peer-in-place busbw / copy traffic @64MiB": 0.7,
                 "all_gather peer-in-place busbw / copy traffic @16MiB": 0.1},
        "tpsp": {"fused / matmul T=4096": 1.2, "fused / matmul T=1024": 1.0},
    }

    pinned = ["region memory, producer mapping: pinned (cuMemHostRegister)",
              "region memory, consumer mapping: pinned (cuMemHostRegister)"]

    def merge(suites, cut_off=None, ec_notes=pinned):
        work = tmp_path / "work"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        for name, r in suites.items():
            (work / f"bench-{name}.json").write_text(json.dumps(
                {"machine": {}, "suites": [{"suite": name, "ratios": r, "baselines": {},
                                            "notes": ec_notes if name == "ec" else []}]}))
        if cut_off:  # a suite killed while it wrote its file
            (work / f"bench-{cut_off}.json").write_text('{"machine": {}, "suites": [{"suite": "')
        proc = subprocess.run([sys.executable, str(program), str(work), str(tmp_path / "bench.json"),
                               str(tmp_path / "aims.txt")], capture_output=True, text=True, timeout=60)
        return proc.returncode, (tmp_path / "aims.txt").read_text().splitlines()

    rc, aims = merge(ratios)
    assert rc == 3, aims
    assert aims[0] == "aims of issue 17: 5/9 measured, 3 met", aims
    row = {line.split("  ")[1].strip(): line for line in aims[1:] if line.startswith("  ")}
    assert "0.410" in row["matmul best rung / cuBLAS, 4096^3"] and "NOT MET" in row["matmul best rung / cuBLAS, 4096^3"]
    assert "0.650" in row["reduce-scatter busbw / D2D copy traffic, 64 MiB"], row
    assert "1.200" in row["TPSP fused / matmul alone, T=4096, K=H=4096"] and "NOT MET" in \
        row["TPSP fused / matmul alone, T=4096, K=H=4096"]
    assert "NOT MEASURED" in row["EC load / pinned copy, 16 MiB"]
    ratios["ec"] = {f"{d} {s} MiB / memcpy same buffers": 0.9 for d in ("save", "load") for s in (1, 16)}
    ratios["peer"]["reduce_scatter peer-in-buffer memory traffic / copy traffic @64MiB"] = 0.45
    rc, aims = merge(ratios)
    assert rc == 0 and aims[0] == "aims of issue 17: 9/9 measured, 7 met", aims
    assert aims[-1].split() == "reduce-scatter memory traffic / copy traffic, 64 MiB 0.450".split(), aims
    # The EC aims are against a pinned copy: a region that could not be pinned (both sides'
    # copies pageable) measures another ceiling -- not the aim, whatever the ratio.
    unpinned = [pinned[0], "region memory, consumer mapping: NOT PINNED (cuMemHostRegister failed: "
                           "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED): its copies and their baseline are pageable"]
    for notes in (unpinned, []):
        rc, aims = merge(ratios, ec_notes=notes)
        assert rc == 3 and aims[0] == "aims of issue 17: 5/9 measured, 3 met", aims
        row = {line.split("  ")[1].strip(): line for line in aims[1:] if line.startswith("  ")}
        assert "NOT MEASURED" in row["EC save / pinned copy, 1 MiB"] and "not pinned" in row["EC save / pinned copy, 1 MiB"]
    # One unreadable file costs its own aims, not the whole block.
    del ratios["ec"]
    rc, aims = merge(ratios, cut_off="ec")
    assert rc == 3 and aims[0] == "aims of issue 17: 5/9 measured, 3 met", aims


def test_gpu_check_measures_the_aims_before_the_tests():
    # The aims are what a GPU run must bring back: they run first, while the budget is whole,
    # and a benchmark the budget skipped fails the run instead of passing silently.
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    order = [text.index(f"# {'=' * 80} {stage}") for stage in ("info", "aims", "model", "MPI tests", "serial tests")]
    assert order == sorted(order), order
    assert 'note "$name" FAILED 0 "not run: time budget spent"' in text
    assert not any("--ptxas" in line for line in text.splitlines() if line.startswith("run_bench"))


def test_traced_two_rank_tpsp_run(tmp_path):
    """Issue 9's check: a traced TPSP run has both ranks, every queue TPSP used, MPI exchanges."""
    prefix = tmp_path / "tpsp"
    proc = subprocess.run([sys.executable, "-m", "vtnumba", "trace", "--out", str(prefix), "--", MPIEXEC, "-n", "2",
                           sys.executable, str(ROOT / "mpi" / "tpsp_model.py"), "--target", "cpu", "--tokens", "130",
                           "--hidden", "128", "--ffn", "256", "--layers", "2", "--repeat", "1"],
                          capture_output=True, text=True, env=clean_env(), timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    merged = json.loads((tmp_path / "tpsp.json").read_text())
    validate_trace(merged)  # end >= start, and no overlap on any queue (queue order kept)
    spans = [e for e in merged["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    for rank in (0, 1):
        tracks = {e["track"] for e in spans if e["pid"] == rank}
        for block in ("block0.down", "block1.down"):
            assert f"cpu:tpsp:{block}:compute" in tracks and f"cpu:tpsp:{block}:exchange" in tracks, tracks
        assert any(t.startswith("mpi:") for t in tracks)
    assert all(e["dur"] >= 0 for e in spans)
    assert (tmp_path / "tpsp.png").read_bytes()[:4] == b"\x89PNG"


def test_enable_refuses_paths_and_ranks_it_cannot_write(tmp_path):
    # enable(None) worked until flush() failed with AttributeError; "" and "dir/" wrote hidden
    # ".rank0.json" files.
    for bad in (None, 3, "", str(tmp_path) + os.sep, str(tmp_path)):
        with pytest.raises(ValueError, match="must be a file prefix"):
            trace.enable(bad)
    with pytest.raises(ValueError, match="rank='x' must be None"):
        trace.enable(str(tmp_path / "t"), rank="x")
    assert trace.RECORDER is None or trace.RECORDER.path != str(tmp_path / "t")


def test_one_span_object_entered_inside_itself_draws_each_block(tmp_path):
    # One start time per object: the inner block's start overwrote the outer's, so the
    # outer block was drawn from the inner's start -- too short, and nested wrongly.
    trace.enable(str(tmp_path / "t"), rank=0)
    try:
        s = trace.span("recurse", "host", "host")
        with s:
            time.sleep(0.02)
            with s:
                time.sleep(0.001)
        assert s.t0 == 0  # nothing open
        path = trace.flush()
    finally:
        trace.disable()
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e["name"] == "recurse"]
    inner, outer = sorted(events, key=lambda e: e["dur"])
    assert outer["ts"] < inner["ts"] and outer["dur"] >= 20_000 > inner["dur"]  # (microseconds)


def test_spans_from_before_tracing_and_non_finite_args_are_not_garbage(tmp_path):
    import json as _json

    trace.disable()
    early = trace.span("early", "host", "host")
    early.__enter__()  # entered while tracing is off ...
    rec = trace.enable(str(tmp_path / "t"), rank=0)
    try:
        early.__exit__(None, None, None)  # ... exited while on: no start time, so no event
        with trace.span("late", "host", "host", ratio=float("nan"), big=float("inf")):
            pass
        path = trace.flush()
    finally:
        trace.disable()
    with open(path) as f:
        text = f.read()
    events = [e for e in _json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
              ["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in events] == ["late"] and rec is not None
    assert events[0]["args"] == {"ratio": "nan", "big": "inf"}


@pytest.mark.parametrize("path", ["/proc/nonexistent/t.json", "/proc/t"])  # (root may "access" /proc)
def test_a_trace_path_that_cannot_be_written_is_said_at_start(path):
    env = dict(os.environ, VTNUMBA_TRACE=path)
    proc = subprocess.run([sys.executable, "-c", "import vtnumba.trace as t; print(t.RECORDER)"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stdout + proc.stderr
    assert f"VTNUMBA_TRACE={path!r} cannot be written" in proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


def test_gpu_check_reports_the_progress_of_a_test_run_cut_off_by_its_time_limit(tmp_path):
    # A stage killed by `timeout` leaves pytest's progress lines but no closing line; the
    # summary still says how far it got.
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    start = script.index("\npytest_progress() {") + 1
    function = script[start:script.index("\n}\n", start) + 3]
    log = tmp_path / "rank0.log"
    log.write_text("...........s.......F..                                  [ 40%]\n"
                   "..s.E                                                   [ 55%]\n"
                   "Timeout (0:02:00)!\n")
    run = lambda path: subprocess.run(["bash", "-c", function + f'pytest_progress "{path}"'], capture_output=True,
                                      text=True, check=True).stdout.strip()
    assert run(log) == "so far: 23 passed, 2 failed, 2 skipped (55%)"
    assert run(tmp_path / "missing.log") == ""


def test_enable_writes_at_exit_and_keeps_numpy_numbers_as_numbers(tmp_path):
    # flush() says the file is "also written automatically at exit", but only VTNUMBA_TRACE
    # did that; and np.int64(3) was recorded as the text '3'.
    code = ("import numpy as np\n"
            "from vtnumba import trace\n"
            f"trace.enable({str(tmp_path / 'ex')!r})\n"
            "with trace.span('x', 'host', 'host', n=np.int64(3), f=np.float32(1.5), b=np.bool_(True), "
            "nan=float('nan')):\n"
            "    pass\n")
    env = {k: v for k, v in clean_env().items() if k != "VTNUMBA_TRACE"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "ex.rank0.json").read_text())
    (args,) = [e["args"] for e in data["traceEvents"] if e.get("ph") == "X"]
    assert args == {"n": 3, "f": 1.5, "b": True, "nan": "nan"}


def test_formatters_never_write_an_exponent_and_stats_need_times():
    from vtnumba.bench.schema import format_bytes, format_count, format_number, format_size
    from vtnumba.bench.timing import stats_from_times

    # Rounded after the prefix was chosen, 1023.999 Ki was '1.02e+03 Ki'; 9999.6 was '1e+04'.
    assert (format_count(1048575), format_bytes(1048575)) == ("1 Mi", "1 MiB")
    assert (format_number(9999.6), format_size(2048.5, "M=N=K")) == ("10000", "2048³")
    assert [format_count(n) for n in (1023, 4096, 1023 * 1024, 1500000)] == ["1023", "4 Ki", "1023 Ki", "1.43 Mi"]
    assert [format_bytes(n) for n in (512, 1000, 1536, 1 << 20)] == ["512 B", "1000 B", "1.5 KiB", "1 MiB"]
    with pytest.raises(ValueError, match="times must be a non-empty flat list of seconds"):
        stats_from_times([])  # (numpy's IndexError)
    with pytest.raises(ValueError, match=r"got shape \(\)"):
        stats_from_times(None)


def test_deferred_events_are_added_once_they_can_be_and_all_when_the_trace_is_written():
    # A GPU launch's times come from CUDA events that fire later: the recorder keeps a settle
    # callable until it says it is done, and asks once more, finally, when writing the trace.
    rec = trace.Recorder("unused", rank=0)
    ready = {"a": False}
    calls = []

    def settle_a(final):
        calls.append(("a", final))
        if ready["a"] or final:
            rec.add("a", "queue", "cuda:q", 10, 20 if ready["a"] else 10, None if ready["a"] else {"timing": "launch"})
            return True
        return False

    def settle_b(final):
        calls.append(("b", final))
        rec.add("b", "queue", "cuda:q", 30, 40)
        return True

    rec.defer(settle_a)
    rec.defer(settle_b)
    rec.settle()
    assert [e["name"] for e in rec.events] == ["b"]  # a has not fired: kept
    rec.settle()
    assert [e["name"] for e in rec.events] == ["b"] and calls.count(("b", False)) == 1  # b settled once
    ready["a"] = True
    data = rec.to_json()
    names = [e["name"] for e in data["traceEvents"] if e["ph"] == "X"]
    assert sorted(names) == ["a", "b"] and "args" not in rec.events[-1]  # fired: its event times
    rec.defer(settle_a)
    ready["a"] = False
    rec.to_json()  # not fired when the trace is written: drawn as what is known (here: the launch)
    assert rec.events[-1]["args"] == {"timing": "launch"} and not rec._deferred
