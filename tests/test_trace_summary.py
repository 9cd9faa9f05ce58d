"""benchmarks/trace_summary.py against a hand-made trace: busy time as the
union of a track's events, per-name totals, and a device stream's longest
idle gaps with their neighbours."""

import gzip
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import trace_summary  # noqa: E402

pytestmark = pytest.mark.backend_independent


def _trace(path):
    meta = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": 1,
            "args": {"name": "/device:GPU:0"},
        },
        {
            "ph": "M",
            "name": "thread_name",
            "pid": 1,
            "tid": 7,
            "args": {"name": "Stream #1"},
        },
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {
            "ph": "M",
            "name": "thread_name",
            "pid": 2,
            "tid": 3,
            "args": {"name": "python3"},
        },
    ]
    device = [  # (start, duration) in microseconds: busy 0-100, 150-200, 900-1000
        ("gemm", 0, 60),
        ("scatter", 40, 60),
        ("gemm", 150, 50),
        ("copy", 900, 100),
    ]
    host = [("step", 0, 1000), ("callback", 200, 300)]  # nested: union 1000
    events = meta + [
        {"ph": "X", "pid": pid, "tid": tid, "name": n, "ts": t, "dur": d}
        for pid, tid, rows in ((1, 7, device), (2, 3, host))
        for n, t, d in rows
    ]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_busy_time_events_and_gaps(tmp_path):
    folder = tmp_path / "run" / "plugins" / "profile" / "t"
    folder.mkdir(parents=True)
    _trace(folder / "perfetto_trace.json.gz")
    text = "\n".join(trace_summary.summarize(trace_summary.load(tmp_path), steps=2))
    assert "trace span 1.00 ms, 2 step(s)" in text
    device = text.split("[/device:GPU:0 / Stream #1]")[1].split("[/host")[0]
    assert "busy 0.125 ms/step, 2.0 events/step" in device  # 250 us, 2 steps
    assert "0.055 ms/step      1.0x  gemm" in device  # 110 us in 2 events
    assert "idle 0.750 ms in all" in device
    gaps = device.split("longest gaps:")[1].strip().splitlines()
    assert gaps[0].split() == ["0.700", "ms", "after", "gemm", "before", "copy"]
    assert gaps[1].split() == ["0.050", "ms", "after", "scatter", "before", "gemm"]
    host = text.split("[/host:CPU / python3]")[1]
    assert "busy 0.500 ms/step" in host and "idle" not in host
