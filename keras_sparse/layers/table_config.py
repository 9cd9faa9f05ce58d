"""TableConfig: one table of an `EmbeddingCollection`, the checks of the
tables given to a collection (a `TableConfig` or a dict of its arguments)
and the caches of its tables with ``cache_rows``."""

import keras

from keras_sparse import store as row_stores
from keras_sparse.layers import pooling
from keras_sparse.layers.arguments import check_fields
from keras_sparse.layers.arguments import check_positive_int
from keras_sparse.layers.row_storage import cache as cached_rows
from keras_sparse.layers.sparse_embedding_base import check_sharding
from keras_sparse.layers.table_storage import ARGUMENTS as STORAGE_ARGUMENTS
from keras_sparse.layers.table_storage import TableStorage


class TableConfig:
    """One table of an `EmbeddingCollection`.

    Args:
        input_dim: vocabulary size; ids must be in ``[0, input_dim)``.
        output_dim: embedding width.
        combiner: None (one vector per id), "sum", "mean" or "sqrtn" (pool
            the last axis of the ids), as in `AllToAllDenseEmbedding`.
        embeddings_initializer: initializer of the table's rows.
        sharding: "auto" (the collection's), "data", "table", "row" or
            "column"; used by `keras_sparse.plan` / `keras_sparse.distribution`
            (JAX) and at build under a MirroredStrategy or torch.distributed
            processes.
        cache_rows: None (the table lives in the collection's variables) or
            an int in ``[1, input_dim]``: the device then holds that many
            rows (values and slots), a cache of the ids trained lately, and
            the whole table lives in ``store``, as with
            `AllToAllDenseEmbedding`'s ``cache_rows``. Needs the
            collection's sparse ``optimizer``, one device ("auto" or "data"
            sharding) and a per-id ``embeddings_initializer`` (random or
            constant). Training is exact.
        store: where the whole table lives with ``cache_rows``: "host"
            (default), ``keras_sparse.store.Host()`` or
            ``keras_sparse.store.Disk(path)`` (the table's files go to
            ``path/<collection name>/<table name>``).
        table_dtype: the table's storage dtype, "float32", "bfloat16" or
            "float16" (None: the collection's variable dtype), as
            `AllToAllDenseEmbedding`'s; 16 bits need the collection's sparse
            ``optimizer`` and no ``cache_rows``. Tables of different
            storage never share a stacked variable.
        stochastic_rounding: whether rows written into 16-bit tables and
            slots round stochastically (default) or to nearest.
        slot_dtype: the optimizer slots' storage dtype, as ``table_dtype``.

    Example:

    >>> import keras_sparse as ks
    >>> ks.TableConfig(1000, 8, combiner="sum").input_dim
    1000
    """

    def __init__(
        self,
        input_dim,
        output_dim,
        combiner=None,
        embeddings_initializer="uniform",
        sharding="auto",
        cache_rows=None,
        store=None,
        table_dtype=None,
        stochastic_rounding=True,
        slot_dtype=None,
    ):
        where = "TableConfig"
        self.storage = TableStorage(
            where, table_dtype, stochastic_rounding, slot_dtype, where=where
        )
        self.storage.check_no_store(where, cache_rows, "cache_rows")
        check_positive_int(where, "input_dim", input_dim)
        check_positive_int(where, "output_dim", output_dim)
        pooling.check_combiner(where, combiner)
        check_sharding(where, sharding)
        self.input_dim = int(input_dim)
        self.output_dim = int(output_dim)
        self.combiner = combiner
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.sharding = sharding
        self.cache_rows = None
        self.store = None
        if cache_rows is not None or store is not None:
            self.store = cached_rows.check_table(
                where,
                self.input_dim,
                cache_rows,
                store,
                sharding,
                self.embeddings_initializer,
            )
            self.cache_rows = int(cache_rows)

    def get_config(self):
        config = {
            "input_dim": self.input_dim,
            "output_dim": self.output_dim,
            "combiner": self.combiner,
            "embeddings_initializer": keras.initializers.serialize(
                self.embeddings_initializer
            ),
            "sharding": self.sharding,
        }
        if self.cache_rows is not None:
            config["cache_rows"] = self.cache_rows
            config["store"] = row_stores.serialize(self.store)
        if self.storage.config() != TableStorage("").config():
            config.update(self.storage.config())
        return config

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        return (
            f"TableConfig(input_dim={self.input_dim}, output_dim="
            f"{self.output_dim}, combiner={self.combiner!r}, "
            f"sharding={self.sharding!r}"
            + (
                ""
                if self.cache_rows is None
                else f", cache_rows={self.cache_rows}, store={self.store!r}"
            )
            + "".join(
                f", {k}={v!r}"
                for k, v in self.storage.config().items()
                if v != TableStorage("").config()[k]
            )
            + ")"
        )


_TABLE_FIELDS = (
    "input_dim",
    "output_dim",
    "combiner",
    "embeddings_initializer",
    "sharding",
    "cache_rows",
    "store",
    *STORAGE_ARGUMENTS,
)


def table_config_of(layer_name, table, spec):
    """Table ``table`` of layer ``layer_name`` as a `TableConfig` (given
    one or a dict of its arguments)."""
    if isinstance(spec, TableConfig):
        return spec
    if isinstance(spec, dict):
        check_fields(f"Layer '{layer_name}', table '{table}'", spec, _TABLE_FIELDS)
        try:
            return TableConfig(**spec)
        except (TypeError, ValueError) as e:
            raise type(e)(f"Layer '{layer_name}', table '{table}': {e}") from None
    raise TypeError(
        f"Layer '{layer_name}', table '{table}': expected a "
        f"keras_sparse.TableConfig or a dict of its arguments; received "
        f"{type(spec).__name__}."
    )


def table_caches(layer):
    """``{name: CacheRows}`` of the tables with ``cache_rows``."""
    caches = {}
    for name, config in layer.tables.items():
        if config.cache_rows is None:
            continue
        where = f"Layer '{layer.name}', table '{name}'"
        cached_rows.check_layer(where, layer.sparse_optimizer)
        if config.sharding == "auto" and layer.sharding not in ("auto", "data"):
            raise ValueError(
                f"{where}: the collection's `sharding`={layer.sharding!r} "
                "applies to this table, which has `cache_rows`: not "
                "available yet. Give the table sharding='data' (one "
                "device) or drop its `cache_rows`."
            )
        caches[name] = cached_rows.cached_table(
            f"{layer.name}' table '{name}",
            config.input_dim,
            config.output_dim,
            config.cache_rows,
            config.store,
            combiner=config.combiner,
            optimizer=layer.sparse_optimizer,
            initializer=config.embeddings_initializer,
            dtype=layer.dtype_policy,
            name=f"{layer.name}_{name}_cache",
            store_name=f"{layer.name}/{name}",
            owner=layer,
            track_changes=layer.track_changes,
        )
    return caches
