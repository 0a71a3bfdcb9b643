"""The tutorial pages' rendering logic, without MPI: sections, output markers, figures, included code.

The docs build (``docs/_ext/vt_tutorials.py``) turns ``tutorials/NN_name.py`` plus a recorded
run into a page; these tests check each piece on the real tutorials and on small made-up
ones: the script splits into the sections the run's markers name, output and figures land
under the section that printed or drew them, every ``vt-source`` target exists, every
lesson has its parts, and nothing is written outside ``docs/_build``.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vtnumba.apps.tutorial import (
    MARKERS_ENV,
    OUTPUT_FILE,
    RecordedRun,
    human_bytes,
    load_recorded,
    parse_output,
    parse_script,
    recording_key,
    section_of_line,
    section_starts,
)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TUTORIALS = sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))
LESSONS = TUTORIALS  # every tutorial is a lesson, held to the same parts

sphinx = pytest.importorskip("sphinx")  # the docs extension imports it (the docs extra)
sys.path.insert(0, str(DOCS / "_ext"))
import vt_figures  # noqa: E402
import vt_tutorials  # noqa: E402


def ids(paths):
    return [p.stem for p in paths]


def vt_sources(text: str) -> list[tuple[str, bool]]:
    """(dotted name, cuda-kernels flag) of every ``.. vt-source::`` directive in ``text``."""
    found = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*(?:#\s*)?\.\. vt-source:: (\S+)", line)
        if m:
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            found.append((m.group(1), ":cuda-kernels:" in nxt))
    return found


# ---------------------------------------------------------------------------- the real tutorials
def test_every_tutorial_has_a_page_and_every_page_a_tutorial():
    stubs = {p.stem: p.read_text() for p in (DOCS / "tutorials").glob("[0-9][0-9]_*.rst")}
    assert set(stubs) == {p.stem for p in TUTORIALS}
    for stem, text in stubs.items():
        assert f".. vt-tutorial:: {stem}" in text, stem
    index = (DOCS / "tutorials" / "index.rst").read_text()
    assert "toctree" in index and "[0-9][0-9]_*" in index


@pytest.mark.parametrize("path", TUTORIALS, ids=ids(TUTORIALS))
def test_sections_match_the_marker_numbering(path):
    source = path.read_text()
    compile(source, str(path), "exec")
    doc, sections = parse_script(source)
    starts = section_starts(source)
    assert doc.splitlines()[1].startswith("="), "the docstring starts with a title"
    numbered = [s for s in sections if s.index > 0]
    assert [s.index for s in numbered] == list(range(1, len(starts) + 1))
    lines = source.splitlines()
    for sec in numbered:
        assert sec.first_line == starts[sec.index - 1]
        # Every line of the section's code maps back to the section (what the runtime markers use).
        first_code = sec.code.splitlines()[0] if sec.code else None
        if first_code:
            line_no = next(i + 1 for i in range(sec.first_line, len(lines)) if lines[i] == first_code)
            assert section_of_line(line_no, starts) == sec.index


@pytest.mark.parametrize("path", LESSONS, ids=ids(LESSONS))
def test_each_lesson_has_its_parts(path):
    source = path.read_text()
    doc, sections = parse_script(source)
    assert "**Builds on:**" in doc and ":doc:`" in doc.split("**Builds on:**", 1)[1], \
        "the docstring names the lesson it builds on, with a cross-reference"
    prose = "\n".join(s.prose for s in sections)
    for heading in ("Expected output", "Common issues", "Try next"):
        assert re.search(rf"^{heading}\n-+$", prose, re.M), f"no '{heading}' section"
    assert re.search(r"lesson\.(figure|perf_plot|timeline)\(", source), "the lesson draws no figure"
    assert vt_sources(source), "the lesson includes no code from the vtnumba sources"
    assert "sim_note" in source or "simulat" in source, "simulator times must be labelled as such"


@pytest.mark.parametrize("path", TUTORIALS, ids=ids(TUTORIALS))
def test_included_code_and_cross_references_resolve(path):
    source = path.read_text()
    for dotted, kernels in vt_sources(source):
        file, obj = vt_tutorials.resolve_source(dotted)  # raises if the file or object is missing
        if kernels:
            assert obj is None and vt_tutorials.cuda_kernels(file), f"{dotted}: no @cuda.jit function"
    for target in re.findall(r":doc:`([^`<]+?)`", source):
        page = (DOCS / "tutorials" / target).resolve()
        assert page.with_suffix(".rst").exists(), f"{path.name}: :doc:`{target}` names no page"


def test_matmul_ladder_lists_every_rung_dynamically():
    source = (ROOT / "tutorials" / "04_matmul_ladder.py").read_text()
    assert ("vtnumba.kernels.matmul_cuda", True) in vt_sources(source)
    assert "for v in VARIANTS" in source and "PTX_SIGNATURES" in source
    path, _ = vt_tutorials.resolve_source("vtnumba.kernels.matmul_cuda")
    kernels = vt_tutorials.cuda_kernels(path)
    for name in ("matmul_naive_kernel", "matmul_smem_kernel", "matmul_regtile_kernel"):
        assert name in kernels


def test_resolve_source_refuses_what_does_not_exist():
    with pytest.raises(ValueError, match="defines no 'no_such_kernel'"):
        vt_tutorials.resolve_source("vtnumba.kernels.norm_cuda.no_such_kernel")
    with pytest.raises(ValueError, match="defines no 'no_such_module'"):
        vt_tutorials.resolve_source("vtnumba.no_such_module")
    with pytest.raises(ValueError, match="no such module file"):
        vt_tutorials.resolve_source("nowhere_package.module")
    path, obj = vt_tutorials.resolve_source("vtnumba.backend.cpu.CPUBackend._record_event")
    assert path.name == "cpu.py" and obj == "CPUBackend._record_event"
    lines = vt_tutorials.source_directives("vtnumba.backend.cpu.CPUBackend._record_event", DOCS)
    assert ":pyobject: CPUBackend._record_event" in "\n".join(lines) and "   :dedent:" in lines
    assert lines[0] == ".. literalinclude:: /../vtnumba/backend/cpu.py"


# ---------------------------------------------------------------------------- rendering a page
SCRIPT = '''\
"""A made-up lesson
==================

It prints in two sections and draws in the second.
"""

# %%
# First we say hello.
print("hello")

# %%
# Then a figure.
#
# .. vt-source:: vtnumba.kernels.norm_cuda.block_sum
x = 1  # noqa: F841

# isort: split
print("a figure next")

# %%
# Expected output
# ---------------
#
# Nothing printed here.
'''


def test_render_places_output_and_figures_under_their_section(tmp_path):
    script = tmp_path / "99_made_up.py"
    script.write_text(SCRIPT)
    stdout = "@@vt:section 1\nhello\n@@vt:section 2\na figure next\n@@vt:figure pic.png|A picture of it.\n"
    run = RecordedRun(script, "k", 0, stdout, "", 1.0, tmp_path, "mpiexec -n 2 python tutorials/99_made_up.py")
    text = "\n".join(vt_tutorials.render_tutorial(script, run, "/_build/tutorials"))
    first, second, third = text.index("First we say hello."), text.index("Then a figure."), \
        text.index("Expected output")
    assert first < text.index("   hello") < second, "section 1's output is under section 1"
    assert second < text.index("   a figure next") < text.index(".. figure:: /_build/tutorials/99_made_up/pic.png") \
        < third
    assert text.count(":caption: Output") == 2, "no output block for a section that printed nothing"
    assert "A picture of it." in text and ".. vt-source:: vtnumba.kernels.norm_cuda.block_sum" in text
    assert "isort" not in text and "noqa" not in text, "linter pragmas are not shown"
    assert text.startswith("A made-up lesson\n================")


def test_the_figures_folder_without_out(monkeypatch, tmp_path):
    # Without --out: $VTNUMBA_TUTORIAL_OUT, else $VTNUMBA_OUT_DIR/tutorials, else out/tutorials
    # beside the tutorials folder (a script elsewhere: under the working directory).
    from vtnumba.apps.tutorial import OUT_ENV, default_out_root

    script = str(ROOT / "tutorials" / "01_devices_queues_events.py")
    monkeypatch.delenv(OUT_ENV, raising=False)
    monkeypatch.delenv("VTNUMBA_OUT_DIR", raising=False)
    assert default_out_root(script) == ROOT / "out" / "tutorials"
    monkeypatch.chdir(tmp_path)
    assert default_out_root(str(tmp_path / "mine.py")) == tmp_path / "out" / "tutorials"
    monkeypatch.setenv("VTNUMBA_OUT_DIR", str(tmp_path / "o"))
    assert default_out_root(script) == tmp_path / "o" / "tutorials"
    monkeypatch.setenv(OUT_ENV, str(tmp_path / "t"))
    assert default_out_root(script) == tmp_path / "t"


def test_parse_output_splits_by_marker():
    parsed = parse_output("before\n@@vt:section 3\nthree\n@@vt:figure a.png|cap a\n@@vt:section 1\none\n"
                          "@@vt:section 3\nthree again\n")
    assert parsed.section_text(0) == "before"
    assert parsed.section_text(3) == "three\nthree again"
    assert parsed.figures == {3: [("a.png", "cap a")]}
    assert parsed.section_text(2) == ""


def test_markers_come_from_a_real_run(tmp_path):
    """The rank-0 stream wrapper attributes output to the module-level statement running now."""
    folder = tmp_path / "tutorials"
    folder.mkdir()
    script = folder / "98_markers.py"
    script.write_text(textwrap.dedent('''\
        """Markers
        =======
        """

        # %%
        # A helper defined here prints when it is called later.
        import logging

        from vtnumba.apps.tutorial import start

        lesson = start("98 markers")


        def tell(what):
            lesson.say(what)


        # %%
        # Called from section 2.
        tell("from section 2")
        logging.getLogger("x").warning("a warning, where it happened")
        lesson.figure("dot.png", "One dot.", lambda plt: plt.plot([0], [0], "o") and None)

        # %%
        # Section 3 prints in two pieces.
        lesson.say("three", end="")
        lesson.say(" and more")
        '''))
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}
    env.update({MARKERS_ENV: "1", "PYTHONUNBUFFERED": "1"})
    proc = subprocess.run([sys.executable, str(script), "--target", "cpu", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parsed = parse_output(proc.stdout)
    assert "[98 markers]" in parsed.section_text(1)
    assert parsed.section_text(2).splitlines() == ["from section 2", "a warning, where it happened"]
    assert parsed.section_text(3) == "three and more"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "figures skipped" in parsed.section_text(2)
    else:
        assert parsed.figures == {2: [("dot.png", "One dot.")]}
        assert (tmp_path / "out" / "98_markers" / "dot.png").read_bytes()[:4] == b"\x89PNG"


def test_a_recorded_run_is_reused_only_while_its_key_matches(tmp_path):
    script = ROOT / "tutorials" / "01_devices_queues_events.py"
    out_dir = tmp_path / script.stem
    out_dir.mkdir()
    saved = out_dir / OUTPUT_FILE
    stdout = "@@vt:section 1\nhi\n@@vt:figure f.png|cap\n"
    saved.write_text(f"# vt-tutorial key=stale seconds=1.0 command=x\n{stdout}")
    assert load_recorded(script, tmp_path) is None
    saved.write_text(f"# vt-tutorial key={recording_key(script)} seconds=2.5 command=mpiexec -n 2 python x\n{stdout}")
    assert load_recorded(script, tmp_path) is None, "a run whose figures are missing is not reused"
    (out_dir / "f.png").write_bytes(b"\x89PNG")
    run = load_recorded(script, tmp_path)
    assert run is not None and run.seconds == 2.5 and run.stdout == stdout and run.figures == [out_dir / "f.png"]
    assert run.command == "mpiexec -n 2 python x"


def test_the_docs_build_writes_only_under_its_build_folder():
    build = DOCS / "_build"
    assert vt_tutorials.CACHE.is_relative_to(build) and vt_figures.OUT.is_relative_to(build)
    assert vt_figures.figure_uri("timeline", DOCS) == "/_build/figures/timeline.png"
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "docs/_build/" in ignored and "/out/" in ignored
    assert not (DOCS / "_generated").exists()


def test_human_bytes():
    assert [human_bytes(n) for n in (512, 1536, 65536, 16 << 20, 3 << 30)] == \
        ["512 B", "1.5 KiB", "64 KiB", "16 MiB", "3 GiB"]


def test_without_matplotlib_a_lesson_runs_and_says_it_skipped_its_figures(tmp_path, monkeypatch, capsys):
    from vtnumba.apps.tutorial import Lesson

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # "import matplotlib" now raises ImportError
    lesson = Lesson(None, 0, 1, "cpu", None, name="97_none", out_root=tmp_path)
    assert lesson.figure("a.png", "A.", lambda plt: pytest.fail("drawn without matplotlib")) is None
    assert lesson.perf_plot("b.png", "B.", {"x": [(1, (1.0, 1.0, 1.0))]}, xlabel="x", ylabel="y", title="t") is None
    out = capsys.readouterr().out
    assert out.count("figures skipped: matplotlib is not installed") == 1, out
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("ranks", [1, 2])
def test_an_out_folder_that_cannot_be_written_is_refused_before_the_lesson(tmp_path, ranks):
    # Before: the whole lesson ran, then saving its first figure died in a pathlib traceback.
    afile = tmp_path / "afile"
    afile.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}
    cmd = [sys.executable, str(ROOT / "tutorials" / "01_devices_queues_events.py"), "--target", "cpu",
           "--out", str(afile)]
    if ranks > 1:
        cmd = ["mpiexec", "-n", str(ranks), *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT,
                          stdin=subprocess.DEVNULL)
    said = f"error: --out {afile}/01_devices_queues_events: cannot write there (Not a directory)"
    assert proc.returncode == 2 and proc.stderr.count(said) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "target=" not in proc.stdout


def test_a_bad_out_folder_from_the_environment_names_the_variable(tmp_path):
    # VTNUMBA_TUTORIAL_OUT pointing at a file was reported as "--out ...", a flag never given.
    afile = tmp_path / "afile"
    afile.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}
    proc = subprocess.run([sys.executable, str(ROOT / "tutorials" / "01_devices_queues_events.py"), "--target", "cpu"],
                          capture_output=True, text=True, env={**env, "VTNUMBA_TUTORIAL_OUT": str(afile)},
                          timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and f"error: VTNUMBA_TUTORIAL_OUT {afile}/01_devices_queues_events: cannot " \
        "write there" in proc.stderr, proc.stderr


@pytest.mark.parametrize("name", ["08_tpsp", "09_encoder_cache"])
def test_a_two_rank_lesson_on_one_rank_is_a_usage_error(name):
    # It raised SystemExit with a message: status 1, as if the lesson had failed.
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}
    proc = subprocess.run([sys.executable, str(ROOT / "tutorials" / f"{name}.py"), "--target", "cpu"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    assert "error: this lesson needs 2 or more processes, got 1: mpiexec -n 2 python " in proc.stderr, proc.stderr


def test_a_perf_plot_keeps_its_note_clear_of_the_legend(tmp_path, monkeypatch):
    # The simulator's warning sat in the axes' top-left corner, where the legend went too
    # (lines that start low leave that corner free): the legend covered it.
    import argparse

    pytest.importorskip("matplotlib")
    from vtnumba.apps.tutorial import SIMULATOR_NOTE, Lesson

    lesson = Lesson(comm=None, rank=0, size=2, target="cudasim", args=argparse.Namespace(), name="t",
                    out_root=tmp_path)
    drawn = {}

    def keep(name, caption, draw):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        drawn["fig"] = draw(plt)

    monkeypatch.setattr(lesson, "figure", keep)
    series = {f"rung {k}": [(x, (x * (k + 1), x * (k + 0.5), x * (k + 2))) for x in (1 << 10, 1 << 16, 1 << 22)]
              for k in range(5)}
    lesson.perf_plot("p.png", "caption", series, xlabel="bytes", ylabel="GB/s", title="a ladder", note="more words")
    fig = drawn["fig"]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    notes = [t for t in fig.texts if SIMULATOR_NOTE in t.get_text()]
    assert len(notes) == 1 and "more words" in notes[0].get_text()
    note_box, legend_box = notes[0].get_window_extent(renderer), ax.get_legend().get_window_extent(renderer)
    assert not note_box.overlaps(legend_box)
    assert not note_box.overlaps(ax.get_tightbbox(renderer))  # under the plot and its labels
    assert note_box.x0 >= 0 and note_box.y0 >= 0  # and inside the figure
    import matplotlib.pyplot as plt

    plt.close(fig)
