"""A table's storage dtype, its slots' dtype and how rows round into them.

``table_dtype`` stores the table in 16 bits (``"bfloat16"``, ``"float16"``)
while lookups and the sparse optimizer's math stay in float32: Keras's
``dtype=`` is a policy that sets the compute dtype too, and no Keras policy
means 16-bit storage with float32 math. Rows written back round
stochastically (`keras_sparse.ops.row_rounding`) unless
``stochastic_rounding=False``. ``slot_dtype`` stores the optimizer's
slots: float32 (default) or 16 bits. Bytes per row, ``dim`` wide:

=================  ===========  ======================  =====================
table / slots      table        Adagrad (1 slot)        Adam (2 slots)
=================  ===========  ======================  =====================
float32 / float32  ``4 dim``    ``8 dim``               ``12 dim``
bfloat16/float32   ``2 dim``    ``6 dim``               ``10 dim``
bfloat16/bfloat16  ``2 dim``    ``4 dim``               ``6 dim``
=================  ===========  ======================  =====================

(float16 as bfloat16; RowWiseAdagrad's slot is one value per row: 4 or 2
bytes.)
"""

from keras_sparse.layers.arguments import ArgumentError

STORAGE_DTYPES = ("float32", "bfloat16", "float16")


class TableStorage:
    """The checked storage settings of one layer's table.

    ``table_dtype``/``slot_dtype`` None: the layer's variable dtype (Keras's
    ``dtype=`` policy; float32 by default), as before these settings.
    """

    def __init__(self, layer_name, table_dtype=None, stochastic_rounding=True,
                 slot_dtype=None, where=None):  # fmt: skip
        # ``where``: what errors name instead of the layer (a TableConfig).
        where = where or f"Layer '{layer_name}'"
        for arg, value in (("table_dtype", table_dtype), ("slot_dtype", slot_dtype)):
            if value is not None and value not in STORAGE_DTYPES:
                raise ArgumentError(
                    f"{where}: `{arg}` must be one of "
                    f"{', '.join(repr(d) for d in STORAGE_DTYPES)} (or None: "
                    f"the layer's variable dtype). Received: {arg}={value!r}."
                )
        if not isinstance(stochastic_rounding, bool):
            raise ArgumentError(
                f"{where}: `stochastic_rounding` must be True or "
                f"False. Received: stochastic_rounding={stochastic_rounding!r}."
            )
        self.table_dtype = table_dtype
        self.stochastic_rounding = stochastic_rounding
        self.slot_dtype = slot_dtype

    def is_sixteen_bit(self):
        return (self.table_dtype or "float32") != "float32" or (
            self.slot_dtype or "float32"
        ) != "float32"

    def check_sparse(self, layer_name, sparse):
        """16-bit storage needs the sparse update: the model's optimizer
        would round its updates to nearest."""
        if self.is_sixteen_bit() and not sparse:
            raise ArgumentError(
                f"Layer '{layer_name}': `table_dtype`/`slot_dtype` 16-bit "
                "storage needs a sparse `optimizer` (its updates round "
                "stochastically; the model's optimizer would round them to "
                "nearest). Pass optimizer=..., or dtype='bfloat16' for a "
                "Keras bfloat16 layer."
            )

    def check_no_store(self, layer_name, store, arg="store"):
        """Row stores keep float32 rows: 16-bit storage is refused beside
        one."""
        if self.is_sixteen_bit() and store is not None:
            raise ArgumentError(
                f"Layer '{layer_name}': `table_dtype`/`slot_dtype` 16-bit "
                f"storage cannot be combined with `{arg}` (its row store "
                f"keeps float32 rows). Received: table_dtype="
                f"{self.table_dtype!r}, slot_dtype={self.slot_dtype!r}."
            )

    def stack_suffix(self):
        """What tables must share to share a stacked variable (their dtype,
        their slots' and how rows round into them), as a suffix of the
        stack's name: empty without 16-bit storage, so that float32 stacks
        keep their names."""
        if not self.is_sixteen_bit():
            return ""
        table, slots = self.table_dtype or "float32", self.slot_dtype or "float32"
        return f"_{table}_{slots}" + ("" if self.stochastic_rounding else "_nearest")

    def config(self):
        return {
            "table_dtype": self.table_dtype,
            "stochastic_rounding": self.stochastic_rounding,
            "slot_dtype": self.slot_dtype,
        }


ARGUMENTS = ("table_dtype", "stochastic_rounding", "slot_dtype")
