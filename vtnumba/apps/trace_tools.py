"""Turning per-rank traces into one timeline: merge, validate, draw (``vtnumba trace``).

:mod:`vtnumba.trace` records, per process, every queue operation and MPI exchange as a
Chrome trace-event "complete" event.  Here the per-rank files become one merged file
(ranks as processes, queues as threads -- Perfetto and ``chrome://tracing`` show each
queue as its own row) and a matplotlib timeline PNG.  All ranks on one machine share the
monotonic clock, so their timestamps line up without correction.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys


def rank_files(prefix: str) -> list[str]:
    base = prefix[:-5] if prefix.endswith(".json") else prefix
    return sorted(glob.glob(f"{glob.escape(base)}.rank*.json"),
                  key=lambda p: int(p.rsplit(".rank", 1)[1].split(".")[0]))


def merge_traces(paths: list[str]) -> dict:
    """One trace from several per-rank traces (their pids are already the ranks)."""
    events, ranks = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        events.extend(data["traceEvents"])
        ranks.append(data.get("otherData", {}).get("rank"))
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"ranks": ranks}}


def validate_trace(trace: dict) -> None:
    """Check the structure Perfetto needs; raise ValueError naming the first problem.

    Per queue ("thread"), operations must not overlap and must appear in start order: a
    queue runs its work one after another.
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
                raise ValueError(f"traceEvents[{i}] ({ev['name']}) has end < start")
            by_track.setdefault((ev["pid"], ev["tid"]), []).append(ev)
    for (pid, tid), evs in by_track.items():
        if evs and evs[0].get("cat") != "queue":
            continue  # host spans and MPI exchanges may nest; queues may not overlap
        evs = sorted(evs, key=lambda e: e["ts"])
        for a, b in zip(evs, evs[1:]):
            if b["ts"] + 1e-3 < a["ts"] + a["dur"]:
                raise ValueError(f"queue track {tid} of rank {pid}: {b['name']} starts before {a['name']} ended")


def draw_timeline(trace: dict, png_path: str, title: str = "vtnumba timeline") -> str:
    """A Gantt chart: one row per (rank, queue/track), one bar per operation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    if not spans:
        raise ValueError("the trace holds no operations to draw")
    t0 = min(e["ts"] for e in spans)
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    colors = {"queue": "tab:blue", "mpi": "tab:orange", "host": "tab:gray", "tpsp": "tab:green", "ec": "tab:purple"}
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.5))
    for y, row in enumerate(rows):
        for e in (e for e in spans if (e["pid"], e["tid"]) == row):
            ax.barh(y, max(e["dur"], 0.5) / 1000.0, left=(e["ts"] - t0) / 1000.0, height=0.6,
                    color=colors.get(e.get("cat"), "tab:red"), edgecolor="black", linewidth=0.2)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {p}: {names.get((p, t), t)}" for p, t in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def finish(prefix: str) -> tuple[str, str]:
    """Merge ``<prefix>.rank*.json`` into ``<prefix>.json`` and draw ``<prefix>.png``."""
    paths = rank_files(prefix)
    if not paths:
        raise FileNotFoundError(f"no trace files {prefix}.rank*.json were written "
                                "(did the command run vtnumba code?)")
    merged = merge_traces(paths)
    validate_trace(merged)
    out_json = f"{prefix}.json"
    with open(out_json, "w") as f:
        json.dump(merged, f)
    return out_json, draw_timeline(merged, f"{prefix}.png", title=os.path.basename(prefix))


def run_traced(cmd: list[str], prefix: str) -> int:
    """Run ``cmd`` with ``VTNUMBA_TRACE=<prefix>`` and merge what its ranks recorded."""
    prefix = os.path.abspath(prefix)
    for old in rank_files(prefix):
        os.remove(old)  # never merge a previous run's ranks into this one
    env = dict(os.environ, VTNUMBA_TRACE=prefix)
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        print(f"vtnumba trace: the command exited with {rc}", file=sys.stderr)
        return rc
    out_json, png = finish(prefix)
    print(f"vtnumba trace: {len(rank_files(prefix))} rank file(s) -> {out_json} (open in https://ui.perfetto.dev) "
          f"and {png}")
    return 0
