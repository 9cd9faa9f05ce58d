"""Smoke run of benchmarks/peers.py --quick, so that the script cannot rot.

Runs the current Keras backend's keras-sparse variants (layers and
collection), each in its own process as the benchmark does, at tiny sizes,
and checks the markdown table it prints.
"""

import pathlib
import re
import subprocess
import sys

import keras
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHORT = {"jax": "jax", "tensorflow": "tf", "torch": "torch"}


def _table_rows(args, variants, width):
    """Runs a benchmark script; its markdown rows ``{variant: cells}`` of
    ``width`` cells, checked to cover exactly ``variants``."""
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    rows = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == width and cells[0] in variants:
            rows[cells[0]] = cells
    assert sorted(rows) == sorted(variants), out[-4000:]
    return rows


def test_peers_quick_prints_positive_step_times(tmp_path):
    short = SHORT[keras.backend.backend()]
    variants = [f"ks-{short}-layers", f"ks-{short}-collection"]
    # One torch thread: the other test lane shares the two cores, and
    # torch's OpenMP pool slows down many times when oversubscribed.
    args = ["benchmarks/peers.py", "--quick", "--torch-threads", "1",
            "--variants", ",".join(variants), "--out", str(tmp_path)]  # fmt: skip
    rows = _table_rows(args, variants, 7)
    for name, (_, table_rows, ms, ratio, cpu, cpu_ratio, rss) in rows.items():
        assert table_rows == "1e+04", (name, table_rows)
        assert re.fullmatch(r"\d+\.\d", ms) and float(ms) > 0, (name, ms)
        assert re.fullmatch(r"\d+\.\d", cpu) and float(cpu) > 0, (name, cpu)
        # no torchrec in the quick run
        assert ratio == cpu_ratio == "-", (name, ratio, cpu_ratio)
        assert float(rss) > 0, (name, rss)
    assert (tmp_path / "peers.png").stat().st_size > 0


def test_peers_together_prints_the_growth_of_each_process(tmp_path):
    """``--together``: both sizes trained in one child per round, and the
    growth table's ratio equals the two sizes' medians (TensorFlow only:
    the parent's code is the same for every backend)."""
    import pytest

    if keras.backend.backend() != "tensorflow":
        pytest.skip("one backend suffices")
    variant = "ks-tf-layers"
    args = ["benchmarks/peers.py", "--quick", "--together", "--rows", "1e3,1e4",
            "--steps", "4", "--epochs", "2", "--variants", variant,
            "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    medians, growth = {}, None
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == variant and len(cells) == 7:
            medians[cells[1]] = float(cells[2])
        elif cells[0] == variant and len(cells) == 3:
            growth, per_process = cells[1], cells[2]
    assert sorted(medians) == ["1e+03", "1e+04"], done.stdout
    small, large = medians["1e+03"], medians["1e+04"]
    want = large / small
    # The medians are printed to 0.05 ms, the growth to 0.005.
    slack = want * (0.05 / small + 0.05 / large) + 0.005
    assert growth.endswith("x") and abs(float(growth[:-1]) - want) <= slack, growth
    assert float(per_process) > 0, done.stdout  # one round: one process's ratio
    assert "rows=1e+03+1e+04" in done.stdout  # one child trained both sizes


def test_many_fields_quick_prints_every_variant():
    """benchmarks/many_fields.py --quick (JAX): each variant's row with a
    positive step time and a finite loss."""
    import pytest

    if keras.backend.backend() != "jax":
        pytest.skip("the benchmark runs on JAX")
    variants = ("keras", "dense", "dense-sorted", "hash-cpu")
    rows = _table_rows(["benchmarks/many_fields.py", "--quick"], variants, 4)
    for name, (_, ms, ratio, loss) in rows.items():
        assert float(ms) > 0 and ratio.endswith("x"), (name, ms, ratio)
        assert 0 < float(loss) < 10, (name, loss)


def test_switch_ab_quick_prints_both_settings():
    """benchmarks/switch_ab.py --quick (JAX): a row per setting of the
    forward-rows switch, positive step times and the same last loss."""
    import pytest

    if keras.backend.backend() != "jax":
        pytest.skip("the benchmark runs on JAX")
    rows = _table_rows(["benchmarks/switch_ab.py", "--quick"], ["off", "on"], 4)
    for name, (_, median, p25, _) in rows.items():
        assert float(median) > 0 and float(p25) > 0, (name, median, p25)
    np.testing.assert_allclose(float(rows["on"][3]), float(rows["off"][3]), rtol=1e-5)


def test_switch_ab_compares_the_forms_at_the_same_loss():
    """``--compare-forms`` (TensorFlow lane): a row per form, positive step
    times, and the same last loss (a collection learns what its tables
    would as separate layers)."""
    import pytest

    if keras.backend.backend() != "tensorflow":
        pytest.skip("one backend suffices")
    args = ["benchmarks/switch_ab.py", "--quick", "--compare-forms"]
    rows = _table_rows(args, ["layers", "collection"], 4)
    for name, (_, median, p25, _) in rows.items():
        assert float(median) > 0 and float(p25) > 0, (name, median, p25)
    assert rows["collection"][3] == rows["layers"][3]


def test_dense_route_prints_every_route():
    """benchmarks/dense_route.py (JAX) at a tiny size: a positive time for
    each route, the compiled call's among them where it can be built."""
    import pytest

    if keras.backend.backend() != "jax":
        pytest.skip("the benchmark runs on JAX")
    from keras_sparse.ops.jax import native_rows as jax_native_rows

    routes = 3 if jax_native_rows.library() is not None else 2
    args = ["benchmarks/dense_route.py", "--rows", "64", "--ids-per-row", "0.5",
            "--steps", "2"]  # fmt: skip
    rows = _table_rows(args, ["64"], 3 + 2 * routes)
    times = [float(cell) for cell in rows["64"][3:]]
    assert all(t > 0 for t in times), times


def test_concurrent_inference_quick_prints_equal_outputs():
    """benchmarks/concurrent_inference.py --quick: a row per thread count,
    positive calls/s, threaded outputs equal to sequential ones (PyTorch
    only: tests/test_concurrent_inference.py covers every backend)."""
    import pytest

    if keras.backend.backend() != "torch":
        pytest.skip("one backend suffices")
    rows = _table_rows(
        ["benchmarks/concurrent_inference.py", "--quick"], ("1", "2", "4"), 5
    )
    for threads, (_, rate, ratio, equal, _) in rows.items():
        assert float(rate.replace(",", "")) > 0 and ratio.endswith("x"), threads
        assert equal == "True", threads


def test_row_store_training_quick_reopens_the_disk_store(tmp_path):
    """benchmarks/row_store_training.py --quick --reopen (JAX): the disk
    variant's row has positive samples/s and CPU time per step, a hit
    rate, memory peaks, init and reopen times (the reopened rows are
    checked equal in the child), and its store folder is gone afterwards."""
    import pytest

    if keras.backend.backend() != "jax":
        pytest.skip("the benchmark's code is the same on every backend")
    args = ["benchmarks/row_store_training.py", "--quick", "--layer", "dense",
            "--variants", "disk", "--reopen", "--store-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    row = [line.split() for line in done.stdout.splitlines() if line[:5] == "disk "]
    assert len(row) == 1, out[-4000:]
    _, rate, ratio, cpu, hits, moved, _, read, rss, anon, _, init, *rest = row[0]
    reopen, ahead = rest
    assert float(rate) > 0 and ratio == "1.00x" and float(cpu) > 0, row
    assert 0 < float(hits[:-1]) < 100 and float(moved) > 0, row  # a cache of 10%
    assert float(read) >= 0 and float(rss) >= float(anon) > 0, row
    assert float(init) > 0, row
    assert float(reopen) > 0, row
    assert ahead == "0%", row  # mapped ahead only through the stage (--stage)
    assert list(tmp_path.iterdir()) == []  # the store was deleted


def test_table_precision_quick_prints_both_tasks(tmp_path):
    """benchmarks/table_precision.py --quick (JAX): per task a float32 and a
    bf16+SR row with a finite metric (AUC in (0, 1), RMSE > 0), float32's
    own delta and ratios exactly zero / 1.00x, bf16's table+slot bytes
    half of float32's, and the ratings tables' bytes those of NumPy's
    count ((943 + 1682) rows x (16 + 1) float32 columns, SGD: no slots);
    ``--combine`` of its output prints the same rows."""
    import pytest

    if keras.backend.backend() != "jax":
        pytest.skip("the benchmark's code is the same on every backend")
    args = ["benchmarks/table_precision.py", "--quick", "--variants", "bf16+SR"]
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    rows = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[1] in ("float32", "bf16+SR"):
            rows[cells[0], cells[1]] = cells[2:]
    tasks = ("dlrm AUC", "ratings RMSE lr=0.5")
    want_rows = [(t, v) for t in tasks for v in ("float32", "bf16+SR")]
    assert sorted(rows) == sorted(want_rows), out[-4000:]
    for (task, variant), (metric, delta, _, ratio, ms, step) in rows.items():
        metric, ms = float(metric), float(ms)
        assert np.isfinite(metric) and metric > 0 and np.isfinite(ms) and ms > 0
        assert metric < 1 or task != "dlrm AUC", (task, metric)
        if variant == "float32":
            assert (delta, ratio, step) in (("+0.0000", "1.00x", "1.00x"),
                                            ("+0.00%", "1.00x", "1.00x"))  # fmt: skip
        else:
            assert ratio == "0.50x" and step.endswith("x"), (task, ratio, step)
    want = (943 + 1682) * (16 + 1) * 4 / 2**20
    assert float(rows["ratings RMSE lr=0.5", "float32"][2]) == float(f"{want:.3g}")
    # --combine rebuilds the same rows from the printed ``run |`` lines.
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "table_precision", ROOT / "benchmarks" / "table_precision.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "out.txt").write_text(done.stdout)
    combined = {(r[0], r[1]): r[2:] for r in module.combine([tmp_path / "out.txt"])}
    assert combined == rows
