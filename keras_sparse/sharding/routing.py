"""Which placement a layer's lookups take, and where a hash layer's keys
are mapped.

Hash layers: a key-sharded `DistributedHashEmbedding` (strategy "key") gets
a `keras_sparse.table.ShardedHashTable` with one shard per device when it is
built (`place_hash_table`); its ``[D * B, dim]`` table and slots are laid out
like a row-sharded table, its step maps keys on their owners
(`map_keys_in_step`, `jax_key_mapping`) and then looks the rows up as row
sharding does. Under "data", "row" or "column" the layer keeps one host
table per process, which one process cannot share with another
(`check_hash_layer_processes`). The rows a step assigns are re-initialized by
`jax_sharded_reset.sharded_reset` on the devices holding them, before the
sharded lookup.
"""

import dataclasses

import keras

from keras_sparse.layers.hash import table_users
from keras_sparse.sharding import plan_spec
from keras_sparse.sharding.jax_placement import JaxMeshPlacement

_ROUTED = ("row", "column", "key")


def check_hash_layer_processes(layer, strategy, process_count=None):
    """Raises for a `DistributedHashEmbedding` planned with one host key map
    (any strategy but "key") in a multi-process run: each process would fill
    its own map from its own keys, giving one row to different keys."""
    if strategy == "key" or not plan_spec.is_hash_layer(layer):
        return
    if process_count is None:
        import jax

        process_count = jax.process_count()
    if process_count > 1:
        raise ValueError(
            f"Layer '{layer.name}': with sharding={strategy!r} a "
            "DistributedHashEmbedding maps keys in one host table per "
            f"process, which cannot be shared by this run's {process_count} "
            "processes. Use sharding='key' (each device owns its keys' "
            "table shard and rows), the planner's choice for hash layers "
            "in multi-process runs."
        )


def route(layer):
    """The layer's `TablePlacement` when its lookup must be routed, else None.

    On TensorFlow and PyTorch: the placement the layer was built with
    (`build_placement`). On JAX: made per call, a `JaxMeshPlacement`
    when a ``ModelParallel`` distribution is active and the layer's
    strategy (from `distribution` or its own ``sharding``) is row, column
    or key; None (the unchanged single-device path) otherwise.
    """
    if keras.backend.backend() != "jax":
        return getattr(layer, "placement", None)
    dist = keras.distribution.distribution()
    if dist is None or not isinstance(dist, keras.distribution.ModelParallel):
        return None
    planned = getattr(dist, "keras_sparse_strategies", {})
    if layer.name in planned:
        strategy = planned[layer.name]
        axis = dist.keras_sparse_axis
    else:
        strategy = getattr(layer, "_ks_strategy", None) or layer.sharding
        axis = getattr(layer, "_ks_axis", None) or "model"
    if strategy not in _ROUTED or not plan_spec.is_shardable_layer(layer):
        return None
    check_hash_layer_processes(layer, strategy)
    mesh = dist.device_mesh
    if axis not in mesh.axis_names:
        return None
    slack = getattr(dist, "keras_sparse_row_exchange_slack", None)
    return JaxMeshPlacement(strategy, mesh.backend_mesh, axis, slack)


def build_placement(layer):
    """The placement ``layer`` (about to create its variables) is built
    with on TensorFlow or PyTorch, where a sharded table's variables hold
    only this device's part; None on JAX (`route` decides per call) and
    for a local table."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        from keras_sparse.sharding import tf_key_placement
        from keras_sparse.sharding import tf_placement

        if layer.keras_sparse_kind == "hash":  # key sharding
            return tf_key_placement.build_placement(layer)
        return tf_placement.build_placement(layer)
    if backend == "torch":
        from keras_sparse.sharding import torch_key_placement
        from keras_sparse.sharding import torch_placement

        if plan_spec.is_hash_layer(layer):  # key-sharded across processes
            return torch_key_placement.build_placement(layer)
        return torch_placement.build_placement(layer)
    return None


def _key_shards(layer):
    """``(D, local mesh positions, routing)`` of a key-sharded layer under
    the active distribution, else None; on PyTorch ``(D, (rank,), None)``
    across the tables' processes (`torch_key_placement.key_shards`); on
    TensorFlow ``(D, this process's replicas, None)`` under a
    (MultiWorker)MirroredStrategy (`tf_key_placement`)."""
    if keras.backend.backend() == "torch":
        from keras_sparse.sharding import torch_key_placement

        return torch_key_placement.key_shards(layer)
    if keras.backend.backend() == "tensorflow":
        from keras_sparse.sharding import tf_key_placement

        return tf_key_placement.key_shards(layer)
    routing = route(layer)
    if not isinstance(routing, JaxMeshPlacement) or routing.strategy != "key":
        return None
    import jax

    devices = list(routing.mesh.devices.flat)
    me = jax.process_index()
    local = tuple(i for i, dev in enumerate(devices) if dev.process_index == me)
    return routing.devices, local, routing


def place_hash_table(layer):
    """Gives a hash layer about to be built the table its strategy needs: a
    `ShardedHashTable` (a shard per device, this process's shards held)
    under key sharding, else one `HashTable`. Only an empty table is
    replaced; ``layer.num_rows`` follows the new table's capacity."""
    from keras_sparse.table import HashTable
    from keras_sparse.table import ShardedHashTable

    shards = _key_shards(layer)
    table = layer.table
    if shards is None:
        if not isinstance(table, ShardedHashTable):
            return
        new = HashTable(
            layer.requested_capacity,
            eviction=layer.eviction,
            admit_after=layer.admit_after,
            device=table.device,
            seed=layer.table_seed,
            ttl_steps=table.ttl_steps,
            track_changes=table.track_changes,
        )
    else:
        d, local, _ = shards
        if getattr(table, "num_shards", None) == d and table.local == local:
            return
        new = ShardedHashTable(
            layer.requested_capacity,
            d,
            local=local,
            eviction=layer.eviction,
            admit_after=layer.admit_after,
            device=table.device,
            seed=layer.table_seed,
            ttl_steps=table.ttl_steps,
            track_changes=table.track_changes,
            gpus=_shard_gpus(local, shards[2]) if table.device == "gpu" else None,
        )
    sharing = [u.name for u in table_users.users(layer) if u is not layer]
    if sharing:
        raise ValueError(
            f"Layer '{layer.name}': its hash table is shared with layer(s) "
            f"{sharing}, and a distribution gives each layer its own sharded "
            "table. Give each layer its own table, or train without a "
            "distribution."
        )
    if table.size:
        raise ValueError(
            f"Layer '{layer.name}': its hash table holds {table.size} keys and "
            f"cannot be re-cut into {type(new).__name__} for the active "
            "distribution. Save the model and reload it with "
            "keras_sparse.sharding.load_model(...)."
        )
    layer.table = new
    layer.num_rows = new.capacity


def _shard_gpus(local, routing):
    """CUDA device of each local shard: its mesh device's GPU, or GPU 0
    when the mesh runs on CPUs (a GPU table beside a CPU step); PyTorch
    (no mesh): the current CUDA device."""
    if routing is None:
        if keras.backend.backend() != "torch":
            return {d: 0 for d in local}  # TensorFlow refuses GPU shards
        import torch

        return {d: torch.cuda.current_device() for d in local}
    mesh = routing.mesh
    devices = list(mesh.devices.flat)

    def gpu(device):
        if device.platform != "gpu":
            return 0
        return getattr(device, "local_hardware_id", None) or 0

    return {d: gpu(devices[d]) for d in local}


def map_keys_in_step(layer, keys, use, insert, draw=None):
    """`MappedKeys` ``(rows, fresh, init)`` of a key-sharded hash layer's traced flat
    ``keys``/``use`` (see `jax_key_mapping.map_keys`; ``draw``: the layer's
    ``keyed_draw()`` in training), or None when the layer is not
    key-sharded under the active distribution."""
    shards = _key_shards(layer)
    if shards is None:
        return None
    return shards[2].map_keys(layer, keys, use, insert, draw)


@dataclasses.dataclass(frozen=True)
class ExchangeBuckets:
    """How an input stage buckets a row-sharded layer's ids (hashable).

    ``devices`` (the batch and the table are split over), ``shard_rows``
    (rows per device), ``slack`` (`jax_row_buffers.row_capacity`) and
    ``dedup`` (distinct ids share a slot: the step's ``DEDUP_EXCHANGE``).
    """

    devices: int
    shard_rows: int
    slack: float
    dedup: bool = True

    def capacity(self, num_ids):
        from keras_sparse.sharding.jax_row_buffers import row_capacity

        return row_capacity(num_ids // self.devices, self.devices, self.slack)

    def slots(self, rows, name):
        """`exchange_buckets.exchange_slots` of one batch's ``rows``."""
        import numpy as np

        from keras_sparse.sharding.exchange_buckets import exchange_slots

        rows = np.asarray(rows)
        return exchange_slots(
            rows,
            self.devices,
            self.shard_rows,
            self.capacity(rows.size),
            name,
            self.dedup,
        )


def exchange_buckets(layer):
    """An `ExchangeBuckets` when ``layer``'s lookup packs ids into compact
    row-exchange buffers under the active distribution (row sharding with a
    ``row_exchange_slack``), else None: full-size buffers need no packing
    and column sharding all-gathers the ids."""
    routing = route(layer)
    if not isinstance(routing, JaxMeshPlacement):
        return None
    if routing.strategy != "row" or routing.slack is None:
        return None
    devices, slack = routing.devices, routing.slack
    if layer.built:
        rows = int(layer.embeddings.shape[0])
    else:
        rows = padded_rows(layer.num_rows, devices)
    from keras_sparse.sharding import exchange_buckets as buckets

    dedup = buckets.DEDUP_EXCHANGE
    return ExchangeBuckets(devices, rows // devices, float(slack), dedup)


def padded_rows(num_rows, num_devices):
    """``num_rows`` rounded up to a multiple of ``num_devices``."""
    return -(-int(num_rows) // int(num_devices)) * int(num_devices)
