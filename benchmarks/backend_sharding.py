"""Sharded vs replicated tables on every backend: memory, bytes, samples/s.

One model per run: an `AllToAllDenseEmbedding` of ``--rows`` x ``--dim``
(adagrad, 8 ids per sample, summed) -> Dense(64) -> Dense(1), trained with
the sparse optimizer in the backward pass, for ``--steps`` timed steps of a
global batch of ``--batch`` after one warm-up step. Each cell is a fresh
subprocess (or, on PyTorch, ``D`` gloo processes):

- JAX: ``D`` virtual CPU devices, `ks.distribution` with the table planned
  "data" (replicated) or "row";
- TensorFlow: ``D`` logical CPU devices under ``MirroredStrategy``, the
  layer's ``sharding`` "data" or "row";
- PyTorch: ``D`` processes (gloo), the model in DistributedDataParallel,
  a torch loop, the layer's ``sharding`` "data" or "row"; as ``torchrun``
  does, each of several processes gets ``OMP_NUM_THREADS`` (here the cores
  over ``D``, at least 1) unless it is set (``--torch-threads`` sets it).

Columns: samples/s (global); table + slot bytes held per device, read from
the variables (the part each device holds: logical CPU devices share one
heap, so the variables, not the process, tell what a device would need);
bytes each device hands to collectives per step for the table's ids,
vectors and gradients (the formulas each backend's sharding module states,
for this step's ids); and the largest table (rows) whose table and slots fit
``--budget-mib`` per device, replicated vs sharded.

On a 2-core CPU machine the devices share the cores, so samples/s measure
overheads, not a cluster; memory and bytes are the portable part.

    python benchmarks/backend_sharding.py [--backends jax,tensorflow,torch]
        [--devices 1,2,4] [--rows 200000] [--dim 32] [--batch 1024]
        [--steps 10] [--budget-mib 1024] [--torch-threads N]
"""

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
IDS = 8  # ids per sample


# ------------------------------------------------------------------ worker
def _model(rows, dim, sharding):
    import keras

    import keras_sparse as ks

    keras.utils.set_random_seed(0)
    ids = keras.Input((IDS,), dtype="int32")
    table = ks.AllToAllDenseEmbedding(
        rows, dim, combiner="sum", optimizer="adagrad", sharding=sharding, name="t"
    )
    x = keras.layers.Dense(64, activation="relu")(table(ids))
    return keras.Model(ids, keras.layers.Dense(1)(x))


def _data(rows, batch, steps, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    n = batch * (steps + 1)
    x = rng.integers(0, rows, (n, IDS)).astype("int32")
    return x, rng.normal(size=(n, 1)).astype("float32")


def _timed_fits(model, x, y, batch):
    """Seconds of the faster of two fits over all but the first batch
    (a one-batch fit compiles first)."""
    model.fit(x[:batch], y[:batch], batch_size=batch, verbose=0)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        model.fit(x[batch:], y[batch:], batch_size=batch, verbose=0)
        times.append(time.perf_counter() - start)
    return min(times)


def _part_bytes(shapes):
    total = 0
    for shape in shapes:
        count = 1
        for d in shape:
            count *= int(d)
        total += 4 * count
    return total


def _worker_jax(args, devices, mode):
    import keras

    import keras_sparse as ks

    # Planned from an unbuilt layer of the same name (its `sharding` pins
    # the strategy), so the model is built under the distribution.
    probe = ks.AllToAllDenseEmbedding(
        args.rows, args.dim, optimizer="adagrad", sharding=mode, name="t"
    )
    keras.distribution.set_distribution(ks.distribution([probe], devices=devices))
    model = _model(args.rows, args.dim, mode)
    model.compile(optimizer="sgd", loss="mse")
    x, y = _data(args.rows, args.batch, args.steps)
    elapsed = _timed_fits(model, x, y, args.batch)
    layer = model.get_layer("t")
    variables = [layer.embeddings, *layer.slots.values()]
    shapes = [v.value.addressable_shards[0].data.shape for v in variables]
    return elapsed, _part_bytes(shapes)


def _worker_tensorflow(args, devices, mode):
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * devices
    )
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(devices)])
    with strategy.scope():
        model = _model(args.rows, args.dim, mode)
        model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    x, y = _data(args.rows, args.batch, args.steps)
    elapsed = _timed_fits(model, x, y, args.batch)
    layer = model.get_layer("t")
    shapes = []
    for variable in [layer.embeddings, *layer.slots.values()]:
        parts = strategy.experimental_local_results(variable.value)
        shapes.append(parts[0].shape)
    return elapsed, _part_bytes(shapes)


def _worker_torch(args, devices, mode):
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=devices)
    model = _model(args.rows, args.dim, mode)
    x, y = _data(args.rows, args.batch, args.steps)
    local = args.batch // devices
    ddp = torch.nn.parallel.DistributedDataParallel(model) if devices > 1 else model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01)

    def step(i):
        lo = i * args.batch + rank * local
        xb = torch.as_tensor(x[lo : lo + local])
        yb = torch.as_tensor(y[lo : lo + local])
        opt.zero_grad()
        loss = torch.mean((ddp(xb, training=True) - yb) ** 2)
        loss.backward()
        opt.step()
        return float(loss)

    step(0)
    if devices > 1:
        dist.barrier()
    start = time.perf_counter()
    for i in range(1, args.steps + 1):
        step(i)
    if devices > 1:
        dist.barrier()
    elapsed = time.perf_counter() - start
    layer = model.get_layer("t")
    shapes = [tuple(v.shape) for v in [layer.embeddings, *layer.slots.values()]]
    dist.destroy_process_group()
    return elapsed, _part_bytes(shapes)


def _exchange_bytes(backend, mode, devices, batch, dim):
    """Bytes one device hands to collectives per training step for the
    table (ids, vectors, gradients), per each backend's stated exchanges."""
    n = batch // devices * IDS  # ids per device
    total = devices * n
    if devices == 1:
        return 0
    if backend == "jax":
        from keras_sparse.sharding import exchange_bytes

        return int(exchange_bytes(mode, 0, dim, total, devices)["total"])
    if backend == "tensorflow":
        if mode == "data":
            return 4 * total * (dim + 1)
        return 4 * total + 4 * total * dim + 4 * total * dim
    if mode == "data":  # torch: ids and gradients all-gathered
        return (8 * devices + 8 * n) * devices + 4 * n * dim * devices
    # torch row: int32 id blocks with 3-word headers, a capacity a quarter
    # above the largest block (about n / D for uniform ids), vectors, grads.
    capacity = -(-n * 5 // (4 * devices))
    return 4 * devices * (3 + capacity) + 4 * n * dim + 4 * n * dim


def worker(args):
    backend, devices, mode = args.worker
    devices = int(devices)
    run = {"jax": _worker_jax, "tensorflow": _worker_tensorflow, "torch": _worker_torch}
    elapsed, table_bytes = run[backend](args, devices, mode)
    if int(os.environ.get("RANK", "0")) == 0:
        result = {
            "samples_per_s": args.batch * args.steps / elapsed,
            "table_bytes": table_bytes,
            "exchange_bytes": _exchange_bytes(
                backend, mode, devices, args.batch, args.dim
            ),
        }
        print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------ driver
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cell(args, backend, devices, mode):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("XLA_FLAGS", None)
    if backend == "jax":
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    ranks = devices if backend == "torch" else 1
    if args.torch_threads:
        env["OMP_NUM_THREADS"] = str(args.torch_threads)
    elif ranks > 1 and "OMP_NUM_THREADS" not in env:
        # As torchrun: more OpenMP threads than cores leaves a process that
        # waits in a collective spinning on the cores its peer computes on.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
    port = str(_free_port())
    argv = [sys.executable, __file__, "--worker", backend, str(devices), mode]
    argv += ["--rows", str(args.rows), "--dim", str(args.dim)]
    argv += ["--batch", str(args.batch), "--steps", str(args.steps)]
    procs = []
    for rank in range(ranks):
        env_rank = dict(env, RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(
            subprocess.Popen(
                argv,
                env=env_rank,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
        )
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    for out, proc in zip(outs, procs):
        if proc.returncode != 0:
            raise RuntimeError(f"{backend} x{devices} {mode} failed:\n{out[-3000:]}")
    line = [ln for ln in outs[0].splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="jax,tensorflow,torch")
    parser.add_argument("--devices", default="1,2,4")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--budget-mib", type=float, default=1024)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="OMP_NUM_THREADS of every torch process (default: as torchrun)",
    )
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.worker:
        worker(args)
        return
    budget = args.budget_mib * 2**20
    print(
        f"rows {args.rows:,}, dim {args.dim}, adagrad, global batch {args.batch}, "
        f"{IDS} ids/sample, {args.steps} timed steps; budget "
        f"{args.budget_mib:g} MiB/device\n"
    )
    header = (
        "| backend | devices | sharding | samples/s | vs 1 device | table+slots "
        "MiB/device | collective KiB/device/step | largest table (rows) |"
    )
    print(header)
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for backend in args.backends.split(","):
        base = None
        for devices in [int(d) for d in args.devices.split(",")]:
            modes = ["data"] if devices == 1 else ["data", "row"]
            for mode in modes:
                res = _cell(args, backend, devices, mode)
                base = base or res["samples_per_s"]
                # Rows that fit the budget at this cell's bytes per row per
                # device (read from the variables, padding included).
                largest = int(budget * args.rows / res["table_bytes"])
                print(
                    f"| {backend} | {devices} | {mode} | {res['samples_per_s']:,.0f} "
                    f"| {res['samples_per_s'] / base:.2f}x "
                    f"| {res['table_bytes'] / 2**20:.2f} "
                    f"| {res['exchange_bytes'] / 1024:,.1f} | {largest:,} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
