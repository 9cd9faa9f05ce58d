"""Key sharding's fresh-row reset sends each device's fresh rows to their
owners in the key exchange's slots (JAX, 8 virtual devices).

References: NumPy writes of the fresh rows (table and slots), the gathered
reset, and one device training with its keys in 8 host shards (the
per-shard eviction of a key-sharded run), evictions and admission on.
"""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse import sharding
from keras_sparse.sharding import jax_exchange_bytes
from keras_sparse.sharding import jax_key_mapping
from keras_sparse.sharding import jax_sharded_reset
from keras_sparse.table import ShardedHashTable
from tests.helpers import fit_losses

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="sharding is implemented for JAX"
)

D, SHARD_ROWS, DIM, N = 8, 16, 4, 48  # N ids per device
INIT = 0.1  # the slot's initial value


def _mesh():
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:D]), ("model",))


def _batch(seed=0):
    """Per device: global rows with repeats, each row fresh at one position
    of one device at most, and each position's rank among its device's
    distinct rows of the row's owner (the key exchange's packing)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, D * SHARD_ROWS, size=(D, N)).astype(np.int32)
    ids[:, ::7] = -1  # absent keys
    mask = np.zeros((D, N), bool)
    slot = np.zeros((D, N), np.int32)
    fresh_rows = rng.permutation(D * SHARD_ROWS)[: D * SHARD_ROWS // 2]
    seen = set()
    for dev in range(D):
        for owner in range(D):
            mine = np.unique(ids[dev][(ids[dev] // SHARD_ROWS == owner)])
            for rank, row in enumerate(mine):
                slot[dev][ids[dev] == row] = rank
        for pos, row in enumerate(ids[dev]):
            if row >= 0 and row in fresh_rows and row not in seen:
                mask[dev, pos] = True
                seen.add(row)
    values = rng.normal(size=(D * N, DIM)).astype("float32")
    return ids.reshape(-1), mask.reshape(-1), slot.reshape(-1), values


def _capacity(ids):
    """The fullest (device, owner) count of distinct rows."""
    fills = [
        np.sum(np.unique(part[part >= 0]) // SHARD_ROWS == owner)
        for part in ids.reshape(D, N)
        for owner in range(D)
    ]
    return int(max(fills))


def _reset(mesh, table, acc, ids, mask, values, slot=None, capacity=None):
    out = jax_sharded_reset.sharded_reset(
        "row",
        mesh,
        "model",
        {"table": table, "accumulator": acc},
        ids,
        mask,
        values,
        {"accumulator": INIT},
        exchange_slot=slot,
        capacity=capacity,
    )
    return np.asarray(out["table"]), np.asarray(out["accumulator"])


def test_compact_reset_writes_exactly_the_fresh_rows():
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh()
    ids, mask, slot, values = _batch()
    c = _capacity(ids)
    assert c < N and mask.sum() > 20
    rng = np.random.default_rng(1)
    table = rng.normal(size=(D * SHARD_ROWS, DIM)).astype("float32")
    acc = np.full_like(table, 5.0)
    rows = NamedSharding(mesh, P("model", None))
    args = [jax.device_put(a, rows) for a in (table, acc)]
    got_t, got_a = _reset(mesh, *args, ids, mask, values, slot, c)
    want_t, want_a = table.copy(), acc.copy()
    want_t[ids[mask]] = values[mask]
    want_a[ids[mask]] = INIT
    np.testing.assert_array_equal(got_t, want_t)
    np.testing.assert_array_equal(got_a, want_a)
    # The gathered reset (no packing) writes the same.
    gathered = _reset(mesh, *args, ids, mask, values)
    np.testing.assert_array_equal(gathered[0], want_t)

    def compiled(**packing):
        def arg(shape, dtype, spec):
            sharding = NamedSharding(mesh, P(*spec))
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        lowered = jax.jit(
            lambda t, a, i, m, v, s: jax_sharded_reset.sharded_reset(
                "row",
                mesh,
                "model",
                {"table": t, "accumulator": a},
                i,
                m,
                v,
                {"accumulator": INIT},
                s if packing else None,
                **packing,
            )  # fmt: skip
        ).lower(
            arg(table.shape, "float32", ("model", None)),
            arg(table.shape, "float32", ("model", None)),
            arg(ids.shape, "int32", ("model",)),
            arg(mask.shape, "bool", ("model",)),
            arg(values.shape, "float32", ("model", None)),
            arg(slot.shape, "int32", ("model",)),
        )
        text = lowered.compile().as_text()
        return jax_exchange_bytes.hlo_collective_bytes(text, D)

    compact, full = compiled(capacity=c), compiled()
    assert "all-gather" not in compact and compact["total"] == D * c * (4 + DIM * 4)
    assert full["total"] == N * (4 + 1 + DIM * 4)
    reported = jax_exchange_bytes.exchange_bytes(
        "row", D * SHARD_ROWS, DIM, D * N, D, reset=True, capacity=c,
        reset_capacity=c,
    )  # fmt: skip
    assert reported["reset"] == compact["total"]


class _HostShards:
    """A `ShardedHashTable` as one host table (no ``num_shards``): the
    single-device layer maps through it with the per-shard eviction."""

    def __init__(self, table):
        self._table = table

    def __getattr__(self, name):
        if name in ("num_shards", "local"):
            raise AttributeError(name)
        return getattr(self._table, name)


def test_key_sharded_training_resets_like_one_device(monkeypatch):
    """Evictions and admission: rows are reused by new keys every step, so
    a fresh row left unreset (or reset twice, or on the wrong owner) would
    show in a key's vector or slot."""
    compact = []
    real = jax_sharded_reset.sharded_reset

    def spy(*args, exchange_slot=None, capacity=None, **kwargs):
        n = args[4].shape[0] // D
        packed = jax_sharded_reset.compact_reset_capacity(
            args[0], n, exchange_slot, capacity
        )
        compact.append(packed)
        return real(*args, exchange_slot=exchange_slot, capacity=capacity, **kwargs)

    monkeypatch.setattr(jax_sharded_reset, "sharded_reset", spy)
    batch, steps, bag = 128, 6, 3
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 900, size=(batch * steps, bag)) * 7_919_993_123 + (5 << 33)
    y = rng.normal(size=(batch * steps, 1)).astype("float32")

    def train(devices):
        layer = ks.DistributedHashEmbedding(
            DIM, capacity=512, combiner="sum", optimizer="adagrad",
            eviction="lru", admit_after=2, sharding="key", name="hashed",
        )  # fmt: skip
        if devices:
            dist = sharding.distribution([layer], devices=devices)
            keras.distribution.set_distribution(dist)
        try:
            inp = keras.Input((bag,), dtype="int64")
            out = keras.layers.Dense(1, kernel_initializer="ones")(layer(inp))
            model = keras.Model(inp, out)
            model.compile(keras.optimizers.SGD(0.05), "mse")
            if not devices:
                layer.table = _HostShards(
                    ShardedHashTable(
                        512,
                        D,
                        eviction="lru",
                        admit_after=2,
                        device="cpu",
                        seed=layer.table.seed,
                    )  # fmt: skip
                )
            return fit_losses(model, keys, y, batch), layer
        finally:
            keras.distribution.set_distribution(None)

    ref_losses, ref = train(None)
    losses, got = train(D)
    c = jax_key_mapping.key_capacity(batch * bag // D, D)
    assert compact and set(compact) == {c} and c < batch * bag // D
    stats = got.stats()
    assert stats["evictions"] > 50 and stats["rejected_admissions"] > 0
    for name in ("inserts", "evictions", "rejected_admissions", "hits"):
        assert stats[name] == ref.stats()[name], name
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=1e-5)
    want, have = ref.export(), got.export()
    order, ref_order = np.argsort(have["keys"]), np.argsort(want["keys"])
    np.testing.assert_array_equal(have["keys"][order], want["keys"][ref_order])
    for name in ("values", "accumulator"):
        np.testing.assert_allclose(
            have[name][order], want[name][ref_order], atol=1e-5, err_msg=name
        )
