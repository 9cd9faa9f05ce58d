"""PyTorch: the one place rows are written back into a table or slot tensor."""

from keras_sparse.ops.row_rounding import is_sixteen_bit
from keras_sparse.ops.row_rounding import to_storage


def write_rows(tensor, rows, values, seed=None, native=None):
    """``tensor[rows] = values`` (float32) in place, in ``tensor``'s dtype:
    stochastically rounded for a 16-bit tensor with a ``seed``
    (`keras_sparse.ops.row_rounding`). ``native``: the compiled helpers,
    whose scatter writes float32 rows where it fits."""
    if is_sixteen_bit(tensor.dtype):
        values = to_storage(values, tensor.dtype, rows, seed)
    else:  # torch operations only: the tables of a stack update in threads
        values = values.to(tensor.dtype)
    if native is not None and _scatter_fits(tensor, rows, values):
        native.scatter_rows(
            tensor.detach().numpy(), rows.numpy(), values.detach().numpy()
        )
        # Writes through NumPy bypass autograd's version counter; a graph
        # that saved the table must still see it changed.
        tensor[:0].zero_()
    else:
        tensor.index_copy_(0, rows, values)


def _scatter_fits(tensor, rows, values):
    """Whether ``tensor[rows] = values`` suits the compiled scatter (CPU
    float32, whole contiguous rows); where not (say a custom optimizer's
    slot of another shape), ``index_copy_`` runs and raises as torch does."""
    import torch

    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32
            for t in (tensor, values))
        and tensor.dim() == 2
        and tensor.is_contiguous()
        and tuple(values.shape) == (rows.shape[0], tensor.shape[1])
    )  # fmt: skip
