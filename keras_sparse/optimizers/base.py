"""Base class of the sparse (row-wise) optimizers.

A sparse optimizer is a small pure function over the rows a batch touched:
``update(rows, slots, grads, iterations) -> (new_rows, new_slots)``. The
embedding layer owns the table and the slot variables; it gathers the touched
rows, calls ``update`` inside its backward pass and scatters the results back,
so a step costs the same whatever the size of the table.
"""

import keras
from keras import ops

_SCHEDULE_TYPES = (keras.optimizers.schedules.LearningRateSchedule,)


class SlotSpec:
    """Describes one optimizer slot: its name, width and initial value.

    ``row_wise=True`` keeps one value per row (shape ``[rows, 1]``) instead of
    one per embedding element (shape ``[rows, dim]``).
    """

    def __init__(self, name, initial_value=0.0, row_wise=False):
        self.name = name
        self.initial_value = float(initial_value)
        self.row_wise = row_wise

    def shape(self, num_rows, dim):
        return (num_rows, 1 if self.row_wise else dim)

    def initializer(self):
        """The slot variable's initializer: ``initial_value`` everywhere."""
        return _Fill(self.initial_value)


class _Fill:
    """Every entry ``value``, in one allocation (Keras's ``Constant`` scales
    a tensor of ones, which holds a gigabyte slot twice while it builds)."""

    def __init__(self, value):
        self.value = value

    def __call__(self, shape, dtype=None):
        return ops.full(shape, self.value, dtype=dtype)


class SparseOptimizer:
    """Common behaviour of the sparse optimizers.

    Subclasses define ``slot_specs()`` and the update: ``update_rows``, or
    ``new_slots`` and ``rows_from_slots`` (the rows from the updated slots,
    which lets a whole-table update write the slots in place); they see
    only the touched rows, with duplicate ids already summed.

    Args:
        learning_rate: a float, or a
            `keras.optimizers.schedules.LearningRateSchedule` evaluated at the
            layer's own step counter.
    """

    #: Short name used by ``keras_sparse.optimizers.get``.
    identifier = None

    def __init__(self, learning_rate=0.001):
        if isinstance(learning_rate, dict):
            learning_rate = keras.optimizers.schedules.deserialize(learning_rate)
        if not isinstance(learning_rate, _SCHEDULE_TYPES):
            if not isinstance(learning_rate, (int, float)) or isinstance(
                learning_rate, bool
            ):
                raise ValueError(
                    f"{type(self).__name__}: `learning_rate` must be a float or "
                    "a keras.optimizers.schedules.LearningRateSchedule. "
                    f"Received: learning_rate={learning_rate!r}"
                )
            if learning_rate <= 0:
                raise ValueError(
                    f"{type(self).__name__}: `learning_rate` must be > 0. "
                    f"Received: learning_rate={learning_rate}"
                )
            learning_rate = float(learning_rate)
        self.learning_rate = learning_rate

    def slot_specs(self):
        """The slots this optimizer keeps per row (a list of `SlotSpec`)."""
        return []

    def current_learning_rate(self, iterations, dtype="float32"):
        """Learning rate at ``iterations`` completed updates."""
        if isinstance(self.learning_rate, _SCHEDULE_TYPES):
            return ops.cast(self.learning_rate(iterations), dtype)
        return ops.cast(self.learning_rate, dtype)

    def update(self, rows, slots, grads, iterations):
        """Applies one step to the touched rows.

        Args:
            rows: ``[n, dim]`` current values of the touched rows.
            slots: dict slot name -> ``[n, dim]`` (or ``[n, 1]``) values.
            grads: ``[n, dim]`` summed gradient of each touched row.
            iterations: number of updates done before this one (scalar int).

        Returns:
            ``(new_rows, new_slots)`` with the same shapes.
        """
        grads, lr = self._grads_and_rate(rows, grads, iterations)
        return self.update_rows(rows, slots, grads, lr, iterations)

    def _grads_and_rate(self, rows, grads, iterations):
        dtype = rows.dtype
        return ops.cast(grads, dtype), self.current_learning_rate(iterations, dtype)

    def update_rows(self, rows, slots, grads, lr, iterations):
        """``(new_rows, new_slots)``: by default `new_slots`, then
        `rows_from_slots` on them."""
        new = self.new_slots(rows, slots, grads, lr, iterations)
        return self.rows_from_slots(rows, new, grads, lr, iterations), new

    def new_slots(self, rows, slots, grads, lr, iterations):
        """The updated slots (dict); with `rows_from_slots`, the update in
        two stages (optional: `update_rows` may do both at once)."""
        raise NotImplementedError

    def rows_from_slots(self, rows, new_slots, grads, lr, iterations):
        """The updated rows, from the updated slots (see `new_slots`)."""
        raise NotImplementedError

    def splits_update(self):
        """True when `new_slots` and `rows_from_slots` define the update:
        both are defined, and no class at or below them in the hierarchy
        redefines `update_rows` or `update` (a subclass of `Adam` that
        clips its gradients in `update_rows` must be used as it is)."""
        mro = type(self).__mro__

        def defined_at(name):  # index in the MRO of the class defining it
            return next(i for i, c in enumerate(mro) if name in c.__dict__)

        base = mro.index(SparseOptimizer)
        split = [defined_at("new_slots"), defined_at("rows_from_slots")]
        if base in split:
            return False
        return min(defined_at("update_rows"), defined_at("update")) > max(split)

    def update_slots_then_rows(self, rows, slots, grads, iterations, keep):
        """`update` in two stages (requires `splits_update`): the new slots,
        passed through ``keep(new, old, name)`` (what the caller stores), then the
        rows from the kept slots. Returns ``(new_rows, kept)``.

        For a caller that keeps only some rows' updates (a whole-table
        update), computing the rows from the kept slots lets the compiler
        write each slot in place before the rows read it.
        """
        grads, lr = self._grads_and_rate(rows, grads, iterations)
        new = self.new_slots(rows, slots, grads, lr, iterations)
        kept = {name: keep(value, slots[name], name) for name, value in new.items()}
        return self.rows_from_slots(rows, kept, grads, lr, iterations), kept

    def get_config(self):
        lr = self.learning_rate
        if isinstance(lr, _SCHEDULE_TYPES):
            lr = keras.optimizers.schedules.serialize(lr)
        return {"learning_rate": lr}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"
