"""Turning per-rank traces into one timeline: merge, validate, draw (``vtnumba trace``).

:mod:`vtnumba.trace` records, per process, every queue operation and MPI exchange as a
Chrome trace-event "complete" event.  Here the per-rank files become one merged file
(ranks as processes, queues as threads -- Perfetto and ``chrome://tracing`` show each
queue as its own row) and a matplotlib timeline PNG.  All ranks on one machine share the
monotonic clock, so their timestamps line up without correction.

The picture (:func:`draw_timeline`) is made to be read, not only looked at:

* one row per (rank, queue or track); each operation is a bar coloured by what it *is*
  (:func:`kind_of`): copies and memsets, kernels and host functions, waits (a queue waiting
  for an event or a flag, the host waiting for a queue), event records, flag writes, MPI
  exchanges; a legend names the colours that occur;
* arrows from each event record to the wait it released (the ``event`` id both carry),
  and between spans that name the same ``flow_out`` / ``flow_in`` key (see
  :mod:`vtnumba.trace`) -- also from one rank to another;
* a first call that took far longer than the later calls of the same operation (numba
  compiling a kernel, a buffer's first page faults) is hatched and labelled "1st call",
  or left out (``first_calls="drop"``), so it is not mistaken for the cost of the work;
* spans that enclose others on the same row (a TPSP call around its steps) are drawn as
  outlined brackets behind them.

The merged JSON also carries the arrows as Chrome "flow" events, which Perfetto draws.
"""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys

#: What an operation is -> (colour, legend label), in the legend's order (see :func:`kind_of`).
KINDS = {
    "copy": ("#1f77b4", "copy / memset"),
    "kernel": ("#2ca02c", "kernel / host function"),
    "wait": ("#d62728", "wait (event, flag or synchronize)"),
    "record": ("#9467bd", "event record (a tick where it completed)"),
    "signal": ("#8c564b", "flag write (signal)"),
    "peer": ("#17becf", "peer-buffer read / write"),
    "mpi": ("#ff7f0e", "MPI exchange"),
    "call": ("#7f7f7f", "enclosing call"),
}

_QUEUE_COPIES = {"copy", "memset", "memcpy", "batched_copy"}
_QUEUE_WAITS = {"wait_event", "wait_value32"}


def kind_of(ev: dict) -> str:
    """Classify one complete event for the timeline: a key of :data:`KINDS`."""
    name, cat = str(ev.get("name", "")), ev.get("cat")
    low = name.lower()
    if cat == "queue":
        if name in _QUEUE_COPIES or low.startswith("copy") or low.endswith("copy"):
            return "copy"
        if name in _QUEUE_WAITS or low.startswith("wait"):
            return "wait"
        if name == "record_event":
            return "record"
        if name == "write_value32":
            return "signal"
        return "kernel"
    if cat == "host":
        return "wait" if ("synchron" in low or "wait" in low) else "kernel"
    if cat == "peer":
        if "wait" in low:
            return "wait"
        return "signal" if ("flag" in low or "signal" in low) else "peer"
    if cat == "mpi":
        return "mpi"
    return "call"


def trace_prefix(path: str) -> str:
    """``path`` without a trailing ``.json``: ``out/t.json`` and ``out/t`` name the same trace
    (``out/t.rank<R>.json``, merged into ``out/t.json``), as :meth:`vtnumba.trace.Recorder.rank_path` reads it."""
    return path[:-5] if path.endswith(".json") else path


def rank_files(prefix: str) -> list[str]:
    """The per-rank trace files ``<prefix>.rank<R>.json`` that exist, in rank order (other files
    that happen to match ``<prefix>.rank*.json``, e.g. ``.rankold.json``, are not ranks')."""
    base = trace_prefix(prefix)
    ranks = {}
    for path in glob.glob(f"{glob.escape(base)}.rank*.json"):
        number = path[len(base) + len(".rank"):-len(".json")]
        if number.isdigit():
            ranks[path] = int(number)
    return sorted(ranks, key=ranks.get)


def merge_trace_data(traces: list[dict]) -> dict:
    """One trace from several per-rank trace dicts (their pids are already the ranks).

    Adds Chrome flow events ("s"/"f") for the arrows of :func:`find_arrows`, so Perfetto
    draws them too.
    """
    events, ranks = [], []
    for data in traces:
        events.extend(e for e in data["traceEvents"] if e.get("ph") != "s" and e.get("ph") != "f")
        ranks.append(data.get("otherData", {}).get("rank"))
    spans = [e for e in events if e.get("ph") == "X"]
    flows = []
    for i, (src, dst) in enumerate(find_arrows(spans)):
        # A flow step binds to the slice enclosing its timestamp on its (pid, tid).
        src_ts = src["ts"] + src.get("dur", 0) * 0.5
        dst_ts = dst["ts"] + dst.get("dur", 0) * 0.5
        flows.append({"name": "order", "cat": "order", "ph": "s", "id": i, "pid": src["pid"], "tid": src["tid"],
                      "ts": src_ts})
        flows.append({"name": "order", "cat": "order", "ph": "f", "bp": "e", "id": i, "pid": dst["pid"],
                      "tid": dst["tid"], "ts": dst_ts})
    return {"traceEvents": events + flows, "displayTimeUnit": "ms", "otherData": {"ranks": ranks}}


def merge_traces(paths: list[str]) -> dict:
    """One trace from several per-rank trace files (see :func:`merge_trace_data`)."""
    traces = []
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not a trace file (not JSON: {exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
            raise ValueError(f"{path} is not a trace file (no 'traceEvents' list)")
        traces.append(data)
    return merge_trace_data(traces)


def validate_trace(trace: dict) -> None:
    """Check the structure Perfetto needs; raise ValueError naming the first problem.

    Per queue ("thread"), operations must not overlap (taken in start order): a queue runs
    its work one after another.
    """
    if "traceEvents" not in trace or not isinstance(trace["traceEvents"], list):
        raise ValueError("trace has no 'traceEvents' list")
    by_track: dict[tuple, list[dict]] = {}
    for i, ev in enumerate(trace["traceEvents"]):
        for key in ("name", "ph", "pid", "tid"):
            if key not in ev:
                raise ValueError(f"traceEvents[{i}] lacks {key!r}")
        if ev["ph"] == "X":
            if ev.get("dur", -1) < 0 or "ts" not in ev:
                raise ValueError(f"traceEvents[{i}] ({ev['name']}) lacks 'ts' or 'dur', or has a negative 'dur'")
            by_track.setdefault((ev["pid"], ev["tid"]), []).append(ev)
    for (pid, tid), evs in by_track.items():
        if evs and evs[0].get("cat") != "queue":
            continue  # host spans and MPI exchanges may nest; queues may not overlap
        evs = sorted(evs, key=lambda e: e["ts"])
        for a, b in zip(evs, evs[1:]):
            if b["ts"] + 1e-3 < a["ts"] + a["dur"]:
                raise ValueError(f"queue track {tid} of rank {pid}: {b['name']} starts before {a['name']} ended")


def _end(ev: dict) -> float:
    return ev["ts"] + ev.get("dur", 0.0)


def find_arrows(spans: list[dict]) -> list[tuple[dict, dict]]:
    """(source, destination) pairs of complete events that the timeline joins by an arrow.

    * ``record_event`` -> ``wait_event`` with the same ``event`` id on the same rank: a wait
      is released by the recording that completed last before the wait ended (an event can
      be recorded again; a wait always sees the recording made before it was queued, and it
      ends right after that recording completes).
    * a span with ``flow_out=K`` -> every span with ``flow_in=K`` (any rank).
    """
    records: dict[tuple, list[dict]] = {}
    outs: dict[str, dict] = {}
    for ev in spans:
        args = ev.get("args") or {}
        if ev.get("name") == "record_event" and "event" in args:
            records.setdefault((ev["pid"], args["event"]), []).append(ev)
        if "flow_out" in args:
            outs[str(args["flow_out"])] = ev
    arrows = []
    tol = 1.0  # us: the wait ends a moment after the record completes, never before it starts
    for ev in spans:
        args = ev.get("args") or {}
        if ev.get("name") == "wait_event" and "event" in args:
            cands = [r for r in records.get((ev["pid"], args["event"]), []) if r["ts"] <= _end(ev) + tol]
            if cands:
                arrows.append((max(cands, key=_end), ev))
        if "flow_in" in args and str(args["flow_in"]) in outs:
            arrows.append((outs[str(args["flow_in"])], ev))
    return arrows


def first_call_outliers(spans: list[dict], factor: float = 3.0, min_us: float = 500.0) -> set[int]:
    """Indices (into ``spans``) of first calls that look like one-time costs.

    For every (rank, category, name) of work -- kernels, copies, peer and MPI exchanges,
    flag writes; not waits, whose length is another queue's doing -- with three or more
    calls, the first call counts as one-time (compilation, first page faults) when it took
    more than ``factor`` times the median of the later ones and at least ``min_us``.
    """
    groups: dict[tuple, list[int]] = {}
    for i, ev in enumerate(spans):
        if kind_of(ev) in ("kernel", "copy", "peer", "mpi", "signal"):  # a long wait is the peer's doing
            groups.setdefault((ev["pid"], ev.get("cat"), ev["name"]), []).append(i)
    out = set()
    for idx in groups.values():
        if len(idx) < 3:
            continue
        idx = sorted(idx, key=lambda i: spans[i]["ts"])
        rest = sorted(spans[i]["dur"] for i in idx[1:])
        median = rest[len(rest) // 2]
        first = spans[idx[0]]["dur"]
        if first >= min_us and first > factor * max(median, 1e-3):
            out.add(idx[0])
    return out


def draw_timeline(trace: dict, png_path: str, title: str = "vtnumba timeline", *, first_calls: str = "label",
                  row_order=None, labels: bool = False) -> str:
    """Draw :func:`timeline_figure` of a (merged) trace into ``png_path``; returns ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = timeline_figure(trace, title, first_calls=first_calls, row_order=row_order, labels=labels)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def timeline_figure(trace: dict, title: str = "vtnumba timeline", *, first_calls: str = "label", row_order=None,
                    labels: bool = False):
    """A Gantt chart of a (merged) trace as a matplotlib Figure: one row per (rank,
    queue/track), one bar per operation (see the module docstring).

    ``first_calls`` is ``"label"`` (hatch and label a first call that looks like a one-time
    cost, see :func:`first_call_outliers`), ``"drop"`` (leave such calls out) or ``"keep"``.
    ``row_order(track_name) -> sort key`` orders the rows within a rank (default: queues,
    then peer / MPI / call tracks, then the host, each in the order they first finished an
    operation).  ``labels`` writes each operation's name above its bar (for short traces).
    """
    if first_calls not in ("label", "drop", "keep"):
        raise ValueError(f"first_calls={first_calls!r}; expected 'label', 'drop' or 'keep'")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    if not spans:
        raise ValueError("the trace holds no operations to draw")
    outliers = first_call_outliers(spans) if first_calls != "keep" else set()
    if first_calls == "drop":
        spans = [e for i, e in enumerate(spans) if i not in outliers]
        outliers = set()
    first_ids = {id(spans[i]) for i in outliers}
    t0 = min(e["ts"] for e in spans)
    t1 = max(_end(e) for e in spans)
    group_of: dict[tuple, int] = {}
    for e in spans:
        # Queues first, then peer / MPI / call tracks, the host last (within a rank).
        g = 0 if e.get("cat") == "queue" else 2 if e.get("cat") == "host" else 1
        key = (e["pid"], e["tid"])
        group_of[key] = min(group_of.get(key, g), g)

    def row_key(row):
        label = names.get(row, str(row[1]))
        return (row[0], row_order(label) if row_order else (group_of[row], row[1]), label)

    rows = sorted(group_of, key=row_key)
    # Bars of operations that carry a chunk number are labelled c0, c1, ... per rank.
    first_chunk: dict = {}
    for e in spans:
        chunk = (e.get("args") or {}).get("chunk")
        if isinstance(chunk, int):
            first_chunk[e["pid"]] = min(first_chunk.get(e["pid"], chunk), chunk)
    y_of = {row: y for y, row in enumerate(rows)}
    scale = 1000.0 if (t1 - t0) >= 2000.0 else 1.0  # ms for long traces, us for short ones
    unit = "ms" if scale == 1000.0 else "us"
    min_w = (t1 - t0) / scale / 400.0  # every operation stays visible
    fig, ax = plt.subplots(figsize=(12, 0.42 * len(rows) + 2.4))
    used = set()
    by_row: dict[tuple, list] = {}
    for e in spans:
        by_row.setdefault((e["pid"], e["tid"]), []).append(e)
    # Bars are collected and drawn one barh call per style (tens of thousands of spans -- a
    # traced tutorial -- took 40 s as one call each).  Bars of one style never overlap: on a
    # row, each nesting depth has its own style.
    bars: dict[tuple, tuple[list, list, list, list, list]] = {}

    def bar(style: tuple, y, width, left, height, color) -> None:
        for column, value in zip(bars.setdefault(style, ([], [], [], [], [])), (y, width, left, height, color)):
            column.append(value)

    for row in rows:
        evs = sorted(by_row[row], key=lambda e: (e["ts"], -e["dur"]))
        open_ends: list[float] = []
        y = y_of[row]
        for e in evs:
            kind = kind_of(e)
            used.add(kind)
            color = KINDS[kind][0]
            left, width = (e["ts"] - t0) / scale, max(e["dur"] / scale, min_w)
            open_ends = [end for end in open_ends if end > e["ts"] + 1e-3]
            depth = len(open_ends)
            open_ends.append(_end(e))
            if kind == "call":  # an enclosing span: an outlined bracket behind what it encloses
                bar(("call",), y, width, left, 0.78, color)
                continue
            if kind == "record":  # a recording is a moment: a tick where it completed
                left, width = (_end(e) - t0) / scale - min_w, min_w
            height = max(0.25, 0.6 - 0.15 * depth)
            hatch = "///" if id(e) in first_ids else None
            bar(("op", hatch, 2 + depth), y, width, left, height, color)
            if labels:
                ax.text(left, y - 0.33, e["name"], fontsize=6, rotation=25, ha="left", va="bottom", zorder=12)
            chunk = (e.get("args") or {}).get("chunk")
            if isinstance(chunk, int) and width > (t1 - t0) / scale / 40:
                ax.text(left + width / 2, y, f"c{chunk - first_chunk[e['pid']]}", ha="center", va="center",
                        fontsize=7, color="white", zorder=15)
            if hatch:
                ax.annotate(f"1st call: {e['dur'] / 1000.0:.0f} ms", (left + width / 2, y - 0.34),
                            ha="center", va="bottom", fontsize=6.5, zorder=10)
    import numpy as np
    from matplotlib.collections import PolyCollection

    for style, (ys, widths, lefts, heights, colors) in bars.items():
        # One collection of rectangles per style (barh makes, and autoscales over, a patch per bar).
        y, w, x, h = (np.asarray(v, dtype=np.float64) for v in (ys, widths, lefts, heights))
        corners = np.stack([np.stack([x, y - h / 2], 1), np.stack([x + w, y - h / 2], 1),
                            np.stack([x + w, y + h / 2], 1), np.stack([x, y + h / 2], 1)], 1)
        if style[0] == "call":
            rects = PolyCollection(corners, facecolors=[c + "22" for c in colors], edgecolors=colors,
                                   linewidths=0.8, zorder=1)
        else:
            rects = PolyCollection(corners, facecolors=colors, edgecolors="black", linewidths=0.2,
                                   hatch=style[1], zorder=style[2])
        ax.add_collection(rects, autolim=True)
    ax.autoscale_view()
    arrows = find_arrows(spans)
    for src, dst in arrows:
        ys, yd = y_of[(src["pid"], src["tid"])], y_of[(dst["pid"], dst["tid"])]
        xs, xd = (_end(src) - t0) / scale, (_end(dst) - t0) / scale
        ax.annotate("", xy=(xd, yd), xytext=(xs, ys), zorder=20,
                    arrowprops=dict(arrowstyle="-|>", color="black", lw=0.8, shrinkA=0, shrinkB=0,
                                    connectionstyle="arc3,rad=-0.15" if ys != yd else "arc3,rad=0.4"))
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {p}: {names.get((p, t), t)}" for p, t in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.4, -0.8)
    ax.set_xlabel(f"time since the first operation ({unit})")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title, fontsize=10)
    handles = [Patch(facecolor=KINDS[k][0], edgecolor="black", label=KINDS[k][1]) for k in KINDS if k in used]
    if arrows:
        from matplotlib.lines import Line2D

        handles.append(Line2D([0], [0], color="black", lw=0.8, marker=">", markersize=4,
                              label="arrow: record or flag -> the wait it released"))
    if first_ids:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///",
                             label="1st call: a one-time cost (loading or compiling)"))
    ncol = min(4, len(handles))
    legend_rows = math.ceil(len(handles) / ncol)
    height = fig.get_size_inches()[1]
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=7.5, frameon=False)
    fig.tight_layout(rect=(0, (0.22 * legend_rows + 0.08) / height, 1, 1))
    return fig


def finish(prefix: str) -> tuple[str, str]:
    """Merge ``<prefix>.rank*.json`` into ``<prefix>.json`` and draw ``<prefix>.png``.

    FileNotFoundError when no rank wrote a file; ValueError when a file is not a trace, or
    the ranks recorded no operation at all (nothing to draw).
    """
    prefix = trace_prefix(prefix)
    paths = rank_files(prefix)
    if not paths:
        raise FileNotFoundError(f"no trace files {prefix}.rank*.json were written "
                                "(did the command run vtnumba code?)")
    merged = merge_traces(paths)
    validate_trace(merged)
    if not any(e.get("ph") == "X" for e in merged["traceEvents"]):
        raise ValueError(f"the command's {len(paths)} rank file(s) hold no operations: it ran vtnumba code but "
                         "queued no work, so there is no timeline to draw")
    out_json = f"{prefix}.json"
    with open(out_json, "w") as f:
        json.dump(merged, f)
    return out_json, draw_timeline(merged, f"{prefix}.png", title=os.path.basename(prefix))


def run_traced(cmd: list[str], prefix: str) -> int:
    """Run ``cmd`` with ``VTNUMBA_TRACE=<prefix>`` and merge what its ranks recorded."""
    prefix = os.path.abspath(trace_prefix(prefix))
    os.makedirs(os.path.dirname(prefix), exist_ok=True)  # the default prefix lives under out/
    # Never merge a previous run's ranks into this one, nor leave its merged trace and picture
    # looking like this run's when this one fails.
    for old in rank_files(prefix) + [p for p in (f"{prefix}.json", f"{prefix}.png") if os.path.exists(p)]:
        os.remove(old)
    env = dict(os.environ, VTNUMBA_TRACE=prefix)
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        if rc < 0:  # killed by a signal: the shell's status for it (SIGKILL: 137), not 256 - signal
            print(f"vtnumba trace: the command was killed by signal {-rc}", file=sys.stderr)
            return 128 - rc
        print(f"vtnumba trace: the command exited with {rc}", file=sys.stderr)
        return rc
    try:
        out_json, png = finish(prefix)
    except (FileNotFoundError, ValueError) as exc:  # nothing (or nothing readable) recorded: a message, not a traceback
        print(f"vtnumba trace: {exc}", file=sys.stderr)
        return 1
    print(f"vtnumba trace: {len(rank_files(prefix))} rank file(s) -> {out_json} (open in https://ui.perfetto.dev) "
          f"and {png}")
    return 0
