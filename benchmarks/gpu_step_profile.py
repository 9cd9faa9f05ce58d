"""Where a compiled step's time goes with GPU hash tables, per in-step route.

The 26-field model of ``benchmarks/hash_embedding.py`` with
``table_device="gpu"`` and raw int64 keys in ``fit``, once through the
in-place GPU-buffer callback and once through ``io_callback`` (two rounds,
interleaved). Host wall time inside the layer's table code is summed per
step: the callback body (``_gpu_rows`` / ``_map_step_keys``), the table calls
(``_lookup_or_insert``) and the full-key restore of JAX without x64. Also
the eager cost of one 8,192-key ``lookup_or_insert`` on a field that evicts
and on one whose keys all hit.

    python benchmarks/gpu_step_profile.py          # on a GPU with CuPy
"""

import collections
import functools
import os
import pathlib
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import cupy as cp  # noqa: E402
import hash_embedding as bench  # noqa: E402

from keras_sparse.data import criteo_like  # noqa: E402
from keras_sparse.layers import jax_full_keys  # noqa: E402
from keras_sparse.layers import jax_step_mapping  # noqa: E402
from keras_sparse.layers.hash_embedding import DistributedHashEmbedding  # noqa: E402
from keras_sparse.table import HashTable  # noqa: E402

SAMPLES, BATCH, CAPACITY = 1 << 16, 8192, 1 << 14
spent, calls = collections.Counter(), collections.Counter()


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t0
            calls[name] += 1

    return wrapper


def eager_ms(keys):
    table = HashTable(CAPACITY, device="gpu")
    batches = [cp.asarray(keys[i : i + BATCH]) for i in range(0, SAMPLES, BATCH)]
    for b in batches:  # fill: steady state from here
        table.lookup_or_insert(b)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        for b in batches:
            table.lookup_or_insert(b)
    cp.cuda.Device().synchronize()
    return 1e3 * (time.perf_counter() - t0) / (3 * len(batches)), table.stats()


def main():
    features, labels = criteo_like(SAMPLES, hashed_keys=True, scale=0.01, seed=0)
    keys = {f"cat_{f}": features[f"cat_{f}"] for f in range(bench.FIELDS)}
    for cls_name in ("_gpu_rows", "_map_step_keys", "_lookup_or_insert"):
        fn = getattr(DistributedHashEmbedding, cls_name)
        setattr(DistributedHashEmbedding, cls_name, timed(cls_name, fn))
    jax_full_keys.restore = timed("restore", jax_full_keys.restore)
    steps = SAMPLES // BATCH
    print(f"device: {bench.device_description()}; {bench.FIELDS} fields, batch "
          f"{BATCH}, capacity {CAPACITY:,} per field\n")  # fmt: skip
    print("| route | step ms | callback ms | table calls ms | key restore ms |")
    print("|---|---:|---:|---:|---:|")
    for gpu_buffers in (True, False, True, False):
        jax_step_mapping.GPU_BUFFERS_IN_STEP = gpu_buffers
        model = bench.hash_model(CAPACITY, table_device="gpu", key_dtype="int64")
        fit = bench.epoch_on_arrays(model, keys, labels, BATCH)
        fit()  # compiles, fills the tables
        spent.clear()
        calls.clear()
        t0 = time.perf_counter()
        fit()
        step = 1e3 * (time.perf_counter() - t0) / steps
        route = jax_step_mapping.choose_route(model.get_layer("hash_emb_0"))
        body = spent["_gpu_rows"] + spent["_map_step_keys"]
        cells = [body, spent["_lookup_or_insert"], spent["restore"]]
        print(f"| {route} | {step:.1f} | "
              + " | ".join(f"{1e3 * c / steps:.1f}" for c in cells) + " |")  # fmt: skip
    for field, what in (("cat_2", "evicting field"), ("cat_0", "small field")):
        ms, stats = eager_ms(keys[field])
        evictions = stats["evictions"]
        print(f"\neager lookup_or_insert, {BATCH:,} keys, {what} ({field}): "
              f"{ms:.2f} ms per call ({evictions:,} evictions so far)")  # fmt: skip


if __name__ == "__main__":
    main()
