"""The layer's hash table and the mapping of keys to its rows.

Mixin of `DistributedHashEmbedding`: the ``table`` it owns (or shares), its
counters (``stats``), and keys -> rows and fresh flags through that table,
on the host (NumPy) or on the GPU (CuPy), eagerly or from a compiled step's
callback (which placement maps a call: `keras_sparse.layers.hash.key_mapping`;
what it gives: `keras_sparse.layers.hash.key_mapper.MappedKeys`).
"""

import keras
import numpy as np
from keras import ops

from keras_sparse.layers import jax_key_queue
from keras_sparse.layers import row_tier
from keras_sparse.layers.hash import key_mapping
from keras_sparse.layers.hash import table_users
from keras_sparse.layers.hash import trained_rows
from keras_sparse.layers.hash.host_keys import host_keys as _host_keys
from keras_sparse.layers.hash.host_keys import string_kind as _string_kind
from keras_sparse.layers.hash.host_keys import to_numpy as _to_numpy
from keras_sparse.layers.hash.key_mapper import MappedKeys
from keras_sparse.layers.hash.key_mapper import UndoCollector
from keras_sparse.table import BatchTooLargeError
from keras_sparse.table import TableFullError


def _first_fresh_only(rows, fresh, xp):
    """Clears ``fresh`` (in place) except at each new row's first position.

    Duplicates of a new key share its row. Flagged at every position, the
    step would scatter several drawn vectors onto that one row, and which one
    a scatter keeps is unspecified (PyTorch's CPU ``index_put_`` varies from
    run to run): training would not be reproducible.
    """
    at = xp.flatnonzero(fresh)
    if at.size < 2:
        return
    _, first = xp.unique(rows[at], return_index=True)
    if first.size < at.size:
        fresh[at] = False
        fresh[at[first]] = True


def _from_dlpack(x):
    """A CuPy array as a tensor of the active backend, on the GPU."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax.dlpack

        return jax.dlpack.from_dlpack(x)
    if backend == "torch":
        import torch

        return torch.from_dlpack(x)
    import tensorflow as tf

    return tf.experimental.dlpack.from_dlpack(x.toDlpack())


class TableMapping:
    """Mixin of `DistributedHashEmbedding`: its hash table and the mapping
    of keys to rows (see the module docstring)."""

    def stats(self):
        """The hash table's counters, size, capacity and load factor.

        The counters count the keys of training calls (``training=True`` on
        a trainable layer: each ``fit`` / ``train_on_batch`` step, the batch
        a `keras_sparse.data.prefetch` training stage maps for its step, an
        eager call), once per call and the same on JAX, TensorFlow and
        PyTorch; padding (weight 0) is not counted:

        - ``hits`` / ``misses``: key occurrences that found / did not find
          a row, as if the step's keys arrived one at a time in batch
          order: a repeat of a key the same step gave a row is a hit. So
          without evictions the counts do not depend on how the samples
          are shuffled or batched.
        - ``inserts``: keys given a row; ``evictions``: keys that lost
          theirs to make room.
        - ``rejected_admissions``: occurrences of keys not yet seen
          ``admit_after`` times (the admitting occurrence is an insert).
        - ``overflows``: keys left without a row because both of their
          buckets were taken by keys of the same step.

        Calls that only read the table count nothing: inference
        (``evaluate``, ``predict``, ``training=False``, exports), a frozen
        layer, and the calls Keras makes to infer shapes while it builds
        or traces a model. Key-sharded, the counters are those of this
        process's shards. They are not saved.

        With a row store (``store=``) it adds ``fills``, ``write_backs``,
        ``store_hits``, ``store_size`` (keys only the store holds) and
        ``store_bytes``; counting ``store_size`` reads the table's keys, so
        such a call costs time in proportion to the table.
        """
        out = self.table.stats()
        if self.row_tier is not None:
            out.update(self.row_tier.stats())
        return out

    @property
    def table(self):
        """The layer's hash table (`keras_sparse.table.HashTable` or a
        sharded table). Assigning another layer's table shares it: the two
        layers' calls then keep one order in a step."""
        return self.__dict__.get("_ks_table")

    @table.setter
    def table(self, table):
        if table is not None and table is not self.table:
            row_tier.check_not_shared(self, table)
            ttl_steps = getattr(table, "ttl_steps", None)
            if ttl_steps is not None and getattr(self, "store", None) is not None:
                # As `ttl_steps=` with `store=`: an expired key would come back.
                raise ValueError(
                    f"Layer '{self.name}': `table` has ttl_steps={ttl_steps}, "
                    "which cannot be combined with the layer's row store "
                    "(`store=`): an expired key would come back from the "
                    "store. Nothing was changed; assign a table with "
                    "ttl_steps=None."
                )
        self.__dict__["_ks_table"] = table
        table_users.register(table, self)

    def _lookup_or_insert(self, keys, undo=None):
        """``(rows, fresh)`` of flat keys (NumPy or CuPy, as the table gives);
        ``undo``: see `HashTable.lookup_or_insert_fresh`."""
        try:
            if undo is None:
                res, fresh = self.table.lookup_or_insert_fresh(keys)
            else:
                res, fresh = self.table.lookup_or_insert_fresh(keys, undo=undo)
            return res.rows, fresh
        except BatchTooLargeError as e:
            raise BatchTooLargeError(
                f"Layer '{self.name}': this batch has more distinct keys to "
                f"admit than the hash table has rows (capacity="
                f"{self.table.capacity}: the `capacity` argument, "
                f"{self.requested_capacity}, rounded to whole buckets); "
                "nothing was changed. Use a larger `capacity` or a smaller "
                f"batch. ({e})"
            ) from None
        except TableFullError as e:
            raise TableFullError(
                f"Layer '{self.name}': the hash table is full (capacity="
                f"{self.table.capacity}, size={self.table.size}) and "
                f"eviction=None; nothing was changed. Use eviction='lru'/"
                f"'lfu' or a larger capacity. ({e})"
            ) from None

    def _table_rows(self, flat, use, insert, xp, out=None, undo=None):
        """Flat int64 keys and bool ``use``, both NumPy (``xp=np``) or both
        CuPy -> ``(rows int32, fresh bool)`` of ``xp``, rows -1 where absent
        or unused, fresh at the first position of each newly assigned row;
        written into ``out`` (two arrays) when given. ``undo``: collects
        the table call's undo record (see `HashTable.lookup_or_insert_fresh`)."""
        n = flat.shape[0]
        rows, fresh = (
            out if out is not None else (xp.empty(n, xp.int32), xp.empty(n, bool))
        )
        if insert and xp is not np and undo is None:
            # GPU table: one launch writing rows and fresh, no host sync
            # (None: the general path below).
            if self.table.step_rows(flat, use, (rows, fresh)) is not None:
                return rows, fresh
        # No padding (the usual case): no mask copies and scatters. On CuPy
        # the check is one host sync, cheaper than the syncs of mask indexing.
        if use is None or bool(use.all()):
            use = slice(None)
        else:
            rows[...] = -1
            fresh[...] = False
        as_xp = _to_numpy if xp is np else xp.asarray
        selected = flat[use]
        if insert:
            tier = self.row_tier
            if tier is not None and getattr(self.table, "num_shards", None):
                raise ValueError(
                    f"Layer '{self.name}': a key-sharded layer with a `store` "
                    "trains in compiled steps only (model.fit, or a jitted "
                    "step under its keras_sparse.sharding.distribution), where "
                    "each owner device moves its shard's rows; this eager "
                    "training call is not supported."
                )
            if tier is not None:  # the call's evictions go down to the store
                undo = UndoCollector(undo)
            if undo is None:
                got, new = self._lookup_or_insert(selected)
            else:
                got, new = self._lookup_or_insert(selected, undo)
            rows[use] = as_xp(got)
            fresh[use] = as_xp(new)
            _first_fresh_only(rows, fresh, xp)
            if tier is not None:
                tier.record(MappedKeys.of_table_call(flat, rows, fresh, undo.record))
        else:
            # Read-only calls (inference, a frozen layer) leave `stats` alone:
            # compiled inference reads the serving map, which cannot count.
            # As of the last trained step while a stage maps ahead.
            rows[use] = as_xp(trained_rows.read_rows(self, selected))
            if self.row_tier is not None:  # its store read follows (whole keys)
                self.row_tier.read_keys = flat
        return rows, fresh

    def map_host_keys(self, keys, use, insert, out=None, undo=None):
        """Host keys (any shape), use (bool; None: every position) -> flat
        NumPy `MappedKeys` (rows, fresh), through the table in call order
        (an input stage maps its batches with this; ``undo`` receives the
        call's undo record)."""
        if use is not None:
            use = np.asarray(use, dtype=bool).reshape(-1)
        rows, fresh = self._table_rows(_host_keys(keys), use, insert, np, out, undo)
        return MappedKeys(rows, fresh)

    def _map_step_keys(self, keys, use, insert, out=None):
        """`map_host_keys` of the keys a compiled step received: the high 32
        bits JAX dropped are restored first. A third array in ``out``
        receives each key's high word (int32)."""
        if out is None or len(out) == 2:
            return self.map_host_keys(self.full_keys(keys), use, insert, out)
        flat = _host_keys(self.full_keys(keys))
        out[2][...] = (flat >> 32).astype(np.int32)
        return self.map_host_keys(flat, use, insert, out[:2])

    def _gpu_rows(self, keys, use, insert, out=None):
        """GPU table: CuPy-readable keys and use -> flat CuPy (rows, fresh),
        on the current CuPy stream; no host copy of the keys.

        Checked by ``tests/gpu`` (on a GPU, and on emulated CUDA in CI).
        int32 keys of a JAX step without x64 whose full 64-bit keys the input
        pipeline queued (`keras_sparse.layers.jax_full_keys`) are replaced by
        those keys, copied from the host (where they came from) and checked
        against the step's keys on the device.
        """
        import cupy as cp

        from keras_sparse.table.keys import to_cupy_keys

        flat, _ = to_cupy_keys(keys)  # zero-copy for CUDA tensors
        if jax_key_queue.has_queued(self):
            flat = jax_key_queue.restore(self, flat, cp)
        use = cp.asarray(use).reshape(-1).astype(bool, copy=False)
        if out is not None and len(out) == 3:  # the keys' high words too
            out[2][...] = (flat.astype(cp.int64, copy=False) >> 32).astype(cp.int32)
            out = out[:2]
        return self._table_rows(flat, use, insert, cp, out)

    def _map_on_gpu(self, keys, use, insert):
        """GPU table, eager call: keys and rows stay on the device via DLPack."""
        import cupy as cp

        use = cp.asarray(ops.convert_to_numpy(use))
        rows, fresh = self._gpu_rows(keys, use, insert)
        return MappedKeys(_from_dlpack(rows), _from_dlpack(fresh))

    def full_keys(self, keys):
        """Keys with the high 32 bits JAX dropped restored (see
        `keras_sparse.layers.jax_full_keys`); other keys pass through."""
        if keras.backend.backend() != "jax" or _string_kind(keys):
            return keys
        return jax_key_queue.restore(self, _host_keys(keys))

    def _map_keys(self, keys, use, insert, inference=False):
        """Flat `MappedKeys` of ``keys``, wherever the mapping runs now
        (see `keras_sparse.layers.hash.key_mapping`)."""
        return key_mapping.map_keys(self, keys, use, insert, inference)
