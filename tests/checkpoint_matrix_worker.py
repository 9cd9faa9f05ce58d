"""One cell of the cross-backend checkpoint matrix (run as a subprocess).

    python tests/checkpoint_matrix_worker.py BACKEND DEVICES --train OUT.keras
    python tests/checkpoint_matrix_worker.py BACKEND DEVICES --load IN.keras

``BACKEND`` is jax (``DEVICES`` virtual CPU devices, `ks.distribution`),
tensorflow (``DEVICES`` logical CPU devices under ``MirroredStrategy``) or
torch (one gloo process per device: this script starts them). With
``--train`` the model trains a few steps sharded and is saved; with
``--load`` a saved model is loaded sharded. Either way the script prints one
``RESULT {json}`` line: predictions on fixed ids and every table's unsharded
saved state (values and slots), as the layers save them.
"""

import json
import os
import sys

import numpy as np

BACKEND, DEVICES = sys.argv[1], int(sys.argv[2])
MODE, PATH = sys.argv[3], sys.argv[4]
RANK = int(os.environ.get("RANK", "0"))
os.environ["KERAS_BACKEND"] = BACKEND
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if BACKEND == "jax":
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH, STEPS = 8, 3
ROWS, DIM = 41, 8  # 41 rows: row shards pad on 2, 4 and 8 devices


def make_tables():
    import keras_sparse as ks

    rows = ks.AllToAllDenseEmbedding(
        ROWS, DIM, combiner="sum", optimizer="adagrad", sharding="row", name="rows"
    )
    cols = ks.AllToAllDenseEmbedding(
        ROWS, DIM, combiner="mean", optimizer="sgd", sharding="column", name="cols"
    )
    # Key-sharded; roomy (no key is evicted or dropped on any layout), keys
    # seen once wait for admission (their counts are saved too).
    hashed = ks.DistributedHashEmbedding(
        DIM, capacity=512, combiner="sum", optimizer="adagrad", admit_after=2,
        sharding="key", name="hashed",
    )  # fmt: skip
    return rows, cols, hashed


def build_model(tables=None):
    import keras

    keras.utils.set_random_seed(0)
    rows, cols, hashed = tables or make_tables()
    a = keras.Input((3,), dtype="int32", name="a")
    b = keras.Input((2,), dtype="int32", name="b")
    k = keras.Input((2,), dtype="int64", name="k")
    x = keras.layers.Concatenate()([rows(a), cols(b), hashed(k)])
    inputs = {"a": a, "b": b, "k": k}
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(x))
    return model


def data(samples=BATCH * STEPS):
    rng = np.random.default_rng(0)
    pool = rng.integers(-(2**62), 2**62, 60)  # 64-bit keys
    x = {
        "a": rng.integers(0, ROWS, (samples, 3)).astype("int32"),
        "b": rng.integers(0, ROWS, (samples, 2)).astype("int32"),
        "k": pool[rng.integers(0, 60, (samples, 2))].astype("int64"),
    }
    return x, rng.normal(size=(samples, 1)).astype("float32")


def table_state(model):
    """Each table's saved state as the layer writes it (unsharded); the
    hash layer's per-key records and admission counts sorted by key (rows
    and table geometry depend on the layout)."""
    out = {}
    for name in ("rows", "cols", "hashed"):
        store = {}
        model.get_layer(name).save_own_variables(store)
        store = {k: np.asarray(v) for k, v in store.items()}
        if name == "hashed":
            store = _by_key(store)
        out[name] = {k: v.tolist() for k, v in store.items()}
    return out


def _by_key(store):
    order = np.argsort(store["record_keys"])
    kept = {
        k: v[order]
        for k, v in store.items()
        if k.startswith("record_") and k != "record_rows"  # rows: per layout
    }
    if "admission_keys" in store:
        pending = np.argsort(store["admission_keys"])
        for name in ("admission_keys", "admission_sightings"):
            kept[name] = store[name][pending]
    kept["table_clock"] = store["table_clock"]
    return kept


def result(model):
    x, _ = data()
    return {"predictions": np.asarray(predict(model, x)).tolist(),
            "state": table_state(model)}  # fmt: skip


# ------------------------------------------------------------ per backend
def predict(model, x):
    if BACKEND == "torch":
        import torch

        with torch.no_grad():
            out = model({k: torch.as_tensor(v) for k, v in x.items()})
        return out.detach().cpu().numpy()
    return model.predict(x, batch_size=BATCH, verbose=0)


def run_jax():
    import keras

    import keras_sparse as ks

    if MODE == "--train":
        # Planned before the build, so the padded row shards are created
        # padded.
        keras.utils.set_random_seed(0)
        tables = make_tables()
        dist = ks.distribution(list(tables), devices=DEVICES)
        keras.distribution.set_distribution(dist)
        model = build_model(tables)
        model.compile(optimizer="sgd", loss="mse")
        x, y = data()
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        model.save(PATH)
    else:
        model, dist = ks.sharding.load_model(PATH, devices=DEVICES)
        keras.distribution.set_distribution(dist)
    return model


def run_tensorflow():
    import keras
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * DEVICES
    )
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(DEVICES)])
    with strategy.scope():
        if MODE == "--train":
            model = build_model()
            model.compile(optimizer="sgd", loss="mse", jit_compile=False)
            x, y = data()
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            model.save(PATH)
        else:
            model = keras.models.load_model(PATH)
        return model, strategy


def run_torch():
    import keras
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=RANK, world_size=DEVICES)
    if MODE == "--train":
        model = build_model()
        model(data(BATCH)[0])  # build every layer
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(
            [p for p in model.parameters() if p.requires_grad], lr=0.01
        )
        x, y = data()
        local = BATCH // DEVICES
        for step in range(STEPS):
            lo = step * BATCH + RANK * local
            xb = {k: torch.as_tensor(v[lo : lo + local]) for k, v in x.items()}
            yb = torch.as_tensor(y[lo : lo + local])
            opt.zero_grad()
            loss = torch.mean((ddp(xb, training=True) - yb) ** 2)
            loss.backward()
            opt.step()
        model.save(PATH)  # every rank: the tables' save gathers their parts
    else:
        model = keras.models.load_model(PATH)
    return model


def main():
    import keras_sparse  # noqa: F401  (registers the layers for loading)

    if BACKEND == "jax":
        model = run_jax()
    elif BACKEND == "tensorflow":
        model, strategy = run_tensorflow()
    else:
        model = run_torch()
    res = result(model)  # a collective on torch: every rank computes it
    if RANK == 0:
        print("RESULT " + json.dumps(res), flush=True)
    if BACKEND == "torch":
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()  # gloo's threads must stop before exit
        sys.stdout.flush()
        # Skips C++ static destructors, which can abort ("terminate called
        # without an active exception") while a gloo thread winds down.
        os._exit(0)


if __name__ == "__main__":
    main()
