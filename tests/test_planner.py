"""The sharding planner's choices (pure Python)."""

import keras
import pytest

import keras_sparse as ks
from keras_sparse.sharding import TableSpec
from keras_sparse.sharding import plan

pytestmark = pytest.mark.backend_independent

MiB = 1 << 20
GiB = 1 << 30


def test_small_tables_are_replicated():
    tables = [TableSpec(f"t{i}", 1000, 16, slot_widths=[16]) for i in range(4)]
    p = plan(tables, devices=8, memory_per_device=GiB, batch_size=4096)
    assert {t.strategy for t in p} == {"data"}
    # Replicated tables cost their full size on every device.
    assert p["t0"].bytes_per_device == 1000 * 32 * 4
    assert p["t0"].devices == tuple(range(8))


def test_huge_table_is_row_sharded():
    huge = TableSpec("huge", 80_000_000, 64, slot_widths=[1])
    small = TableSpec("small", 100, 8)
    p = plan([huge, small], devices=8, memory_per_device=4 * GiB, batch_size=1024)
    assert p.strategy("huge") == "row"
    assert p["huge"].bytes_per_device == 80_000_000 * 65 * 4 // 8
    assert p.strategy("small") == "data"


def test_medium_table_goes_table_wise_when_row_impossible():
    # 1000003 rows: not divisible by 8 and no sparse optimizer (so no
    # padding), too big to replicate everywhere, fits whole on one device.
    t = TableSpec("odd", 1_000_003, 32, sparse_update=False)
    p = plan([t], devices=8, memory_per_device=200 * MiB, batch_size=64, pinned=None)
    assert p.strategy("odd") in ("data", "table")
    p = plan(
        [t],
        devices=8,
        memory_per_device=200 * MiB,
        batch_size=64,
        strategies=("row", "column", "table"),
    )
    assert p.strategy("odd") in ("table", "column")


def test_uneven_rows_are_row_sharded_with_padding():
    t = TableSpec("odd", 1_000_003, 32, slot_widths=[32])
    p = plan([t], devices=8, strategies=("row",))
    assert p.strategy("odd") == "row"
    # ceil(1000003 / 8) rows per device, table + accumulator.
    assert p["odd"].bytes_per_device == 125_001 * 64 * 4


def test_table_wise_bin_packing_spreads_tables():
    tables = [TableSpec(f"t{i}", 2_000_000 + 8 * i, 16) for i in range(8)]
    p = plan(
        tables,
        devices=8,
        memory_per_device=200 * MiB,
        batch_size=8192,
        strategies=("table",),
    )
    assert sorted(d for t in p for d in t.devices) == list(range(8))


def test_pinned_is_honoured():
    tables = [TableSpec("a", 1000, 16), TableSpec("b", 1000, 16)]
    p = plan(tables, devices=8, pinned={"a": "row", "b": "column"})
    assert p.strategy("a") == "row" and p.strategy("b") == "column"
    assert "pinned" in p["a"].reason


def test_layer_sharding_counts_as_pinned_and_slots_counted():
    layer = ks.AllToAllDenseEmbedding(1024, 8, optimizer="adagrad", sharding="row")
    other = ks.AllToAllDenseEmbedding(64, 8, optimizer="rowwise_adagrad")
    p = plan([layer, other], devices=8)
    assert p.strategy(layer.name) == "row"
    # Table + per-element accumulator, split over 8 devices.
    assert p[layer.name].bytes_per_device == 1024 * 16 * 4 // 8
    assert p[other.name].spec.slot_widths == (1,)


def test_infeasible_raises_naming_the_table():
    t = TableSpec("giant", 1_000_000_000, 128)
    with pytest.raises(ValueError, match="giant.*1000000000 rows x 128 dim"):
        plan([t], devices=8, memory_per_device=GiB)


def test_bad_pins_raise():
    t = TableSpec("a", 100, 8)
    with pytest.raises(ValueError, match="unknown tables"):
        plan([t], pinned={"zzz": "row"})
    with pytest.raises(ValueError, match="pinned strategy"):
        plan([t], pinned={"a": "diagonal"})
    with pytest.raises(ValueError, match="not divisible"):
        plan(
            [TableSpec("odd", 101, 8, sparse_update=False)],
            devices=8,
            pinned={"odd": "row"},
        )


def test_plan_prints_a_table():
    tables = [TableSpec("small", 100, 8), TableSpec("huge", 80_000_000, 64)]
    text = str(plan(tables, devices=8, memory_per_device=4 * GiB))
    lines = text.splitlines()
    assert lines[0].split() == [
        "table",
        "rows",
        "dim",
        "strategy",
        "devices",
        "bytes/device",
        "comm",
        "bytes/step",
    ]
    assert any(line.startswith("huge") and " row " in line for line in lines)
    assert any(line.startswith("small:") for line in lines)  # reason line


def test_memory_is_held_back_for_later_tables():
    # 26 tables of growing size: replicating them all needs ~180 MiB/device,
    # sharding them all ~22 MiB. With 32 MiB the small ones are replicated and
    # the big ones sharded, and nothing is left without room.
    rows = [8 * int(2 * 1.45**i) for i in range(26)]
    tables = [
        TableSpec(f"t{i:02d}", r, 16, slot_widths=[16]) for i, r in enumerate(rows)
    ]
    p = plan(
        tables,
        devices=8,
        memory_per_device=32 * MiB,
        batch_size=256,
        strategies=("data", "row", "column"),
    )
    strategies = [p.strategy(f"t{i:02d}") for i in range(26)]
    assert strategies[0] == "data" and strategies[-1] == "row"
    assert max(p.device_bytes) <= 32 * MiB


def test_hash_embedding_tables_are_planned_like_fixed_ones():
    if not hasattr(ks, "DistributedHashEmbedding"):
        pytest.skip("no DistributedHashEmbedding")
    layer = ks.DistributedHashEmbedding(8, capacity=1024, optimizer="adagrad")
    p = plan([layer], devices=8)
    assert p.strategy(layer.name) == "data"  # small: replicated
    # Too big to replicate: split like a fixed-vocabulary table.
    full = 1024 * 16 * 4  # table + accumulator
    # Replicated: two int32 key words and a row per table row, and the
    # bucket directory (2**10 + 1 int32 starts for 1024 rows).
    serving_map = 1024 * 12 + (1024 + 1) * 4
    p = plan([layer], devices=8, memory_per_device=full // 4 + serving_map)
    assert p.strategy(layer.name) in ("row", "column")
    assert p[layer.name].bytes_per_device == full // 8 + serving_map


def _stacked_collection(pins):
    return ks.EmbeddingCollection(
        {
            name: ks.TableConfig(rows, dim, sharding=pins.get(name, "auto"))
            for name, (rows, dim) in {
                "wide": (1000, 16),
                "narrow": (1000, 8),
            }.items()
        },
        optimizer="adagrad",
        name="features",
    )


def test_table_wise_bytes_count_the_padded_stack_on_every_device():
    # Two table-wise stacks (dim 16, dim 8). Each device holds B rows of each
    # stack, B its busiest device's rows: 1000 * (16 + 16) * 4 + 1000 *
    # (8 + 8) * 4 bytes on every device, not only on the tables' owners.
    coll = _stacked_collection({"wide": "table", "narrow": "table"})
    p = plan([coll], devices=8)
    assert p.strategy("features/wide") == p.strategy("features/narrow") == "table"
    assert p["features/wide"].devices != p["features/narrow"].devices
    want = 1000 * 32 * 4 + 1000 * 16 * 4
    assert p.device_bytes == [want] * 8
    # The table rows keep their own bytes; a line per stack shows the padding.
    assert p["features/narrow"].bytes_per_device == 1000 * 16 * 4
    assert {(s.name, s.block_rows) for s in p.stacks} == {
        ("features/stack_16_table", 1000),
        ("features/stack_8_table", 1000),
    }
    text = str(p)
    assert "features/stack_8_table (table-wise stack of 1 tables): 8 x 1000" in text
    assert f"max bytes/device {want / 1024:.1f} KiB" in text


def test_table_wise_placement_that_only_fits_unpadded_is_refused():
    # Owner-only accounting puts "wide" (125 KiB) on one device and "narrow"
    # (62.5 KiB) on another: 125 KiB max, under 150000 bytes. The stacks are
    # padded: every device holds both, 187.5 KiB.
    budget = 150_000
    coll = _stacked_collection({"wide": "table", "narrow": "table"})
    with pytest.raises(ValueError, match=r"'features/narrow'.*fits no strategy") as e:
        plan([coll], devices=8, memory_per_device=budget)
    assert "stack features/stack_8_table grows by 62.5 KiB/device" in str(e.value)
    # Enough for both padded stacks: it fits exactly.
    p = plan([coll], devices=8, memory_per_device=1000 * 48 * 4)
    assert {t.strategy for t in p} == {"table"}

    # "narrow" free to choose: its few lookups leave table-wise no dearer
    # than row-wise (ties go to "table"), but its stack does not fit.
    coll = _stacked_collection({"wide": "table"})
    kwargs = dict(
        devices=8,
        batch_size=1024,
        ids_per_sample={"features/wide": 64, "features/narrow": 1},
        strategies=("table", "row"),
    )
    assert plan([coll], **kwargs).strategy("features/narrow") == "table"
    p = plan([coll], memory_per_device=budget, **kwargs)
    assert p.strategy("features/wide") == "table"
    assert p.strategy("features/narrow") == "row"
    assert "table: stack features/stack_8_table grows" in p["features/narrow"].reason
    assert p.device_bytes == [1000 * 32 * 4 + 1000 * 16 * 4 // 8] * 8
    assert max(p.device_bytes) <= budget


@pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="sharding is implemented for JAX"
)
def test_planned_bytes_match_the_live_stacks_on_each_device():
    from keras_sparse import sharding

    rows = {"t0": 61, "t1": 23, "t2": 40, "t3": 9, "t4": 35, "t5": 50, "t6": 17}
    dims = {"t0": 8, "t1": 8, "t2": 4, "t3": 8, "t4": 4, "t5": 8, "t6": 4}
    coll = ks.EmbeddingCollection(
        {n: ks.TableConfig(r, dims[n]) for n, r in rows.items()},
        optimizer="adam",  # two slots per row
        sharding="table",
        name="features",
    )
    dist = sharding.distribution([coll], devices=8)
    p = dist.keras_sparse_plan
    assert {t.strategy for t in p} == {"table"}
    keras.distribution.set_distribution(dist)
    try:
        coll.build()
        on_device = {}
        for stack in coll.stacks:
            for var in coll.stack_variables(stack.name):
                for shard in var.value.addressable_shards:
                    nbytes = shard.data.size * shard.data.dtype.itemsize
                    on_device[shard.device] = on_device.get(shard.device, 0) + nbytes
        first = sum(
            var.value.addressable_shards[0].data.size
            * var.value.addressable_shards[0].data.dtype.itemsize
            for stack in coll.stacks
            for var in coll.stack_variables(stack.name)
        )
    finally:
        keras.distribution.set_distribution(None)
    assert len(on_device) == 8
    assert p.device_bytes[0] == first
    assert sorted(p.device_bytes) == sorted(on_device.values())
    # Device 0's own tables alone are fewer bytes: the padding is counted.
    owned = [t for t in p if t.devices == (0,)]
    assert sum(t.spec.rows * t.spec.dim * 3 * 4 for t in owned) < first
