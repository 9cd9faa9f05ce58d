"""One table's JAX sparse update: the sparse route vs the dense route.

Three routes per row of the table: XLA's sparse route, the dense route, and
(on a CPU, where it can be built) the compiled call of
`keras_sparse.ops.jax.native_rows`, which the layers take first.

Times the backward pass of the JAX lookup primitive alone (jitted, state
donated as Keras' trainer does) with each route forced, for several table
sizes and ids per step, uniform or Zipf ids, and sparse Adam. The sparse
route finds the distinct ids by the dedup scratch (as an unsharded layer
does) and updates only their rows; the dense route scatter-adds the
gradients into the whole table and updates the touched rows by a mask
(`keras_sparse.ops.dense_row_updates`). The ratio sparse / dense is where
`dense_row_updates.ROWS_PER_ID` comes from.

    python benchmarks/dense_route.py                     # rows 1e4..1e6
    python benchmarks/dense_route.py --rows 8192 --dim 4 --ids-per-row 5
"""

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from keras_sparse import optimizers  # noqa: E402
from keras_sparse.ops import dense_row_updates  # noqa: E402
from keras_sparse.ops import row_updates  # noqa: E402
from keras_sparse.ops.jax import lookup as jax_lookup  # noqa: E402
from keras_sparse.ops.jax import native_rows as jax_native_rows  # noqa: E402


def make_step(optimizer, rows, route):
    """A jitted step ``(table, slots, scratch, ids, grads) -> the same``."""
    config = jax_lookup._Config(optimizer, None)

    def step(table, slots, scratch, ids, grads):
        dense_row_updates.FORCE_DENSE_ROUTE = route == "dense"
        jax_native_rows.FUSED_OPTIMIZERS = route == "compiled"
        valid = ids >= 0
        segments = None
        if route == "sparse":
            scratch, segments = row_updates.scratch_segments(scratch, ids, valid, rows)

        def lookup(t, s):
            return jax_lookup._lookup(config, t, s, ids, valid, 0, segments)[0]

        _, vjp = jax.vjp(lookup, table, slots)
        table, slots = vjp(grads)
        return table, slots, scratch

    return jax.jit(step, donate_argnums=(0, 1, 2))


def draw_ids(rng, rows, n, zipf):
    if zipf:
        return ((rng.zipf(1.05, n) - 1) % rows).astype(np.int32)
    return rng.integers(0, rows, n, dtype=np.int32)


def time_route(optimizer, rows, dim, ids, grads, route, steps):
    table = jnp.asarray(np.random.default_rng(0).normal(size=(rows, dim)), "float32")
    slots = {
        s.name: jnp.full(s.shape(rows, dim), s.initial_value, "float32")
        for s in optimizer.slot_specs()
    }
    scratch = jnp.zeros((rows + 1,), "int32")
    step = make_step(optimizer, rows, route)
    state = step(table, slots, scratch, ids, grads)  # compile
    jax.block_until_ready(state)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state = jax.block_until_ready(step(*state, ids, grads))
        times.append(time.perf_counter() - t0)
    dense_row_updates.FORCE_DENSE_ROUTE = None
    jax_native_rows.FUSED_OPTIMIZERS = True
    return 1e3 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1e4,1e5,1e6")
    parser.add_argument("--dim", type=int, default=4)
    parser.add_argument("--ids-per-row", default="0.03125,0.0625,0.125,0.25,1,5")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    optimizer = optimizers.Adam(1e-3)
    rng = np.random.default_rng(0)
    print(f"device: {jax.devices()[0]}, dim {args.dim}, sparse Adam, median ms\n")
    routes = ["sparse", "dense"]
    if jax_native_rows.fused_rule(optimizer, None, jnp.zeros((1, 1))) is not None:
        routes.append("compiled")
    header = [f"{r} {ids}" for ids in ("uniform", "zipf") for r in routes]
    print("| rows | ids / row | ids | " + " | ".join(header) + " |")
    print("|---:|---:|---:|" + "---:|" * len(header))
    for rows in (int(float(r)) for r in args.rows.split(",")):
        for per_row in (float(f) for f in args.ids_per_row.split(",")):
            n = max(1, int(rows * per_row))
            grads = jnp.asarray(rng.normal(size=(n, args.dim)), "float32")
            cells = []
            for zipf in (False, True):
                ids = jnp.asarray(draw_ids(rng, rows, n, zipf))
                for route in routes:
                    ms = time_route(
                        optimizer, rows, args.dim, ids, grads, route, args.steps
                    )
                    cells.append(f"{ms:.2f}")
            print(f"| {rows:,} | {per_row:g} | {n:,} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
