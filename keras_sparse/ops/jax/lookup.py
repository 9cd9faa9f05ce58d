"""JAX: the sparse update rides on a custom_vjp.

The backward pass returns the updated table and slots as their "gradients";
the variables are marked ``overwrite_with_gradient`` so the Keras optimizer
assigns them as they are. Keras' JAX trainer donates its state, so XLA does
the scatter in place and a step costs the same for any table size.
"""

import functools

import jax
import jax.numpy as jnp
import keras
from jax.custom_derivatives import CustomVJPPrimal
from jax.custom_derivatives import SymbolicZero

from keras_sparse.ops import dense_row_updates
from keras_sparse.ops import row_updates
from keras_sparse.ops import take_rows
from keras_sparse.ops.jax import native_rows as jax_native_rows
from keras_sparse.ops.jax.row_writes import write_rows
from keras_sparse.ops.lookup_batch import LookupBatch
from keras_sparse.ops.lookup_batch import TableState
from keras_sparse.ops.row_rounding import to_compute
from keras_sparse.ops.row_rounding import write_seed
from keras_sparse.ops.row_updates import compute_row_updates

# Whether the backward takes the touched rows from the forward's gather
# (see `_forward`). None: for tables of at least FORWARD_ROWS_MIN_BYTES, the
# ones the CPU caches cannot hold (26 tables of 1e5 x 16, 6.4 MB each: no
# gain, 1-5% slower; of 1e6 x 16, 64 MB: 6-20% faster per step). True/False
# force it (tests and benchmarks/switch_ab.py compare both).
REUSE_FORWARD_ROWS = None
FORWARD_ROWS_MIN_BYTES = 16 << 20


def gather_valid(table, ids, valid, compiled=False):
    """``table[ids]`` where ``valid``, else zero rows (float32 from a
    16-bit table). ``compiled``: by the prefetching custom call where it
    applies (`native_rows`); only training steps ask for it, so that
    inference programs (exported ones included) hold no custom call."""
    if compiled:
        gathered = jax_native_rows.gather_rows(table, ids, valid)
        if gathered is not None:
            return gathered
    rows = take_rows(table, jnp.where(valid, ids, 0))
    return to_compute(jnp.where(valid[:, None], rows, jnp.zeros((), table.dtype)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup(config, table, slots, ids, valid, iterations, segments):
    """``(rows, table, slots)``: the gathered rows and the state passed on.

    A layer called twice in one step reads the state passed on by its first
    call in the second (`lookup`), so the two updates
    chain in the backward pass (the second call's, then the first's on top)
    instead of JAX summing two whole updated tables into the variable's
    "gradient".
    """
    return gather_valid(table, ids, valid), table, slots


def _forward(config, table, slots, ids, valid, iterations, segments):
    table, slots, ids, valid, iterations, segments = primal_values(
        (table, slots, ids, valid, iterations, segments)
    )
    rows = gather_valid(table, ids, valid, compiled=config.apply_update)
    # Where no later call updates the state first, the backward takes the
    # touched rows from these (a small array, still in cache) instead of
    # from the table: one random read of a large table less per distinct
    # row (26 tables of 1e6 rows on a CPU: ~20% of the step). The table in
    # the residuals is the one gathered from, so the values are the same.
    looked_up = rows if _reuses_forward_rows(table, config) else None
    residuals = (table, slots, ids, valid, iterations, segments, looked_up)
    return (rows, table, slots), residuals


def primal_values(tree):
    """``tree`` with the ``CustomVJPPrimal`` wrappers of a forward rule
    declared with ``symbolic_zeros=True`` taken off."""
    return jax.tree_util.tree_map(
        lambda p: p.value, tree, is_leaf=lambda p: isinstance(p, CustomVJPPrimal)
    )


def _reuses_forward_rows(table, config):
    # Under a distribution the rows are split by batch while the update's
    # distinct ids span the global batch: reading them from the rows would
    # take a collective, from the (replicated) table none.
    if keras.distribution.distribution() is not None:
        return False
    optimizer, constraint = config.items[:2]
    if fused_update_applies(optimizer, constraint, table):
        return False  # the compiled update reads the table's rows itself
    if REUSE_FORWARD_ROWS is not None:
        return bool(REUSE_FORWARD_ROWS)
    return table.size * table.dtype.itemsize >= FORWARD_ROWS_MIN_BYTES


def instantiate(cotangent):
    """An array for a cotangent that may be a ``SymbolicZero``."""
    if isinstance(cotangent, SymbolicZero):
        return jnp.zeros(cotangent.shape, cotangent.dtype)
    return cotangent


def chained_state(table, slots, table_after, slots_after):
    """``(table, slots, chained)``: the state a lookup's update starts from.

    The state passed on by the lookup (``table_after``, ``slots_after``:
    its cotangents) is nonzero when a later call of the layer in the same
    step read it: that call's update is then already applied to it, and
    this update goes on top (``chained``). Otherwise the lookup's own input
    state.
    """

    def passed_back(after, own):
        return own if isinstance(after, SymbolicZero) else after

    slots = {name: passed_back(slots_after[name], own) for name, own in slots.items()}
    chained = not isinstance(table_after, SymbolicZero)
    return passed_back(table_after, table), slots, chained


def _backward(config, residuals, cotangents):
    table, slots, ids, valid, iterations, segments, looked_up = residuals
    grads, table_after, slots_after = cotangents
    optimizer, constraint, apply_update, stochastic = config
    table, slots, chained = chained_state(table, slots, table_after, slots_after)
    if chained:
        looked_up = None  # the later call may have changed these rows
    if not apply_update:
        # Inference call inside a gradient computation: hand the state back
        # unchanged, since the optimizer assigns whatever is returned.
        return table, slots, None, None, None, None
    state = {"table": table, **slots}
    grads = instantiate(grads)
    num_rows = table.shape[0]
    if dense_row_updates.uses_dense_route(ids.shape[0], num_rows, constraint):
        updated = dense_row_updates.dense_row_updates(
            optimizer, state, ids, valid, grads, iterations, stochastic
        )
        table_out = updated.pop("table")
        return table_out, updated, None, None, None, None
    # Below the dense route's threshold the compiled call beats both XLA
    # routes (benchmarks/dense_route.py: 2x the dense route at a quarter
    # as many ids as rows); from it on, the dense route's vector pass over
    # the table beats the call's per-id hashing.
    fused = jax_native_rows.fused_rule(optimizer, constraint, table, slots.values())
    if fused is not None and set(state) == {"table", *fused[1]}:
        updated = jax_native_rows.fused_update(
            state, optimizer, ids, valid, grads, iterations, *fused, stochastic
        )
        table_out = updated.pop("table")
        return table_out, updated, None, None, None, None
    unique_ids, is_real, new_values = compute_row_updates(
        optimizer,
        lambda name, rows: take_rows(state[name], rows),
        tuple(slots),
        ids,
        valid,
        grads,
        iterations,
        num_rows,
        constraint,
        segments,
        looked_up=looked_up,
    )
    target = jnp.where(is_real, unique_ids, num_rows)  # out of range: dropped
    updated = {
        name: write_rows(
            state[name], target, new_values[name],
            write_seed(iterations, name, stochastic),
        )
        for name in state
    }  # fmt: skip
    table_out = updated.pop("table")
    return table_out, updated, None, None, None, None


_lookup.defvjp(_forward, _backward, symbolic_zeros=True)


class _Config:
    """Hashable carrier of the static (non-array) part of the update."""

    def __init__(self, optimizer, constraint, apply_update=True, stochastic=True):
        self.items = (optimizer, constraint, bool(apply_update), bool(stochastic))

    def __iter__(self):
        return iter(self.items)

    @property
    def apply_update(self):
        return self.items[2]

    def __hash__(self):
        return hash((id(self.items[0]), id(self.items[1]), *self.items[2:]))

    def __eq__(self, other):
        return isinstance(other, _Config) and (
            self.items[0] is other.items[0]
            and self.items[1] is other.items[1]
            and self.items[2:] == other.items[2:]
        )


@jax.custom_vjp
def reset_rows(state, ids, mask, values):
    """``state`` (dict of tables) with the rows at ``ids[mask]`` overwritten.

    ``values`` maps each name of ``state`` to ``[N, width]`` new rows. Its
    backward is the identity for ``state``: the lookup's backward returns the
    whole updated table as the table's "gradient", and that must reach the
    variable unchanged (a plain scatter would zero the reset rows in it).
    """
    return _reset_rows(state, ids, mask, values)


def _reset_rows(state, ids, mask, values):
    out = {}
    for name, table in state.items():
        target = jnp.where(mask, ids, table.shape[0])  # out of range: dropped
        out[name] = write_rows(table, target, values[name])  # initial values
    return out


def _reset_forward(state, ids, mask, values):
    return _reset_rows(state, ids, mask, values), (ids, mask, values)


def _reset_backward(residuals, grads):
    ids, mask, values = residuals
    zeros = jax.tree_util.tree_map(jnp.zeros_like, values)
    return grads, None, None, zeros


reset_rows.defvjp(_reset_forward, _reset_backward)


def fused_update_applies(optimizer, constraint, table, slots=()):
    """Whether the sparse update of ``table`` (a variable) and its ``slots``
    runs as one compiled custom call (`keras_sparse.ops.jax.native_rows`),
    which finds duplicates itself: such a table needs no dedup scratch."""
    found = jax_native_rows.fused_rule(optimizer, constraint, table, slots)
    return found is not None


def scratch_segments(scratch_var, ids, valid, num_rows):
    """`row_updates.scratch_segments`, the written scratch assigned back
    (the trainer donates the variable, so XLA writes it in place)."""
    written, segments = row_updates.scratch_segments(
        scratch_var.value, ids, valid, num_rows
    )
    scratch_var.assign(written)
    return segments


def lookup(state: TableState, batch: LookupBatch):
    """See the module docstring; ``batch.reset=(mask, values)``
    re-initializes rows.

    ``batch.segments``: optional ``[N]`` segment index per position computed
    ahead of the step (`keras_sparse.ops.row_updates.segments_from_positions`).
    ``batch.apply_update``: False hands the state back unchanged (an
    inference call inside a gradient computation). Unused on JAX:
    ``state.anchor_var`` (the table itself carries the update),
    ``batch.blocks`` and ``batch.exchange_slot`` (no exchange).

    With ``reset``, the rows ``ids[mask]`` get ``values[mask]`` (``[N, dim]``)
    and their optimizer slots their initial values before the gather (done
    functionally; the reset is part of the table returned by the backward).
    Outside a trace the reset is also assigned to the variables directly.
    """
    table_var, slot_vars, optimizer = state.table_var, state.slot_vars, state.optimizer
    table = table_var.value
    slots = {name: var.value for name, var in slot_vars.items()}
    ids = jnp.asarray(batch.ids, jnp.int32)
    if batch.reset is not None:
        mask, values = batch.reset
        mask = jnp.asarray(mask, bool)
        n = ids.shape[0]
        new_values = {"table": jnp.asarray(values)}
        for spec in optimizer.slot_specs():
            width = slots[spec.name].shape[1]
            new_values[spec.name] = jnp.full((n, width), spec.initial_value)
        reset = reset_rows({"table": table, **slots}, ids, mask, new_values)
        table = reset.pop("table")
        slots = reset
        if not isinstance(table, jax.core.Tracer):
            table_var.assign(table)
            for name, var in slot_vars.items():
                var.assign(slots[name])
    segments = batch.segments
    rows, table, slots = _lookup(
        _Config(
            optimizer,
            state.constraint,
            batch.apply_update,
            state.stochastic_rounding,
        ),  # fmt: skip
        table,
        slots,
        ids,
        jnp.asarray(batch.valid, bool),
        jnp.asarray(batch.iterations, jnp.int32),
        None if segments is None else jnp.asarray(segments, jnp.int32),
    )
    pass_on(table_var, table, slot_vars, slots)
    return rows


def pass_on(table_var, table, slot_vars, slots):
    """Inside a stateless call (a Keras training step), a later call of the
    layer in the same step reads the state this call passed on (see
    `_lookup`); the trainer keeps no assignment to these trainable
    variables, it assigns the backward's result."""
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    if not in_stateless_scope():
        return
    table_var.assign(table)
    for name, var in slot_vars.items():
        var.assign(slots[name])
