"""Key-sharded `DistributedHashEmbedding` across torch.distributed processes.

With ``sharding="key"`` (or ``"auto"``) and several processes in the tables'
process group (`torch_placement.process_group`), process ``d`` of ``D`` owns
the keys with ``owner_of(key, D) == d``: shard ``d`` of the layer's
`keras_sparse.table.ShardedHashTable` (``local=(d,)``) with its admission
and eviction state, and rows ``[d * B, (d + 1) * B)`` of the table and
slots (``B = shard_rows``). `TorchKeyPlacement` is the layer's
`TablePlacement` (its rows are looked up as a row-sharded table's) and its
`KeyMapper` (`keras_sparse.sharding.torch_key_mapping`). Checkpoints gather
every process's records (`gathered_records`), so every process saves
together and a file loads on any process count.

With a row store (``store=``) each process's shard is a cache over a store
of its own: the owner moves its shard's rows while it maps the keys
(`torch_key_mapping.reset_on_owner`), read-only calls ask the owners'
stores for keys without a row (`read_stored`), and checkpoints gather the
stored rows with the records.
"""

import contextlib
import dataclasses

import numpy as np

from keras_sparse.layers.hash.key_mapper import MappedKeys
from keras_sparse.ops.lookup_batch import LookupBatch
from keras_sparse.ops.lookup_batch import TableState
from keras_sparse.sharding import torch_placement
from keras_sparse.sharding.gathered_records import merge_records
from keras_sparse.sharding.torch_placement import TorchShardedPlacement

#: Hash-layer strategies that shard keys across processes.
KEY_SHARDED = ("key", "auto")


def key_shards(layer):
    """``(D, (rank,), None)`` for a hash layer key-sharded over the tables'
    processes, else None (one table per process; ``"data"``, ``"row"`` and
    ``"column"`` then refuse to train under DDP)."""
    from keras_sparse.ops.torch import distributed as torch_distributed

    if layer.sharding not in KEY_SHARDED:
        return None
    if layer.sharding == "auto" and torch_distributed.ALLOW_LOCAL_UPDATES:
        return None  # the processes train independent tables
    where = torch_placement.process_group()
    if where is None:
        return None
    _, d, rank = where
    return d, (rank,), None


def build_placement(layer):
    """The `TorchKeyPlacement` of a hash layer whose table is key-sharded
    over the tables' processes (`key_shards`), else None."""
    shards = key_shards(layer)
    if shards is None or getattr(layer.table, "num_shards", None) != shards[0]:
        return None
    _check_initializer(layer)
    group, d, rank = torch_placement.process_group()
    torch_placement._install_ddp_ignore()
    return TorchKeyPlacement(
        group, d, rank, layer.name, layer.num_rows, layer.output_dim
    )


def _check_initializer(layer):
    from keras_sparse.layers.hash.keyed_fresh_rows import has_seed
    from keras_sparse.layers.hash.keyed_fresh_rows import per_key

    init = layer.embeddings_initializer
    if has_seed(init) and not per_key(init):
        raise ValueError(
            f"Layer '{layer.name}': key sharding across torch.distributed "
            f"processes draws each fresh row from its key, which "
            f"{type(init).__name__} cannot do. Use a RandomUniform, "
            "RandomNormal, TruncatedNormal or VarianceScaling (Glorot, He, "
            "Lecun) initializer, or an unseeded one (zeros, constant)."
        )


class _ResetOnOwners:
    """The ``init`` `map_keys` returns: the fresh rows were re-initialized
    on their owners already, so the lookup has nothing to reset."""

    def __repr__(self):
        return "RESET_ON_OWNERS"


RESET_ON_OWNERS = _ResetOnOwners()


class TorchKeyPlacement(TorchShardedPlacement):
    """A key-sharded hash layer's placement across ``devices`` processes."""

    # With a row store each owner moves its shard's rows itself (while
    # mapping keys): the layer's own moves of global rows are skipped.
    moves_rows = True

    def __init__(self, group, devices, rank, name, num_rows, dim):
        super().__init__("key", group, devices, rank, name, num_rows, dim)

    def __repr__(self):
        return f"TorchKeyPlacement(devices={self.devices}, rank={self.rank})"

    def _route(self):
        return super()._route("row")

    def variable_rows(self, num_rows):
        return self.part_rows

    @contextlib.contextmanager
    def _collective(self, what):
        """Turns a failed collective into an error naming the layer."""
        try:
            yield
        except RuntimeError as e:
            if not _is_collective_error(e):
                raise
            timeout = torch_placement._timeout()
            bound = "its timeout"
            if timeout is not None:
                bound = f"{timeout.total_seconds():g} s"
            raise RuntimeError(
                f"Layer '{self.name}': the {what} of its key-sharded table "
                f"across {self.devices} torch.distributed processes failed "
                "(a peer process died or stalled; the tables' process group "
                f"gives up after {bound}). This process's table shard may be "
                f"part-way through the step: restore from a checkpoint. ({e})"
            ) from e

    # ------------------------------------------------------------ KeyMapper
    def map_keys(self, layer, keys, use, insert, draw=None):
        from keras_sparse.ops.torch import distributed as torch_distributed
        from keras_sparse.sharding import torch_key_mapping

        if insert or torch_distributed.active_ddp() is not None:
            # Before any key is inserted: training needs DDP (and a DDP that
            # left the parts alone); every process raises alike, no
            # collective has started.
            self._check_ddp([layer.embeddings, *layer.slots.values()])
        with self._collective("key exchange"):
            rows, fresh = torch_key_mapping.map_keys(
                self, layer, keys, use, insert, draw if insert else None
            )
        return MappedKeys(rows, fresh, init=RESET_ON_OWNERS if insert else None)

    def read_stored(self, layer, keys, rows):
        """The stored vectors of a read-only call's keys without a row, read
        from their owners' stores (`torch_key_mapping.read_stored`)."""
        from keras_sparse.sharding import torch_key_mapping

        with self._collective("store read"):
            return torch_key_mapping.read_stored(self, layer, keys, rows)

    # -------------------------------------------------------------- lookups
    def lookup(self, state: TableState, batch: LookupBatch):
        reset = batch.reset
        if reset is not None and reset[1] is not RESET_ON_OWNERS:
            raise NotImplementedError(
                f"Layer '{self.name}': a key-sharded PyTorch table resets its "
                "fresh rows on their owners while mapping keys; rows mapped "
                "elsewhere (e.g. by an input stage) cannot be reset."
            )
        with self._collective("row exchange"):
            return super().lookup(state, dataclasses.replace(batch, reset=None))

    def gather(self, table_var, batch: LookupBatch):
        with self._collective("row exchange"):
            return super().gather(table_var, batch)

    # ----------------------------------------------------------- checkpoints
    def host_value(self, variable):
        """The whole ``[D * B, ...]`` variable as NumPy with this process's
        rows filled and the others zeros (its shard's keys live there)."""
        part = variable.value.detach().cpu().numpy()
        out = np.zeros((self.devices * self.part_rows,) + part.shape[1:], part.dtype)
        first = self.rank * self.part_rows
        out[first : first + self.part_rows] = part
        return out

    def assign_host_value(self, variable, value):
        """Assigns this process's rows of a whole ``[D * B, ...]`` value."""
        first = self.rank * self.part_rows
        variable.assign(np.asarray(value)[first : first + self.part_rows])

    def gathered_records(self, records, admission, clock):
        """Every process's ``records`` (dict of arrays, concatenated in rank
        order: global rows ascending), ``admission`` (``(keys, counts)`` or
        None, sorted by key) and the LRU ``clock`` (the largest): a
        collective, so every process must save together."""
        import torch.distributed as dist

        mine = (records, admission, int(clock))
        parts = [None] * self.devices
        with self._collective("checkpoint gather"):
            dist.all_gather_object(parts, mine, group=self.group)
        return merge_records(parts)


def _is_collective_error(error):
    """Errors of torch.distributed collectives (gloo, NCCL, timeouts)."""
    import torch.distributed as dist

    names = ("DistBackendError", "DistError")
    kinds = tuple(k for k in (getattr(dist, n, None) for n in names) if k)
    if kinds and isinstance(error, kinds):
        return True
    text = str(error).lower()
    return any(w in text for w in ("gloo", "nccl", "timed out", "connection", "peer"))
