"""Thread counts follow the CPUs the process may use, not the machine's."""

import os

import pytest

from keras_sparse.ops import cpu_threads

pytestmark = pytest.mark.backend_independent


def _write(path, text):
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "cpu_max, want", [("max 100000\n", None), ("150000 100000\n", 1.5)]
)
def test_cgroup_v2_quota(tmp_path, cpu_max, want):
    v2 = _write(tmp_path / "cpu.max", cpu_max)
    assert cpu_threads.cgroup_cpu_quota(v2, ("/nonexistent",) * 2) == want


@pytest.mark.parametrize("quota, want", [("-1", None), ("50000", 0.5)])
def test_cgroup_v1_quota(tmp_path, quota, want):
    v1 = (
        _write(tmp_path / "cfs_quota_us", quota + "\n"),
        _write(tmp_path / "cfs_period_us", "100000\n"),
    )
    assert cpu_threads.cgroup_cpu_quota(str(tmp_path / "none"), v1) == want


@pytest.mark.parametrize(
    "affinity, quota, want",
    [({0, 1, 2, 3}, None, 4), ({0, 1, 2, 3}, 1.5, 2), ({3}, None, 1), ({0}, 0.2, 1)],
)
def test_available_cpus_is_affinity_capped_by_quota(monkeypatch, affinity, quota, want):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: affinity, raising=False)
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: quota)
    assert cpu_threads.available_cpus() == want


def test_torch_update_pool_never_exceeds_the_usable_cpus(monkeypatch):
    torch = pytest.importorskip("torch")
    from keras_sparse.ops.torch import lookup as torch_lookup

    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    for affinity, jobs, want in [({0}, 26, 1), ({0, 1, 2}, 26, 3), ({0, 1, 2}, 2, 2)]:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, a=affinity: a)
        assert torch_lookup.update_workers(jobs) == want, (affinity, jobs)
    # A job alone never splits, whatever the CPUs.
    assert torch_lookup.update_workers(1) == 1
