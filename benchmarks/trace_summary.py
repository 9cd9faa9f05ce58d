"""Summarize a JAX profiler trace (``perfetto_trace.json.gz``) per track.

For each device stream and host thread: busy time (union of its events),
event count, and the events that took the most time; for the whole trace,
the span from first to last event. Run it on the file that
``jax.profiler.trace(dir, create_perfetto_trace=True)`` wrote:

    python benchmarks/trace_summary.py out/trace/perfetto_trace.json.gz --top 12
"""

import argparse
import collections
import gzip
import json
import pathlib
import re


def load(path):
    path = pathlib.Path(path)
    if path.is_dir():
        found = sorted(path.rglob("perfetto_trace.json.gz"))
        if not found:
            raise SystemExit(f"no perfetto_trace.json.gz under {path}")
        path = found[-1]
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals):
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _short(name, width=70):
    name = re.sub(r"\s+", " ", str(name))
    return name if len(name) <= width else name[: width - 3] + "..."


def tracks(events):
    """``{(process, thread): [(start, end, name)]}`` of complete events."""
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M":
            label = (e.get("args") or {}).get("name", "")
            if e.get("name") == "process_name":
                procs[e.get("pid")] = label
            elif e.get("name") == "thread_name":
                threads[(e.get("pid"), e.get("tid"))] = label
    out = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        pid, tid = e.get("pid"), e.get("tid")
        key = (procs.get(pid, str(pid)), threads.get((pid, tid), str(tid)))
        start = float(e["ts"])
        out[key].append((start, start + float(e["dur"]), e.get("name", "")))
    return out


def summarize(events, top=10, steps=1, match="", gaps=8):
    """Lines of text: per track busy ms (per step) and its top events."""
    found = tracks(events)
    spans = [iv for ivs in found.values() for iv in ivs]
    if not spans:
        return ["(no complete events in the trace)"]
    first = min(a for a, _, _ in spans)
    last = max(b for _, b, _ in spans)
    lines = [f"trace span {(last - first) / 1e3:.2f} ms, {steps} step(s)"]
    for (proc, thread), ivs in sorted(found.items()):
        if match and not re.search(match, f"{proc} {thread}"):
            continue
        busy = _union([(a, b) for a, b, _ in ivs]) / 1e3 / steps
        lines.append(
            f"\n[{_short(proc, 40)} / {_short(thread, 40)}] busy {busy:.3f} ms/step, "
            f"{len(ivs) / steps:.1f} events/step"
        )
        per_name = collections.defaultdict(lambda: [0.0, 0])
        for a, b, name in ivs:
            per_name[name][0] += b - a
            per_name[name][1] += 1
        ranked = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
        for name, (dur, count) in ranked:
            lines.append(
                f"  {dur / 1e3 / steps:9.3f} ms/step  {count / steps:7.1f}x  "
                + _short(name)
            )
        if gaps and re.search(r"(?i)gpu|stream|device", f"{proc} {thread}"):
            lines.extend(_gaps(ivs, gaps))
    return lines


def _gaps(ivs, count):
    """The ``count`` longest idle stretches of one track, with the events
    on either side (where a device waited for its host)."""
    ordered = sorted(ivs)
    found, end, before = [], ordered[0][1], ordered[0][2]
    for a, b, name in ordered[1:]:
        if a > end:
            found.append((a - end, before, name))
        if b >= end:
            end, before = b, name
    found.sort(key=lambda g: -g[0])
    lines = [f"  idle {sum(g[0] for g in found) / 1e3:.3f} ms in all; longest gaps:"]
    for gap, before, after in found[:count]:
        lines.append(
            f"    {gap / 1e3:8.3f} ms  after {_short(before, 40)}  "
            f"before {_short(after, 40)}"
        )
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", help="perfetto_trace.json.gz or a folder holding one")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--steps", type=int, default=1, help="divide times by this")
    parser.add_argument("--match", default="", help="regex on 'process thread'")
    parser.add_argument(
        "--gaps", type=int, default=8, help="idle gaps per device track"
    )
    args = parser.parse_args()
    lines = summarize(load(args.path), args.top, args.steps, args.match, args.gaps)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
