"""Sharded training across processes: 2 processes x 4 CPU devices on one host.

A stand-in for multi-host GPU training: every process runs this same script;
JAX's distributed runtime (coordinator on process 0, gloo CPU collectives)
joins their devices into one 8-device mesh, the embedding tables are sharded
over all of them (row / column / data per the plan) and each process feeds its
own half of every global batch.

    # two terminals (or `&`), same port:
    python examples/multiprocess_train.py --process-id 0 --num-processes 2 --port 12355
    python examples/multiprocess_train.py --process-id 1 --num-processes 2 --port 12355
    # the single-process reference on 8 local devices:
    python examples/multiprocess_train.py --num-processes 1 --local-devices 8
    # add --collection: the tables in one EmbeddingCollection, plus two tables
    # placed table-wise (each whole on one device)
    # add --hash: a key-sharded DistributedHashEmbedding (64-bit keys, LRU
    # eviction, admission after 2 sightings) beside a row-sharded table;
    # every process prints its own table shards' records; add
    # --hash-optimizers sgd,adam,... for one such layer per sparse optimizer
    # with --hash, the one-device reference (keys in 8 host shards, as the
    # 8 devices' per-shard eviction): --num-processes 1 --local-devices 1
    # --host-shards 8
    # add --route-check (default tables): after training, count where a
    # route="locality" input stage's batches of 'user' ids really land

On real hosts, pass ``--coordinator host0:PORT`` and drop ``--local-devices``
(GPUs are found by JAX). Process 0 prints one JSON line with the per-step
losses and a checksum of every table.

Failure handling: if a peer dies, JAX's coordination service notices the
missing heartbeats (``--heartbeat-timeout`` seconds) and aborts this process;
a watchdog thread additionally exits with code 3 and a clear message if no
training step completes for ``--watchdog`` seconds (e.g. a collective waiting
on a dead peer).
"""

import argparse
import json
import os
import sys
import threading
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--coordinator", default=None, help="host:port of process 0")
    p.add_argument("--port", type=int, default=12355)
    p.add_argument("--local-devices", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64, help="global batch")
    p.add_argument("--heartbeat-timeout", type=int, default=10)
    p.add_argument("--init-timeout", type=int, default=60)
    p.add_argument("--watchdog", type=float, default=120.0)
    p.add_argument(
        "--collection",
        action="store_true",
        help="the tables (plus two table-wise ones) in one EmbeddingCollection",
    )
    p.add_argument(
        "--hash",
        action="store_true",
        help="a key-sharded DistributedHashEmbedding beside a row-sharded table",
    )
    p.add_argument(
        "--hash-capacity",
        type=int,
        default=512,
        help="with --hash: rows of the hash layer (default: fewer than its keys)",
    )
    p.add_argument(
        "--hash-optimizers",
        default="adagrad",
        help="with --hash: comma-separated sparse optimizers, one key-sharded "
        "layer 'hashed_<optimizer>' each, all reading the same keys",
    )
    p.add_argument(
        "--records-out",
        default=None,
        help="with --hash: write this process's records to this file "
        "(default: print them)",
    )
    p.add_argument(
        "--host-shards",
        type=int,
        default=None,
        help="testing, with --hash in one process: train on one device with "
        "no distribution, the hash layer's keys in one host table of this many "
        "key-owned shards (the per-shard eviction of a key-sharded run on as "
        "many devices): the one-device reference of the multi-process tests",
    )
    p.add_argument(
        "--route-check",
        action="store_true",
        help="testing, default tables: after training, pass this process's "
        "'user' ids through a route='locality' input stage and count where "
        "the routed samples' ids really land (see route_check)",
    )
    p.add_argument(
        "--die-at-step",
        type=int,
        default=None,
        help="testing: this process kills itself (SIGKILL) after that step",
    )
    return p.parse_args(argv)


ARGS = parse_args()
# Must happen before JAX initialises its CPU backend.
os.environ.setdefault("KERAS_BACKEND", "jax")
flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={ARGS.local_devices}"
    )
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
if ARGS.num_processes > 1:
    jax.distributed.initialize(
        coordinator_address=ARGS.coordinator or f"127.0.0.1:{ARGS.port}",
        num_processes=ARGS.num_processes,
        process_id=ARGS.process_id,
        initialization_timeout=ARGS.init_timeout,
        heartbeat_timeout_seconds=ARGS.heartbeat_timeout,
        shutdown_timeout_seconds=ARGS.heartbeat_timeout,
    )

import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import keras_sparse as ks  # noqa: E402

TABLES = {  # name: (rows, strategy, sparse optimizer)
    "user": (256, "row", "adagrad"),
    "item": (128, "column", "adam"),
    "country": (16, "data", "adagrad"),
}
DIM, BAG = 8, 3
# --collection adds two tables placed whole on one device each.
TABLE_WISE = {"genre": 40, "region": 24}


class Watchdog(keras.callbacks.Callback):
    """Exits the process if no step finishes within ``timeout`` seconds."""

    def __init__(self, timeout, die_at_step=None):
        super().__init__()
        self.timeout, self.die_at_step = timeout, die_at_step
        self.last = time.monotonic()
        self.losses = []
        self.step_s = []  # wall time of each step (loss read included)
        self._began = None
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        while True:
            time.sleep(1.0)
            if time.monotonic() - self.last > self.timeout:
                print(
                    f"[process {jax.process_index()}] ERROR: no training step "
                    f"finished for {self.timeout:.0f} s; a peer process is "
                    "probably gone. Exiting.",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(3)

    def on_train_batch_begin(self, batch, logs=None):
        self._began = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))
        self.step_s.append(time.perf_counter() - self._began)
        self.last = time.monotonic()
        print(f"[process {jax.process_index()}] step {batch + 1}", flush=True)
        if self.die_at_step is not None and batch + 1 >= self.die_at_step:
            os.kill(os.getpid(), 9)


HASH_IDS = 1200  # more admitted keys than the default --hash-capacity


def table_rows():
    if ARGS.hash:
        return {"user": TABLES["user"][0], "hashed": HASH_IDS}
    rows = {name: spec[0] for name, spec in TABLES.items()}
    if ARGS.collection:
        rows.update(TABLE_WISE)
    return rows


def hash_layer_names():
    return [f"hashed_{opt}" for opt in ARGS.hash_optimizers.split(",")]


def make_layers():
    if ARGS.hash:
        rows, strategy, opt = TABLES["user"]
        return [
            ks.AllToAllDenseEmbedding(
                rows, DIM, combiner="sum", optimizer=opt, sharding=strategy, name="user"
            ),
            *(
                ks.DistributedHashEmbedding(
                    DIM,
                    capacity=ARGS.hash_capacity,
                    combiner="sum",
                    optimizer=name[len("hashed_") :],
                    eviction="lru",
                    admit_after=2,
                    sharding="key",
                    name=name,
                )
                for name in hash_layer_names()
            ),
        ]
    if not ARGS.collection:
        return [
            ks.AllToAllDenseEmbedding(
                rows, DIM, combiner="sum", optimizer=opt, sharding=strategy, name=name
            )
            for name, (rows, strategy, opt) in TABLES.items()
        ]
    configs = {
        name: ks.TableConfig(rows, DIM, combiner="sum", sharding=strategy)
        for name, (rows, strategy, _) in TABLES.items()
    }
    for name, rows in TABLE_WISE.items():
        configs[name] = ks.TableConfig(rows, DIM, combiner="sum", sharding="table")
    return [ks.EmbeddingCollection(configs, optimizer="adagrad", name="tables")]


class HostShards:
    """A `ShardedHashTable` seen as one host table (no ``num_shards``), so an
    unsharded layer on one device maps its keys through it in one call."""

    def __init__(self, table):
        self._table = table

    def __getattr__(self, name):
        if name in ("num_shards", "local"):  # what marks a key-sharded table
            raise AttributeError(name)
        return getattr(self._table, name)


def hold_keys_in_shards(layer, shards):
    layer.table = HostShards(
        ks.table.ShardedHashTable(
            layer.table.capacity,
            shards,
            eviction=layer.eviction,
            admit_after=layer.admit_after,
            device="cpu",
            seed=layer.table.seed,
        )
    )


def build(layers):
    names = list(table_rows())
    inputs = [
        keras.Input(
            (BAG,), dtype="int64" if n == "hashed" else "int32", name=f"{n}_ids"
        )
        for n in names
    ]
    if ARGS.collection:
        out = layers[0](dict(zip(names, inputs)))
        pooled = [out[n] for n in names]
    elif ARGS.hash:  # every hash layer reads the same keys
        pooled = [layers[0](inputs[0]), *(layer(inputs[1]) for layer in layers[1:])]
    else:
        pooled = [layer(x) for layer, x in zip(layers, inputs)]
    h = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()(pooled))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def global_data(steps, batch):
    rng = np.random.default_rng(0)
    n = steps * batch
    x = [
        rng.integers(0, rows, size=(n, BAG)).astype("int32")
        for rows in table_rows().values()
    ]
    if ARGS.hash:  # 64-bit keys: the step sees 32 bits, the tables all 64
        x[1] = x[1].astype("int64") * 7_919_993_123 + (5 << 33)
    return x, rng.normal(size=(n, 1)).astype("float32")


def route_check(model, user_ids, batch):
    """A ``route="locality"`` stage over this process's 'user' ids (the
    row-sharded table alone, via ``feature_map``): each batch it hands out is
    placed on the devices as a step would place it
    (`jax.make_array_from_process_local_data`, Keras' multi-process input
    path), and every id a device holds whose row lives on another device's
    table shard is counted. Returns those counts with and without routing,
    and the stage's own byte counters."""
    dist = keras.distribution.distribution()
    table = model.get_layer("user").embeddings.value
    rows = {s.device: s.index[0] for s in table.addressable_shards}

    def remote(ids):
        layout = dist.get_data_layout(ids.shape).backend_layout
        placed = jax.make_array_from_process_local_data(layout, ids)
        n = 0
        for shard in placed.addressable_shards:
            r, held = rows[shard.device], np.asarray(shard.data)
            n += int(((held < (r.start or 0)) | (held >= r.stop)).sum())
        return n

    unrouted = sum(remote(b) for b in np.split(user_ids, len(user_ids) // batch))
    routed = 0
    stage = ks.data.prefetch(
        user_ids, model, batch_size=batch, route="locality",
        feature_map={"user": None},
    )  # fmt: skip
    with stage:
        stage.on_epoch_begin()
        for i in range(len(stage)):
            ids = stage[i]
            routed += remote(np.asarray(ids[0] if isinstance(ids, tuple) else ids))
        stats = stage.stats()
    return {
        "process": jax.process_index(),
        "remote_ids_routed": routed,
        "remote_ids_unrouted": unrouted,
        "bytes_per_id": ks.data.routing.remote_id_bytes(DIM),
        "stage_bytes_routed": stats["bytes_routed"],
        "stage_bytes_unrouted": stats["bytes_unrouted"],
    }


def main():
    keras.utils.set_random_seed(0)
    nproc, pid = jax.process_count(), jax.process_index()
    devices = jax.devices()
    layers = make_layers()
    if ARGS.host_shards is None:
        dist = ks.sharding.distribution(layers, devices=devices)
        dist.auto_shard_dataset = False  # each process passes its slice below
        keras.distribution.set_distribution(dist)
    model = build(layers)
    if ARGS.host_shards is not None:
        for name in hash_layer_names():
            hold_keys_in_shards(model.get_layer(name), ARGS.host_shards)
    # Same initial weights everywhere (and in the single-process reference).
    rng = np.random.default_rng(1)
    stacked = set()
    if ARGS.collection:
        stacked = {id(layers[0].stack_variables(s.name)[0]) for s in layers[0].stacks}
    for w in model.weights:
        if w.path.split("/")[-1] in ("embeddings", "kernel") or id(w) in stacked:
            w.assign(rng.normal(0, 0.1, size=w.shape).astype(w.dtype))
    # Each process feeds its contiguous slice of every global batch.
    x, y = global_data(ARGS.steps, ARGS.batch_size)
    local = ARGS.batch_size // nproc

    def mine(a):
        a = a.reshape(ARGS.steps, ARGS.batch_size, *a.shape[1:])
        return a[:, pid * local : (pid + 1) * local].reshape(-1, *a.shape[2:])

    watchdog = Watchdog(ARGS.watchdog, ARGS.die_at_step)
    model.fit(
        [mine(a) for a in x],
        mine(y),
        batch_size=local,
        shuffle=False,
        verbose=0,
        callbacks=[watchdog],
    )
    watchdog.last = time.monotonic()  # a fresh window for the final exchange
    checksums = {}
    if ARGS.collection:
        for stack in layers[0].stacks:
            table = layers[0].stack_variables(stack.name)[0].value
            full = np.asarray(multihost_utils.process_allgather(table, tiled=True))
            for name, start in stack.offsets.items():
                rows = table_rows()[name]
                checksums[name] = float(np.abs(full[start : start + rows]).sum())
    elif ARGS.hash:
        hashed = {}
        for name in hash_layer_names():
            layer = model.get_layer(name)
            hashed[name] = {
                "shards": list(getattr(layer.table, "local", ())),
                "stats": layer.stats(),
                **{k: np.asarray(v).tolist() for k, v in layer.export().items()},
            }
        line = "RECORDS " + json.dumps({"process": pid, "layers": hashed})
        if ARGS.records_out:
            with open(ARGS.records_out, "w") as f:
                f.write(line + "\n")
        else:
            print(line, flush=True)
        table = model.get_layer("user").embeddings.value
        full = np.asarray(multihost_utils.process_allgather(table, tiled=True))
        checksums["user"] = float(np.abs(full).sum())
    else:
        for name in TABLES:
            table = model.get_layer(name).embeddings.value
            full = np.asarray(multihost_utils.process_allgather(table, tiled=True))
            checksums[name] = float(np.abs(full).sum())
    if ARGS.route_check:
        check = route_check(model, mine(x[0]), local)
        print("ROUTE " + json.dumps(check), flush=True)
    if pid == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "processes": nproc,
                    "devices": len(devices),
                    "losses": watchdog.losses,
                    "step_s": watchdog.step_s,
                    "checksums": checksums,
                }
            ),
            flush=True,
        )
    if nproc > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # e.g. a collective failing because a peer died
        print(
            f"[process {ARGS.process_id}] ERROR: distributed training failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            "a peer process probably died. Exiting.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(2)  # skip the shutdown barrier, which would wait on the peer
