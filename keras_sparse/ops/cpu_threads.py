"""How many CPUs this process may actually run on.

``os.cpu_count()`` counts the machine's CPUs; a process pinned to fewer
(``taskset``, ``os.sched_setaffinity``) or given a CPU quota by its
container's cgroup gets less. Threads beyond what it gets only queue for
the same cores and hand work back and forth slower.
"""

import math
import os

_CGROUP_V2 = "/sys/fs/cgroup/cpu.max"
_CGROUP_V1 = (
    "/sys/fs/cgroup/cpu/cpu.cfs_quota_us",
    "/sys/fs/cgroup/cpu/cpu.cfs_period_us",
)


def available_cpus():
    """CPUs this process may use: its affinity mask, capped by the cgroup's
    CPU quota (rounded up), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def cgroup_cpu_quota(v2=_CGROUP_V2, v1=_CGROUP_V1):
    """The cgroup's CPU quota in CPUs (e.g. 1.5), or None without one."""
    try:
        with open(v2) as f:
            quota, period = f.read().split()[:2]
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(v1[0]) as f:
            quota = int(f.read())
        with open(v1[1]) as f:
            period = int(f.read())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None
