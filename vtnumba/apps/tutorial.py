"""What every tutorial uses: choose the target, print from rank 0, draw figures, record runs for the docs.

Tutorials run as ``mpiexec -n 2 python tutorials/NN_name.py [--target T] [--out DIR]`` and
also as plain ``python tutorials/NN_name.py`` (one rank).  :func:`start` must run before
anything imports ``numba.cuda`` (the simulator switch is read at import time).

**A tutorial file** is a runnable script in the style of Triton's tutorials: a module
docstring (title and introduction, in reStructuredText), then sections that begin with a
``# %%`` line.  In a section, the leading ``#`` lines are prose (reStructuredText) and the
rest is code.  :func:`parse_script` splits a file that way; the docs extension
(``docs/_ext/vt_tutorials.py``) renders it.

**Figures.**  :meth:`Lesson.figure`, :meth:`Lesson.perf_plot` and :meth:`Lesson.timeline`
write PNGs into ``<out>/<tutorial name>/`` -- ``<out>`` is ``--out``, else
``$VTNUMBA_TUTORIAL_OUT``, else ``$VTNUMBA_OUT_DIR/tutorials``, else ``out/tutorials`` at the
repository root (ignored by git) --
on rank 0 only.  matplotlib is optional (the ``docs`` extra): without it a tutorial still
runs and says that it skipped its figures.

**Output under its section.**  With ``VTNUMBA_TUTORIAL_MARKERS=1`` (the docs build and
``scripts/run_tutorials.py`` set it), rank 0 prints a marker line ``@@vt:section N`` whenever
its output starts coming from another ``# %%`` section of the script (it looks at which
module-level line of the script is running), and ``@@vt:figure NAME|caption`` for each
figure; :func:`parse_output` splits the output on them.  Without the variable nothing
extra is printed.

**Recorded runs.**  :func:`run_recorded` runs a tutorial the way the docs show it
(``mpiexec -n 2 ... --target cpu``) and saves its output, next to its figures, under a key
made of the script's and the vtnumba sources' hashes; :func:`load_recorded` returns that
run only while the key still matches.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import bisect
import contextlib
import hashlib
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from vtnumba.apps.processes import interrupted, quiet_interrupts_at_top_level, share_cores_between_local_ranks

# A tutorial imports this module first, before numpy: share the cores between the ranks now --
# and a Ctrl-C while the lesson's modules load is one line per rank, not a traceback.
share_cores_between_local_ranks()
quiet_interrupts_at_top_level()

from vtnumba.bench.runner import path_text, positive_seconds  # noqa: E402
from vtnumba.target import TARGETS  # noqa: E402

#: ``"1"``: rank 0 prints ``@@vt:`` marker lines (the docs build and ``scripts/run_tutorials.py`` set it).
MARKERS_ENV = "VTNUMBA_TUTORIAL_MARKERS"
#: The figures' default folder when ``--out`` is not given.
OUT_ENV = "VTNUMBA_TUTORIAL_OUT"
#: How marker lines start.
MARK = "@@vt:"
#: How a line that starts a section starts.
SECTION_LINE = "# %%"
#: A recorded run's saved output (first line: the key), in ``<out root>/<tutorial name>/``.
OUTPUT_FILE = "output.txt"
#: A recorded run's stderr, beside it.
STDERR_FILE = "stderr.txt"
#: How simulator times are labelled wherever a tutorial prints or plots them.
SIMULATOR_NOTE = "simulator time: says nothing about GPU performance"


# ---------------------------------------------------------------------------- the script's shape
@dataclass
class Section:
    """One ``# %%`` section of a tutorial: its number (1 = the first), prose and code."""

    #: Its number: 1 for the first ``# %%`` section, 0 for code before it (the preamble).
    index: int
    #: The leading comment lines, without the ``#`` and one space: reStructuredText.
    prose: str
    #: The rest of the section: the code the page shows.
    code: str
    #: 1-based line of its ``# %%`` marker (0 for the preamble).
    first_line: int


def section_starts(source: str) -> list[int]:
    """1-based line numbers of the ``# %%`` lines that start the sections."""
    return [i + 1 for i, line in enumerate(source.splitlines()) if line.startswith(SECTION_LINE)]


def section_of_line(line: int, starts: list[int]) -> int:
    """The section a 1-based source line belongs to (0: before the first ``# %%``)."""
    return bisect.bisect_right(starts, line)


def _split_prose(lines: list[str]) -> tuple[str, str]:
    prose, i = [], 0
    while i < len(lines) and (lines[i].startswith("#") or (not lines[i].strip() and prose)):
        line = lines[i]
        prose.append(line[2:] if line.startswith("# ") else line[1:] if line.startswith("#") else "")
        i += 1
    # A blank line ends the prose only if code follows; trailing blanks belong to neither.
    return "\n".join(prose).strip("\n"), "\n".join(lines[i:]).strip("\n")


def parse_script(source: str) -> tuple[str, list[Section]]:
    """Split a tutorial into its docstring and its sections (see the module docstring).

    Section ``k`` holds the lines after its ``# %%`` line up to the next one; section 0 is
    the code between the docstring and the first ``# %%`` line (usually empty, then omitted).
    """
    tree = ast.parse(source)
    doc = ast.get_docstring(tree) or ""
    lines = source.splitlines()
    body_start = 0
    if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant) \
            and isinstance(tree.body[0].value.value, str):
        body_start = tree.body[0].end_lineno
    starts = section_starts(source)
    bounds = [(0, body_start, (starts[0] - 1) if starts else len(lines))]
    bounds += [(k + 1, s, (starts[k + 1] - 1) if k + 1 < len(starts) else len(lines)) for k, s in enumerate(starts)]
    sections = []
    for index, begin, end in bounds:
        chunk = lines[begin:end]
        prose, code = _split_prose(chunk) if index else ("", "\n".join(chunk).strip("\n"))
        if index or code:
            sections.append(Section(index, prose, code, begin if index else 0))
    return doc, sections


# ---------------------------------------------------------------------------- output markers
class _SectionStream:
    """rank 0's stdout in marker mode: a ``@@vt:section N`` line whenever output comes from another section."""

    def __init__(self, stream, script: str, starts: list[int]):
        self._stream = stream
        self._script = os.path.realpath(script)
        self._starts = starts
        self._section: int | None = None
        self._at_line_start = True
        self._is_script: dict[str, bool] = {}
        self._lock = threading.RLock()

    def _current_section(self) -> int | None:
        line = None
        frame = sys._getframe(1)
        while frame is not None:  # the *outermost* frame in the script is the module-level statement
            name = frame.f_code.co_filename
            hit = self._is_script.get(name)
            if hit is None:
                hit = self._is_script[name] = os.path.realpath(name) == self._script
            if hit:
                line = frame.f_lineno
            frame = frame.f_back
        return None if line is None else section_of_line(line, self._starts)

    def _enter_section(self) -> None:
        section = self._current_section()
        if section is not None and section != self._section and self._at_line_start:
            self._stream.write(f"{MARK}section {section}\n")
            self._section = section

    def write(self, text: str) -> int:
        if not text:
            return 0
        with self._lock:
            self._enter_section()
            self._stream.write(text)
            self._at_line_start = text.endswith("\n")
            return len(text)

    def mark(self, text: str) -> None:
        """Write a marker line of its own (after ending any open line), in the current section."""
        with self._lock:
            if not self._at_line_start:
                self._stream.write("\n")
                self._at_line_start = True
            self._enter_section()
            self._stream.write(f"{MARK}{text}\n")
            self._stream.flush()

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


@dataclass
class ParsedOutput:
    """A marked run's stdout, split: output lines and figures (name, caption) per section."""

    #: Section number -> the lines it printed.
    text: dict[int, list[str]] = field(default_factory=dict)
    #: Section number -> the figures it drew, as (file name, caption).
    figures: dict[int, list[tuple[str, str]]] = field(default_factory=dict)

    def section_text(self, index: int) -> str:
        """The output of one section, without leading or trailing blank lines."""
        return "\n".join(self.text.get(index, [])).strip("\n")


def parse_output(stdout: str) -> ParsedOutput:
    """Split the stdout of a run made with ``VTNUMBA_TUTORIAL_MARKERS=1`` by section."""
    out = ParsedOutput()
    section = 0
    for line in stdout.splitlines():
        if line.startswith(MARK + "section "):
            section = int(line[len(MARK) + 8:].strip())
        elif line.startswith(MARK + "figure "):
            name, _, caption = line[len(MARK) + 7:].partition("|")
            out.figures.setdefault(section, []).append((name.strip(), caption.strip()))
        else:
            out.text.setdefault(section, []).append(line)
    return out


# ---------------------------------------------------------------------------- sizes and rates
def human_bytes(n: float) -> str:
    """``65536`` -> ``'64 KiB'``: a byte count the way people say it."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value >= 10 or value == int(value) else f"{value:.1f} {unit}"
    return f"{n:.0f} B"


def as_rate(stats, amount: float, scale: float = 1e9) -> tuple[float, float, float]:
    """(median, p10, p90) of ``amount / time / scale`` from the timing ``stats`` of one call.

    The slow end of the times is the low end of the rate: p10 of the rate is ``amount /
    p90`` of the times.
    """
    return (amount / stats.median_s / scale, amount / stats.p90_s / scale, amount / stats.p10_s / scale)


def time_calls(fn, repeat: int, warmup: int = 1) -> list[float]:
    """The wall time of each of ``repeat`` calls of ``fn()`` (seconds), after ``warmup`` calls.

    Lists from interleaved rounds add up; :func:`vtnumba.bench.timing.stats_from_times` turns
    them into a median and percentiles.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def as_ms(stats) -> tuple[float, float, float]:
    """(median, p10, p90) of one call's time in milliseconds."""
    return (stats.median_s * 1e3, stats.p10_s * 1e3, stats.p90_s * 1e3)


# ---------------------------------------------------------------------------- the lesson
def default_out_root(script: str | None = None) -> Path:
    """``$VTNUMBA_TUTORIAL_OUT``, else ``$VTNUMBA_OUT_DIR/tutorials``, else ``out/tutorials`` at the
    repository root (or the working directory)."""
    if os.environ.get(OUT_ENV):
        return Path(os.environ[OUT_ENV])
    if os.environ.get("VTNUMBA_OUT_DIR"):
        return Path(os.environ["VTNUMBA_OUT_DIR"]) / "tutorials"
    here = Path(script or sys.argv[0]).resolve().parent
    root = here.parent if here.name == "tutorials" else Path.cwd()
    return root / "out" / "tutorials"


@dataclass
class Lesson:
    """One tutorial run: the communicator, this rank, the target, the parsed arguments."""

    #: ``MPI.COMM_WORLD``.
    comm: object
    #: This process's rank.
    rank: int
    #: How many ranks run the lesson.
    size: int
    #: The chosen target: ``cpu``, ``cudasim`` or ``cuda``.
    target: str
    #: The parsed command line (``--target``, ``--out`` and the lesson's own options).
    args: argparse.Namespace
    #: The tutorial's name (its file name without ``.py``): the figures' subfolder.
    name: str = "tutorial"
    #: The folder the figures go under (``--out``, ``$VTNUMBA_TUTORIAL_OUT``, ``$VTNUMBA_OUT_DIR/tutorials``
    #: or ``out/tutorials``).
    out_root: Path = field(default_factory=lambda: Path("out") / "tutorials")
    _stream: _SectionStream | None = None
    _no_figures: str | None = None

    # -- telling ------------------------------------------------------------------------
    def say(self, *parts, **kw) -> None:
        """Print on rank 0 only (every rank runs the lesson; one voice tells it)."""
        if self.rank == 0:
            print(*parts, **kw)
            sys.stdout.flush()

    def check(self, ok: bool, what: str) -> None:
        """A self-check every rank agrees on: all ranks pass, or the lesson fails on all.

        The agreement is a non-blocking all-gather (so every rank learns which ranks failed) with
        the lesson's deadline (``--timeout``),
        which also watches the failure board: a rank that failed ends the others' wait here.
        """
        import numpy as np

        from vtnumba.dist.comm import wait_request

        mine, everyone = np.array([1 if ok else 0], dtype=np.int32), np.zeros(self.comm.Get_size(), dtype=np.int32)
        wait_request(self.comm.Iallgather(mine, everyone), None, f"the self-check {what!r}", self.args.timeout)
        failed = [r for r, passed in enumerate(everyone) if not passed]
        where = "" if not failed or self.comm.Get_size() == 1 else f" (on rank{'s' if len(failed) > 1 else ''} " \
            f"{', '.join(map(str, failed))})"
        self.say(f"  check: {what}: {'ok' if not failed else 'FAILED' + where}")
        if failed:
            # Every rank leaves with status 1; rank 0 says why, once (each rank's SystemExit
            # message went to the same terminal, lines running into each other).
            raise SystemExit(f"self-check failed: {what}{where}" if self.rank == 0 else 1)

    @property
    def simulated(self) -> bool:
        """True on ``cudasim``: every CUDA thread is a Python thread, so times mean nothing."""
        return self.target == "cudasim"

    @property
    def sim_note(self) -> str:
        """``" (simulator time: says nothing about GPU performance)"`` on cudasim, else ``""``."""
        return f" ({SIMULATOR_NOTE})" if self.simulated else ""

    # -- figures ------------------------------------------------------------------------
    @property
    def out_dir(self) -> Path:
        """Where this tutorial's figures go: ``<out root>/<tutorial name>/``."""
        return self.out_root / self.name

    def _pyplot(self):
        if self._no_figures is not None:
            return None
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            self._no_figures = str(exc)
            self.say(f"(figures skipped: matplotlib is not installed -- pip install 'vtnumba[docs]'; {exc})")
            return None
        return plt

    def _announce(self, path: Path, caption: str) -> None:
        if self._stream is not None:
            self._stream.mark(f"figure {path.name}|{' '.join(caption.split())}")
        else:
            self.say(f"figure: {os.path.relpath(path)}  ({caption.split('.')[0]})")

    def figure(self, name: str, caption: str, draw) -> Path | None:
        """Draw a figure on rank 0: ``draw(plt)`` makes it (returning the Figure, or using
        the current one); it is saved as ``<out_dir>/<name>``.  Returns the path (None on
        other ranks or without matplotlib)."""
        if self.rank != 0:
            return None
        plt = self._pyplot()
        if plt is None:
            return None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        fig = draw(plt) or plt.gcf()
        path = self.out_dir / name
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        self._announce(path, caption)
        return path

    def perf_plot(self, name: str, caption: str, series: dict, *, xlabel: str, ylabel: str, title: str,
                  xfmt=human_bytes, note: str | None = None, logy: bool = False) -> Path | None:
        """Plot one line per implementation across sizes: medians with p10/p90 bars.

        ``series`` maps an implementation's name to ``[(x, (median, p10, p90)), ...]`` (see
        :func:`as_rate`, :func:`as_ms`); x is log-scaled and labelled with ``xfmt(x)``.  On
        ``cudasim`` the plot says that simulator times mean nothing, whatever ``note`` says.
        """
        if self.simulated:
            note = SIMULATOR_NOTE + (f"; {note}" if note else "")

        def draw(plt):
            fig, ax = plt.subplots(figsize=(7.5, 4.2))
            xs = sorted({x for points in series.values() for x, _ in points})
            for label, points in series.items():
                points = sorted(points)
                x = [p[0] for p in points]
                med = [p[1][0] for p in points]
                lo = [max(0.0, p[1][0] - p[1][1]) for p in points]
                hi = [max(0.0, p[1][2] - p[1][0]) for p in points]
                ax.errorbar(x, med, yerr=[lo, hi], marker="o", markersize=4, capsize=3, linewidth=1.5, label=label)
            ax.set_xscale("log")
            if logy:
                from matplotlib.ticker import FuncFormatter, LogLocator

                ax.set_yscale("log")
                ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.set_xticks(xs)
            ax.set_xticklabels([xfmt(x) for x in xs], rotation=30 if len(xs) > 5 else 0)
            ax.xaxis.set_minor_locator(plt.NullLocator())
            ax.yaxis.set_minor_locator(plt.NullLocator())
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.set_title(title, fontsize=10)
            ax.grid(alpha=0.3)
            legend = ax.legend(fontsize=8, title=f"target {self.target}, {self.size} rank(s); median, bar p10-p90",
                               title_fontsize=7.5)
            legend.get_title().set_color("#555555")
            if note:
                # Under the plot, in a strip of its own: inside the axes the legend (placed where
                # the lines leave room) could cover it.
                fig.text(0.01, 0.01, note, va="bottom", fontsize=7.5, color="#b22222", wrap=True)
                fig.tight_layout(rect=(0, 0.07, 1, 1))
            else:
                fig.tight_layout()
            return fig

        return self.figure(name, caption, draw)

    @contextlib.contextmanager
    def timeline(self, name: str, caption: str, *, title: str | None = None, first_calls: str = "label",
                 row_order=None, labels: bool = False):
        """Record the queue work of a ``with`` block on every rank and draw it on rank 0.

        Collective: every rank enters the block (after a barrier, so the ranks start
        together).  Synchronize inside the block -- work still queued when it ends is not in
        the picture.  See :func:`vtnumba.apps.trace_tools.timeline_figure`.
        """
        from vtnumba import trace
        from vtnumba.dist.comm import wait_request

        wait_request(self.comm.Ibarrier(), None, f"the barrier before timeline {name!r}", self.args.timeout)
        with trace.recording(rank=self.rank) as rec:
            yield rec
        gathered = self.comm.gather(rec.to_json(), root=0)
        if self.rank == 0:
            from vtnumba.apps.trace_tools import merge_trace_data, timeline_figure

            merged = merge_trace_data(gathered)
            if any(e.get("ph") == "X" for e in merged["traceEvents"]):
                self.figure(name, caption, lambda plt: timeline_figure(merged, title or caption, first_calls=first_calls,
                                                                       row_order=row_order, labels=labels))


def _end_together_on_failure(timeout_s: float) -> None:
    """A lesson's uncaught exception ends every rank, as :func:`vtnumba.dist.run_collectively` does.

    A tutorial is a script, not a ``main()``, so the hook is the interpreter's: the failing
    rank tells the others through the failure board (a peer waiting in a self-check stops at
    once, naming it), then leaves by the exit protocol -- together with them when they
    arrive, else without ``MPI_Finalize`` after ``timeout_s``, which makes ``mpiexec`` end a
    peer still blocked in one of the lesson's plain MPI calls.
    """
    from vtnumba.dist import failures
    from vtnumba.dist.comm import set_default_timeout

    set_default_timeout(timeout_s)
    failures.install()
    failures.expect_peer_reports()
    previous = sys.excepthook
    failed = []

    def hook(exc_type, exc, tb):
        failed.append(exc)
        ctrl_c = interrupted(exc)
        if not (isinstance(exc, Exception) or ctrl_c):
            previous(exc_type, exc, tb)
            return
        failures.arm_exit_watchdog(timeout_s)  # from here on, nothing may keep this rank alive
        failures.ignore_ctrl_c()  # (nor cut into the way out: the watchdog bounds it)
        quiet = failures.reader_gone(exc)  # (| head: the reader asked for no more)
        if not getattr(exc, "caused_by_peer", False) and not ctrl_c and not quiet:  # (a Ctrl-C: the reader's)
            previous(exc_type, exc, tb)  # the traceback first: it is what the reader needs
        line = failures.report(exc)
        if not quiet:
            failures.say(line)
        # Returns once every rank has arrived (Python then exits 1 and finalizes MPI); does not
        # return if one never does.
        code = failures.exit_after_failure(timeout_s, interrupted=ctrl_c)
        if quiet:
            os._exit(0)  # (every rank agreed to leave; Python would exit 1 for the uncaught error)
        if ctrl_c:
            # Python ends a script whose KeyboardInterrupt went uncaught by killing itself with
            # SIGINT (so a shell sees it), and mpiexec calls that a "BAD TERMINATION": every
            # rank has agreed to leave, so this one leaves now, as a Ctrl-C'd program exits.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130 if code else 0)

    def at_the_end():
        # A lesson that went well ends with the same exit barrier: a peer stopped after its
        # last collective step (a debugger, SIGSTOP) kept this rank's MPI_Finalize waiting for
        # good.  (Registered after mpi4py's own exit handler, so it runs before MPI_Finalize.)
        if not failed:
            failures.end_together(timeout_s)

    sys.excepthook = hook
    atexit.register(at_the_end)


def start(description: str, extra_args=None, min_ranks: int = 1) -> Lesson:
    """Parse ``--target`` / ``--out`` (plus ``extra_args(parser)``), choose the target, join MPI.

    A lesson that needs ``min_ranks`` processes or more is refused with a usage error (status 2)
    when started with fewer.
    """
    from vtnumba.apps.processes import RankZeroErrorsParser, check_output_folder, choose_target

    parser = RankZeroErrorsParser(description=description)  # a usage error is printed by rank 0 only
    parser.add_argument("--target", choices=TARGETS, default=None, help="cpu, cudasim, cuda or auto")
    parser.add_argument("--out", default=None, type=path_text,
                        help=f"folder for the figures (default: ${OUT_ENV}, else $VTNUMBA_OUT_DIR/tutorials, else "
                             "out/tutorials at the repository root); they go into a subfolder named after the tutorial")
    parser.add_argument("--timeout", type=positive_seconds, default=60.0,
                        help="seconds a rank waits for the others (self-checks, and the exit after a failure) "
                             "before the lesson gives up (default: 60)")
    if extra_args:
        extra_args(parser)
    args = parser.parse_args()
    script = sys.argv[0]
    out_root = Path(args.out) if args.out else default_out_root(script)
    # (Named as the user gave it: the flag, or the variable the default came from.)
    source = "--out" if args.out else next((v for v in (OUT_ENV, "VTNUMBA_OUT_DIR") if os.environ.get(v)),
                                           "the default out folder")
    try:  # now, not when the first figure is saved, after the lesson's work
        check_output_folder(source, out_root / Path(script).stem)
    except ValueError as exc:
        parser.error(str(exc))
    choice = choose_target(parser, args.target)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() < min_ranks:
        parser.error(f"this lesson needs {min_ranks} or more processes, got {comm.Get_size()}: "
                     f"mpiexec -n {min_ranks} python {script}")
    _end_together_on_failure(args.timeout)
    lesson = Lesson(comm, comm.Get_rank(), comm.Get_size(), choice.name, args, name=Path(script).stem,
                    out_root=out_root)
    if lesson.rank == 0 and os.environ.get(MARKERS_ENV) == "1" and os.path.exists(script):
        with open(script) as f:
            starts = section_starts(f.read())
        lesson._stream = _SectionStream(sys.stdout, script, starts)
        sys.stdout = lesson._stream
        sys.stderr = lesson._stream  # warnings appear where they happen, as in a terminal
    lesson.say(f"[{description}] target={choice.name} ({choice.reason}); {lesson.size} rank(s)")
    return lesson


# ---------------------------------------------------------------------------- recorded runs (docs)
def recording_key(script: Path) -> str:
    """A hash of the tutorial and of every vtnumba source file: a recorded run is reused only
    while neither changed."""
    h = hashlib.sha256(Path(script).read_bytes())
    pkg = Path(__file__).resolve().parent.parent
    for path in sorted(pkg.rglob("*.py")):
        h.update(str(path.relative_to(pkg)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@dataclass
class RecordedRun:
    """A tutorial run saved for the docs: its stdout (with markers), stderr, time and folder."""

    #: The tutorial that ran.
    script: Path
    #: :func:`recording_key` of the script and the sources it ran with.
    key: str
    #: The exit status of ``mpiexec`` (0: every rank passed its checks).
    returncode: int
    #: rank 0's output, with ``@@vt:`` markers (see :func:`parse_output`).
    stdout: str
    #: What the ranks wrote to stderr (kept in ``stderr.txt`` for debugging).
    stderr: str
    #: Wall time of the run.
    seconds: float
    #: Where its figures (and saved output) are: ``<out root>/<tutorial name>/``.
    out_dir: Path
    #: The command line, as the docs show it.
    command: str

    @property
    def figures(self) -> list[Path]:
        """The figure files the run announced, in order."""
        return [self.out_dir / name for figs in parse_output(self.stdout).figures.values() for name, _ in figs]


def _mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else "mpiexec"


def docs_command(script: Path, target: str = "cpu", ranks: int = 2) -> str:
    """The command line the docs show for a recorded run."""
    return f"mpiexec -n {ranks} python tutorials/{Path(script).name} --target {target}"


def run_recorded(script: Path, out_root: Path, *, target: str = "cpu", ranks: int = 2, timeout_s: float = 180,
                 save: bool = True) -> RecordedRun:
    """Run ``script`` under ``mpiexec -n ranks`` with markers on, figures into ``out_root/<name>/``.

    With ``save`` (and exit status 0) the output is kept in ``out_root/<name>/output.txt``
    under the current :func:`recording_key` for :func:`load_recorded`.
    """
    script = Path(script).resolve()
    out_dir = Path(out_root) / script.stem
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in list(out_dir.glob("*.png")) + [out_dir / OUTPUT_FILE, out_dir / STDERR_FILE]:
        old.unlink(missing_ok=True)  # never show a figure that this run did not draw
    key = recording_key(script)
    env = dict(os.environ, PYTHONUNBUFFERED="1", VTNUMBA_TARGET=target, **{MARKERS_ENV: "1"})
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # the tutorial's --target decides
    env.pop(OUT_ENV, None)
    cmd = [_mpiexec(), "-n", str(ranks), sys.executable, str(script), "--target", target, "--out", str(out_root)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=script.parent.parent, env=env, capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        decode = (lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or ""))
        rc, stdout, stderr = 124, decode(exc.stdout), decode(exc.stderr) + f"\n[timed out after {timeout_s} s]"
    run = RecordedRun(script, key, rc, stdout, stderr, time.perf_counter() - t0, out_dir,
                      docs_command(script, target, ranks))
    if save and rc == 0:
        (out_dir / STDERR_FILE).write_text(stderr)
        (out_dir / OUTPUT_FILE).write_text(f"# vt-tutorial key={key} seconds={run.seconds:.1f} "
                                           f"command={run.command}\n{stdout}")
    return run


def load_recorded(script: Path, out_root: Path) -> RecordedRun | None:
    """The saved run of ``script`` under ``out_root``, if its key matches the current sources."""
    script = Path(script).resolve()
    out_dir = Path(out_root) / script.stem
    saved = out_dir / OUTPUT_FILE
    if not saved.exists():
        return None
    header, _, stdout = saved.read_text().partition("\n")
    fields = dict(part.split("=", 1) for part in header.split()[2:] if "=" in part)
    if not header.startswith("# vt-tutorial ") or fields.get("key") != recording_key(script):
        return None
    run = RecordedRun(script, fields["key"], 0, stdout, "", float(fields.get("seconds", 0)), out_dir,
                      header.split("command=", 1)[1] if "command=" in header else docs_command(script))
    if not all(p.exists() for p in run.figures):
        return None
    return run


__all__ = ["Lesson", "start", "Section", "parse_script", "section_starts", "section_of_line", "ParsedOutput",
           "parse_output", "human_bytes", "as_rate", "as_ms", "time_calls", "default_out_root", "RecordedRun", "recording_key",
           "run_recorded", "load_recorded", "docs_command", "MARKERS_ENV", "OUT_ENV"]
