"""Sharded tables on PyTorch: a layer's `TablePlacement` across the
processes of a torch.distributed run (one process per device).

When torch.distributed is initialized with more than one process, a layer
built with ``sharding="row"`` or ``"column"`` holds only this process's part
of its table and slots (`keras_sparse.sharding.torch_sharded_lookup`); every
other table ("auto", "data") is a full copy per process, updated from the
global batch (`keras_sparse.ops.torch.distributed`). The exchanges run on
a process group of their own (`process_group`), made on the first sharded
build over all processes with the default group's timeout, or named by
`set_process_group`. A `DistributedHashEmbedding` ("key" or "auto") is
key-sharded over the same group (`keras_sparse.sharding.torch_key_placement`).

DistributedDataParallel broadcasts every parameter of the module it wraps
from rank 0 when it is made, which would give every process rank 0's part.
Keras layers therefore answer DDP's ``_ddp_params_and_buffers_to_ignore``
with the names of the sharded tables' parameters (`sharded_parameter_names`;
installed on the first sharded build), so ``DistributedDataParallel(model)``
leaves them alone. A model wrapped inside another torch module needs
``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
module, sharded_parameter_names(module))`` before wrapping; the first
training call checks it and raises otherwise.
"""

import keras

from keras_sparse.ops.lookup_batch import LookupBatch
from keras_sparse.ops.lookup_batch import TableState
from keras_sparse.sharding import plan_spec

#: Strategies that shard a table over the processes.
SHARDED = ("row", "column")
_group = {"named": False, "group": None, "default": None, "made": None}


def set_process_group(group):
    """Runs the exchanges of tables built from now on over ``group`` (a
    ``torch.distributed`` process group made by ``new_group``: processes
    outside it build local tables); None: a group over all processes, made
    on the first sharded build. Give it a timeout (``new_group(timeout=)``)
    so that a dead peer fails the others' exchanges instead of hanging."""
    _group.update(named=group is not None, group=group)


def process_group():
    """``(group, processes, rank)`` the sharded tables use now, or None when
    this process runs alone (or outside the named group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if _group["named"]:
        group = _group["group"]
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            return None
    else:
        if dist.get_world_size() < 2:
            return None
        default = dist.distributed_c10d._get_default_group()
        if _group["default"] is not default:
            # A collective of all processes: they build the same layers in
            # the same order, so they all make it at the same build.
            _group.update(default=default, made=dist.new_group(timeout=_timeout()))
        group = _group["made"]
    size = dist.get_world_size(group)
    return (group, size, dist.get_rank(group)) if size > 1 else None


def _timeout():
    """The default group's timeout (None: torch's default)."""
    import torch
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return default._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - no such backend or option
            continue
    return None


def _refuse(layer, strategy, why, advice):
    raise ValueError(
        f"Layer '{layer.name}': sharding={strategy!r} across torch.distributed "
        f"processes {why}. {advice}"
    )


def build_placement(layer):
    """The `TablePlacement` ``layer`` is built with, or None (a local table,
    or a full copy per process)."""
    strategy = layer.sharding
    if strategy not in SHARDED + ("table",) or plan_spec.is_hash_layer(layer):
        return None
    if not plan_spec.is_shardable_layer(layer):
        return None
    where = process_group()
    if where is None:
        return None
    group, d, rank = where
    if strategy == "table":
        _refuse(
            layer,
            strategy,
            "needs the table in an EmbeddingCollection (which stacks "
            "each process's whole tables into one row-sharded variable)",
            "Put it in an EmbeddingCollection, or use 'row', 'column' or "
            "'data' (a full copy per process).",
        )
    if layer.sparse_optimizer is None:
        _refuse(
            layer,
            strategy,
            "needs a sparse optimizer (the owners update "
            "their rows in the backward pass)",
            "Pass optimizer= (e.g. 'adagrad'), or use sharding='data'.",
        )
    if strategy == "column":
        _check_column(layer, d)
    _install_ddp_ignore()
    return TorchShardedPlacement(
        strategy, group, d, rank, layer.name, layer.num_rows, layer.output_dim
    )


def _check_column(layer, d):
    dim = layer.output_dim
    if dim % d:
        _refuse(
            layer,
            "column",
            f"needs output_dim ({dim}) divisible by the {d} processes",
            f"Use an output_dim that is a multiple of {d}, or sharding='row'.",
        )
    if layer.embeddings_constraint is not None:
        _refuse(
            layer,
            "column",
            "cannot apply an embeddings_constraint (it needs whole rows)",
            "Use sharding='row'.",
        )
    for spec in layer.sparse_optimizer.slot_specs():
        if tuple(spec.shape(layer.num_rows, dim))[1:] != (dim,):
            _refuse(
                layer,
                "column",
                f"needs an element-wise optimizer; slot "
                f"'{spec.name}' of {type(layer.sparse_optimizer).__name__} "
                "holds whole rows (e.g. rowwise_adagrad)",
                "Use sharding='row', or an element-wise optimizer (sgd, "
                "adagrad, adam, ftrl).",
            )


class TorchShardedPlacement:
    """A table split over ``devices`` processes of ``group`` by rows or by
    columns (`TablePlacement`); this process (``rank``) holds one part."""

    def __init__(self, strategy, group, devices, rank, name, num_rows, dim):
        self.strategy, self.group = strategy, group
        self.devices, self.rank, self.name = devices, rank, name
        self.part_rows = -(-num_rows // devices)
        self.dim, self.part_cols = dim, dim // devices
        self._checked = set()
        self._sizes = None  # the exchanges' ExchangeSizes, made on first use

    def __repr__(self):
        return (
            f"TorchShardedPlacement({self.strategy!r}, devices={self.devices}, "
            f"rank={self.rank})"
        )

    def _route(self, strategy=None):
        from keras_sparse.sharding import torch_sharded_lookup as lookup

        if self._sizes is None:
            self._sizes = lookup.ExchangeSizes()
        strategy = strategy or self.strategy
        return lookup.Route(
            strategy, self.group, self.devices, self.part_rows, self._sizes
        )

    # -------------------------------------------------------------- lookups
    def lookup(self, state: TableState, batch: LookupBatch):
        """Rows of ``batch.ids``; the backward pass updates the owners'
        parts (``apply_update``, ``segments``, ``exchange_slot`` and
        ``blocks`` are not used: torch looks up to update, each process
        its own part)."""
        from keras_sparse.sharding import torch_sharded_lookup

        if batch.reset is not None:
            raise NotImplementedError(
                f"Layer '{self.name}': a sharded PyTorch table cannot reset rows."
            )
        self._check_ddp([state.table_var, *state.slot_vars.values()])
        return torch_sharded_lookup.lookup(self._route(), state, batch)

    def gather(self, table_var, batch: LookupBatch):
        from keras_sparse.ops.torch import distributed as torch_distributed
        from keras_sparse.sharding import torch_sharded_lookup

        if torch_distributed.active_ddp() is not None:
            # Inference inside a DDP forward: the parts must not be rank 0's.
            self._check_ddp([table_var])
        return torch_sharded_lookup.gather(
            self._route(), table_var, batch.ids, batch.valid
        )

    def _check_ddp(self, variables):
        """Training needs a DDP forward over this table's processes that
        did not broadcast rank 0's part (`sharded_parameter_names`)."""
        import torch.distributed as dist

        from keras_sparse.ops.torch import distributed as torch_distributed

        ddp = torch_distributed.active_ddp()
        if ddp is None:
            raise RuntimeError(
                f"Layer '{self.name}': a table sharded across torch.distributed "
                "processes trains inside a DistributedDataParallel forward "
                "only (the row gradients are averaged as DDP averages the dense "
                "ones). Wrap the model in torch.nn.parallel."
                "DistributedDataParallel."
            )
        if id(ddp) in self._checked:
            return
        world = dist.get_world_size(ddp.process_group)
        if world != self.devices:
            raise RuntimeError(
                f"Layer '{self.name}': DistributedDataParallel averages over "
                f"{world} processes, the table is sharded over {self.devices}; "
                "give both the same processes."
            )
        ours = {id(v.value) for v in variables}
        names = _names_of(ddp.module, ours)
        missing = sorted(set(names) - set(ddp.parameters_to_ignore))
        if missing:
            raise RuntimeError(
                f"Layer '{self.name}': DistributedDataParallel was made without "
                f"ignoring the sharded table's parameters {missing}, so it gave "
                "every process rank 0's part. Before wrapping, call "
                "DistributedDataParallel._set_params_and_buffers_to_ignore_"
                "for_model(module, keras_sparse.sharding."
                "torch_sharded_parameter_names(module)), then rebuild or "
                "reload the model."
            )
        self._checked.add(id(ddp))

    # ---------------------------------------------------- build-time hooks
    def variable_rows(self, num_rows):
        return self.part_rows if self.strategy == "row" else int(num_rows)

    def variable_dim(self, dim):
        return self.part_cols if self.strategy == "column" else int(dim)

    def table_initializer(self, initializer, num_rows):
        """This process's part of the full table one process would draw."""

        def part(shape, dtype=None):
            full = initializer((int(num_rows), self.dim), dtype=dtype)
            return self._cut(keras.ops.convert_to_tensor(full), num_rows)

        return part

    def variable_options(self):
        return {}

    def _cut(self, value, num_rows):
        """This process's part of a whole ``[num_rows, ...]`` value."""
        import torch

        value = torch.as_tensor(value)
        if self.strategy == "column":
            first = self.rank * self.part_cols
            return value[:, first : first + self.part_cols].clone()
        first = min(self.rank * self.part_rows, int(num_rows))
        rows = value[first : first + self.part_rows]
        pad = self.part_rows - rows.shape[0]
        if pad:
            rows = torch.cat([rows, rows.new_zeros((pad,) + tuple(rows.shape[1:]))])
        return rows.clone()

    # ----------------------------------------------------------- checkpoints
    def saved_value(self, variable, num_rows):
        """The whole unpadded table (or slot) as NumPy: an all-gather, so
        every process must save (`model.save` / `save_weights`) together."""
        from keras_sparse.sharding.torch_sharded_lookup import all_parts

        axis = 1 if self.strategy == "column" else 0
        whole = all_parts(variable.value.detach(), self.group, axis)
        return whole[: int(num_rows)].cpu().numpy()

    def saved_shape(self, variable, num_rows):
        shape = tuple(variable.shape)
        if self.strategy == "column":
            return (shape[0], shape[1] * self.devices) + shape[2:]
        return (int(num_rows),) + shape[1:]

    def assign_saved(self, variable, num_rows, value):
        variable.assign(self._cut(value, num_rows))


# --------------------------------------------------- DDP and sharded parameters
def _names_of(module, ids):
    return [
        name
        for name, p in module.named_parameters(remove_duplicate=False)
        if id(p) in ids
    ]


def sharded_parameter_names(module):
    """Names (as ``module.named_parameters()`` gives them) of the sharded
    tables' and slots' parameters in ``module``, which DistributedDataParallel
    must not broadcast."""
    ids = set()
    for sub in module.modules():
        flatten = getattr(sub, "_flatten_layers", None)
        if flatten is None:
            continue
        for layer in flatten(include_self=True, recursive=True):
            if isinstance(getattr(layer, "placement", None), TorchShardedPlacement):
                variables = [layer.embeddings, *layer.slots.values()]
                ids.update(id(v.value) for v in variables)
            for stack in getattr(layer, "stacks", ()):  # EmbeddingCollection
                if isinstance(getattr(stack, "placement", None), TorchShardedPlacement):
                    variables = layer.stack_variables(stack.name)
                    ids.update(id(v.value) for v in variables)
    return _names_of(module, ids) if ids else []


def _ignored(layer):
    given = layer.__dict__.get("_keras_sparse_ddp_ignore")
    if given is None:  # set on the instance before the property was installed
        given = layer.__dict__.get("_ddp_params_and_buffers_to_ignore")
    names = sharded_parameter_names(layer)
    if given is None and not names:
        raise AttributeError("_ddp_params_and_buffers_to_ignore")
    return sorted(set(given or ()) | set(names))


def _set_ignored(layer, names):
    layer.__dict__["_keras_sparse_ddp_ignore"] = list(names)


def _install_ddp_ignore():
    """Makes Keras layers (models) answer DDP with their sharded parameters
    (see the module note); what a user sets is kept and added to."""
    layer_class = keras.layers.Layer
    if not isinstance(
        layer_class.__dict__.get("_ddp_params_and_buffers_to_ignore"), property
    ):
        layer_class._ddp_params_and_buffers_to_ignore = property(_ignored, _set_ignored)
