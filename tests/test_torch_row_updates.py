"""PyTorch's native sparse update against NumPy (and its dedup against np.unique)."""

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tests.helpers import adagrad_case
from tests.helpers import adagrad_case_strategies
from tests.helpers import numpy_adagrad

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="the torch backend's own update"
)


def _torch():
    import torch

    from keras_sparse.ops.torch import row_updates as torch_row_updates

    return torch, torch_row_updates


class _Holder:
    """Stands in for the table's Keras variable (it only holds the scratch)."""


@settings(max_examples=60, deadline=None)
@given(
    keys=st.lists(st.integers(0, 40), min_size=1, max_size=300),
    garbage=st.integers(-(2**31), 2**31 - 1),
)
def test_distinct_keys_matches_numpy_unique_whatever_the_scratch_holds(keys, garbage):
    torch, updates = _torch()
    keys = torch.tensor(keys, dtype=torch.int64)
    scratch = torch.full((41,), garbage, dtype=torch.int32)
    unique, inverse = updates.distinct_keys(keys, scratch)
    assert inverse.dtype == torch.int64
    np.testing.assert_array_equal(np.sort(unique.numpy()), np.unique(keys.numpy()))
    np.testing.assert_array_equal(unique[inverse].numpy(), keys.numpy())


@settings(max_examples=40, deadline=None)
@given(**adagrad_case_strategies())
def test_update_matches_numpy_adagrad(seed, n, num_rows, invalid_share, prepared):
    torch, updates = _torch()
    from keras_sparse import optimizers

    table, acc, ids, valid, grads, segments = adagrad_case(
        seed, n, num_rows, invalid_share, prepared
    )
    if segments is not None:
        segments = torch.tensor(segments)
    state = {"table": torch.tensor(table), "accumulator": torch.tensor(acc)}
    opt = optimizers.Adagrad(0.1, epsilon=1e-7)
    garbage = torch.randint(-5, 5, (num_rows + 3,), dtype=torch.int32)
    updates.apply_row_updates(
        state,
        garbage,
        opt,
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor(valid),
        torch.tensor(grads),
        torch.tensor(0),
        None,
        segments,
    )
    ref_table, ref_acc = numpy_adagrad(table, acc, ids, valid, grads, 0.1, 1e-7)
    close = dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["table"].numpy(), ref_table, **close)
    np.testing.assert_allclose(state["accumulator"].numpy(), ref_acc, **close)


def test_scratch_follows_the_table_size():
    torch, updates = _torch()
    holder = _Holder()
    first = updates.scratch_for(holder, 11, torch.device("cpu"))
    assert updates.scratch_for(holder, 11, torch.device("cpu")) is first
    assert updates.scratch_for(holder, 21, torch.device("cpu")).shape == (21,)


@pytest.mark.parametrize("batch_major", [True, False])
def test_table_blocks_split_positions_and_rows(batch_major):
    # Two tables stacked (rows 0-3 and 4-9), 3 samples; table a has 2 ids
    # per sample, table b 1.
    torch, updates = _torch()
    a = torch.tensor([[0, 1], [2, 3], [1, 1]])
    b = torch.tensor([[4], [9], [5]])
    if batch_major:
        ids = torch.cat([a, b], 1).reshape(-1)
    else:
        ids = torch.cat([a.reshape(-1), b.reshape(-1)])
    grads = ids[:, None].float().repeat(1, 2)
    from keras_sparse.ops.row_updates import TableBlocks

    blocks = TableBlocks(batch_major, [2, 1] if batch_major else [6, 3],
                                 [(0, 4), (4, 10)])  # fmt: skip
    parts = list(blocks.split(ids, ids >= 0, grads))
    assert [(p[3], p[4]) for p in parts] == [(0, 4), (4, 10)]
    np.testing.assert_array_equal(parts[0][0].numpy(), a.reshape(-1).numpy())
    np.testing.assert_array_equal(parts[1][0].numpy(), b.reshape(-1).numpy() - 4)
    np.testing.assert_array_equal(parts[1][2][:, 0].numpy(), b.reshape(-1).numpy())
