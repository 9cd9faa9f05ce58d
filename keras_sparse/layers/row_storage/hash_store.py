"""A hash layer's row store (``store=`` of `DistributedHashEmbedding`).

Built here, with the other row storage (`keras_sparse.layers.row_storage`):
the layer's constructor turns its ``store`` argument into a spec
(`store_spec`, `store_config` for ``get_config``), its ``build`` checks the
layer can have one before its variables exist (`check_attachable`) and
then opens it and attaches the `keras_sparse.layers.row_tier.RowTier`
(`attach`; one per table shard under key sharding,
`keras_sparse.layers.row_tier_shards`). The fields are the layer's row
values, optimizer slots and table score.
"""

import keras
import numpy as np

from keras_sparse.layers import row_tier
from keras_sparse.layers import row_tier_shards


def store_spec(layer_name, store):
    """The layer's ``store`` argument as a store spec (None: no store)."""
    if store is None:
        return None
    from keras_sparse import store as row_stores

    try:
        return row_stores.get(store)
    except ValueError as e:
        raise ValueError(f"Layer '{layer_name}': `store`: {e}") from None


def store_config(spec):
    """The spec's config for ``get_config`` (None without a store)."""
    if spec is None:
        return None
    from keras_sparse import store as row_stores

    return row_stores.serialize(spec)


#: Where a hash layer's store works under a distribution (errors say it).
SUPPORTED = (
    "A store works with JAX sharding='data' (one host table) and "
    "sharding='key' (a store per table shard), with TensorFlow "
    "sharding='key' under a MirroredStrategy or MultiWorkerMirroredStrategy "
    "(a store per replica's table shard) and with PyTorch sharding='key' across "
    "torch.distributed processes (a store per process's table shard)."
)


def check_attachable(layer):
    """Raises ValueError (naming the layer) when ``layer`` cannot have a row
    store; run before the layer builds, so a refused build leaves it unbuilt
    (a caught refusal must not let it train without its store)."""
    from keras_sparse.layers.hash.keyed_fresh_rows import has_seed
    from keras_sparse.layers.hash.keyed_fresh_rows import per_key

    where = f"Layer '{layer.name}': `store`"
    if layer.table.device != "cpu":
        raise ValueError(
            f"{where} needs the key->row map on the host (table_device='cpu'); "
            f"received table_device={layer.table_device!r}."
        )
    key_sharded = getattr(layer.table, "num_shards", None) is not None
    backend = keras.backend.backend()
    # Placements whose owners move their shard's rows (TensorFlow and
    # PyTorch key sharding) take a store; JAX key sharding has no placement
    # (its moves run in the layer's step). Other placements take none.
    movers = layer.placement is None or getattr(layer.placement, "moves_rows", False)
    if not movers:
        raise ValueError(
            f"{where} is not available for a layer the {backend} "
            f"distribution shards (sharding={layer.sharding!r}): there use no "
            f"store or one replica. {SUPPORTED}"
        )
    init = layer.embeddings_initializer
    if has_seed(init) and not per_key(init):
        raise ValueError(
            f"{where} needs fresh rows drawn per key, so that a key's first "
            "vector does not depend on which keys the store brought back in "
            "the same step: use RandomUniform, RandomNormal, TruncatedNormal, "
            "a VarianceScaling initializer or an unseeded one; received "
            f"embeddings_initializer={type(init).__name__}."
        )
    row_tier.check_not_shared(layer, layer.table)
    table = layer.table
    if (
        key_sharded
        and len(table.local) < table.num_shards
        and backend != "tensorflow"
        and not (backend == "torch" and len(table.local) == 1)
    ):
        # JAX moves a step's rows in one host callback over the whole
        # batch; TensorFlow and PyTorch owners move and read their own
        # shard's rows (the placement routes read-only calls' keys).
        raise ValueError(
            f"{where} with sharding='key' on {backend} needs every table "
            f"shard in this process; it holds shards {list(table.local)} of "
            f"{table.num_shards} (a run of several processes). Use no store "
            f"there, or one process. {SUPPORTED}"
        )


def attach(layer, spec):
    """A `RowTier` for built ``layer`` over a store opened from ``spec``;
    the layer's table admits the store's keys at sight."""
    from keras_sparse import store as row_stores

    check_attachable(layer)
    fields = [
        row_stores.FieldSpec(
            row_tier.VALUES, layer.output_dim, _dtype(layer.embeddings)
        )
    ]
    for name, var in layer.slots.items():
        fields.append(row_stores.FieldSpec(name, int(var.shape[1]), _dtype(var)))
    fields.append(row_stores.FieldSpec(row_tier.SCORE, 1, "int64"))
    table = layer.table
    key_sharded = getattr(table, "num_shards", None) is not None
    if key_sharded:
        # A store per shard: a key never leaves its owner shard. Errors
        # name the layer and the shard.
        stores = {}
        try:
            for d in table.local:
                stores[d] = spec.open_keyed(
                    tuple(fields), name=f"{layer.name}.shard{d}"
                )
                # A reopened folder must be this shard's of as many shards.
                row_tier_shards.check_shard_folder(
                    layer.name, stores[d], d, table.num_shards
                )
        except Exception:
            for store in stores.values():
                store.close()
            raise
        shards = {
            d: row_tier.RowTier(f"{layer.name} (table shard {d})", store, layer.slots)
            for d, store in stores.items()
        }
        tier = row_tier_shards.ShardedRowTier(
            layer.name, shards, table.num_shards, table.shard_rows
        )
        for d, shard_tier in tier.shards.items():
            # Keys never change shards: the table's keys filter each store.
            shard_tier.table_keys = layer.cached_keys
            table.shard(d).set_held_keys(shard_tier.held)
        return tier
    opened = spec.open_keyed(tuple(fields), name=layer.name)
    tier = row_tier.RowTier(layer.name, opened, layer.slots)
    tier.table_keys = layer.cached_keys
    table.set_held_keys(tier.held)
    return tier


def _dtype(variable):
    return np.dtype(str(variable.dtype).split(".")[-1]).name
