"""GPU table: the shared algorithm on CuPy arrays with CUDA kernels for the hot paths.

``keras_sparse/kernels/hash_table.cu`` is compiled once per process by
``cupy.RawModule`` (NVRTC) and cached at module level.  Hashing and bucket
choice are identical to the CPU twin, so both give the same rows for the same
call sequence.
Placement/eviction rounds reuse ``ArrayTable``'s vectorized code on CuPy
arrays (host syncs only where a result size must be read).

Kernel path vs fallback:

* ``find`` (lookup, the probe of ``lookup_or_insert``, erase): always
  ``ks_find``, 16 lanes per key, one 16-byte digest load per bucket chunk.
* placement of new keys, per round: ``ks_claim_compact`` ranks, places and
  writes the keys whose chosen bucket is compact (no holes from erase/import_)
  after one ``cupy.sort`` of (bucket, arrival) words; a round that touches a
  holey bucket uses ``ArrayTable._claim_write`` on CuPy arrays instead.
* eviction, once every pending key's buckets are full (a full table: from
  the first round): ``ks_evict_rounds`` runs all rounds in one launch of one
  block (victims, earliest-bidder-wins, protection of this call's keys), so
  the call pays one launch and one host read instead of a dozen CuPy
  operations and several host syncs per round (batches of more than
  ``_FUSED_EVICT_MAX`` evicting keys keep the per-round CuPy code, which
  spreads each round over the whole GPU).  With LRU this call's slots
  are protected by ``score == step`` (as on the CPU twin), so an evicting
  call allocates nothing of the table's size.
* dedup of the batch, admission, load-balanced bucket choice, the first
  eviction round of a batch that also has free room, and overflow stay in the
  shared host-orchestrated CuPy code, so rows equal the CPU twin's exactly.
  (A concurrent atomicCAS insert would pick slots in a nondeterministic order
  and break that equality, so it is deliberately not used.)
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from .array_table import ArrayTable
from .cuda_modules import module as _module
from .insert_call import FusedInsert
from .keys import to_cupy_keys  # noqa: F401  (re-exported for the front class)
from .undo import evicted_log

_BLOCK = 256


def _launch(name, n, args, lanes=1):
    """Launch ``name`` with ``lanes`` threads per item (a power of two <= 32)."""
    if n:
        threads = n * lanes
        _module().get_function(name)(
            ((threads + _BLOCK - 1) // _BLOCK,), (_BLOCK,), args
        )


_TILE = 16  # lanes per key in ks_find (KS_TILE in the .cu file)
_EVICT_BLOCK = 1024  # ks_evict_rounds runs as one block (rounds need a barrier)
# One block serves a batch's evicting keys well while launches and syncs
# dominate (embedding batches); far larger batches (1M-key bulk inserts) keep
# the whole GPU busy with one CuPy round at a time instead.
_FUSED_EVICT_MAX = 1 << 16
_NO_BID = np.iinfo(np.int64).max  # KS_NO_BID in the .cu file


class CupyTable(ArrayTable):
    """``ArrayTable`` on the current CuPy device."""

    xp = cp
    device = "gpu"
    # LRU marks this call's slots by score == step: no capacity-sized mask
    _score_protect = True

    # Size and counters: the host's part plus the one-launch calls' account
    # on the device, read (one sync) when the host asks for either.
    @property
    def size(self):
        self._read_account()
        return self._size

    @size.setter
    def size(self, value):
        self._read_account()
        self._size = value

    @property
    def counters(self):
        self._read_account()
        return self._counters

    @counters.setter
    def counters(self, value):
        self._counters = value

    def _read_account(self):
        fused = self.__dict__.get("_fused_insert")
        if fused is not None:
            fused.read()

    def step_rows(self, k, use, out, step=None):
        """See `FusedInsert.step_rows` (None: use `lookup_or_insert_fresh`)."""
        return FusedInsert.of(self).step_rows(k, use, out, step)

    def lookup_or_insert(self, k, step=None):
        fused = FusedInsert.of(self).call(k, step)
        return super().lookup_or_insert(k, step) if fused is None else fused[0]

    def lookup_or_insert_fresh(self, k, step=None, undo=None):
        if undo is not None:
            # The one-launch call keeps no pre-images: the multi-launch path
            # (same rows) records them.
            return super().lookup_or_insert_fresh(k, step, undo)
        fused = FusedInsert.of(self).call(k, step)
        return super().lookup_or_insert_fresh(k, step) if fused is None else fused

    def _add_at(self, arr, idx, val):
        idx = cp.ascontiguousarray(idx, dtype=cp.int64)
        n = int(idx.shape[0])
        if arr.dtype == cp.uint32:
            val = cp.ascontiguousarray(cp.broadcast_to(val, (n,)), dtype=cp.uint32)
            _launch("ks_add_u32", n, (arr, idx, val, np.int64(n)))
        elif arr.dtype == cp.int64:
            val = cp.ascontiguousarray(cp.broadcast_to(val, (n,)), dtype=cp.int64)
            _launch("ks_add_i64", n, (arr, idx, val, np.int64(n)))
        else:
            raise TypeError(f"unsupported scatter-add dtype {arr.dtype}")

    def _stable_argsort(self, x):
        return cp.argsort(x)  # always stable; older CuPy has no ``kind``

    def hash(self, k):
        k = cp.ascontiguousarray(k, dtype=cp.int64)
        n = int(k.shape[0])
        b1 = cp.empty(n, dtype=cp.int64)
        b2 = cp.empty(n, dtype=cp.int64)
        d = cp.empty(n, dtype=cp.uint8)
        _launch(
            "ks_hash",
            n,
            (
                k,
                np.int64(n),
                np.uint64(self.salt),
                np.uint64(self.num_buckets),
                b1,
                b2,
                d,
            ),
        )
        return b1, b2, d

    def probe(self, k, b1=None, b2=None, d=None):
        # The kernel rehashes in registers, cheaper than reading b1/b2/d back.
        k = cp.ascontiguousarray(k, dtype=cp.int64)
        n = int(k.shape[0])
        rows = cp.empty(n, dtype=cp.int64)
        args = (
            k,
            np.int64(n),
            np.uint64(self.salt),
            np.uint64(self.num_buckets),
            np.int32(self.bucket_size),
        )
        # 16-lane tile per key: vector digest load + ballot (ks_lookup is the
        # one-thread-per-key reference version of the same probe).
        _launch("ks_find", n, args + (self.keys, self.digest, rows), lanes=_TILE)
        return rows

    def find(self, k):
        return self.probe(k)  # hashing happens inside the kernel

    def _claim_write(self, a, choose, ak, d, new_score):
        """Kernel path of one placement round when every chosen bucket is compact.

        Same result as ``ArrayTable._claim_write`` (see ``ks_claim_compact``);
        buckets with holes (after erase/import_) take the generic CuPy path.
        """
        n = int(choose.shape[0])
        if n == 0 or bool(self.holey[choose].any()):
            return super()._claim_write(a, choose, ak, d, new_score)
        sh = max(n - 1, 1).bit_length()
        comp = cp.sort((choose << sh) | cp.arange(n, dtype=cp.int64))
        slots = cp.empty(n, dtype=cp.int64)
        ok = cp.empty(n, dtype=cp.bool_)
        _launch(
            "ks_claim_compact",
            n,
            (
                comp,
                np.int64(n),
                np.int32(sh),
                np.int32(self.bucket_size),
                self.load,
                cp.ascontiguousarray(a, dtype=cp.int64),
                cp.ascontiguousarray(ak, dtype=cp.int64),
                cp.ascontiguousarray(d, dtype=cp.uint8),
                cp.ascontiguousarray(
                    cp.broadcast_to(new_score, ak.shape), dtype=cp.int64
                ),
                self.keys,
                self.digest,
                self.score,
                slots,
                ok,
            ),
        )
        return a[ok], slots[ok], a[~ok]

    def _evict_rounds(self, keys_idx, b1, b2, ak, d, new_score, res, prot, rounds):
        """Kernel version of ``ArrayTable._evict_rounds`` (see ks_evict_rounds)."""
        m = int(keys_idx.shape[0])
        if m == 0 or rounds <= 0:
            return keys_idx, [], []
        if m > _FUSED_EVICT_MAX or evicted_log(self) is not None:
            # (the generic rounds note what they evict for an undo record)
            return super()._evict_rounds(
                keys_idx, b1, b2, ak, d, new_score, res, prot, rounds
            )
        if getattr(self, "_bids", None) is None:
            self._bids = cp.full(self.num_buckets, _NO_BID, dtype=cp.int64)
        won_round = cp.full(m, -1, dtype=cp.int32)
        victim = cp.empty(m, dtype=cp.int64)
        ev_key = cp.empty(m, dtype=cp.int64)
        overflows = cp.zeros(1, dtype=cp.int64)
        per_key = int(new_score.ndim > 0)
        score = cp.ascontiguousarray(new_score, dtype=cp.int64).reshape(-1)
        by_step = isinstance(prot, int)  # LRU: protected == score is the step
        step = prot if by_step else 0
        if by_step:
            prot = cp.zeros(1, dtype=cp.bool_)  # unread
        _module().get_function("ks_evict_rounds")(
            (1,),
            (_EVICT_BLOCK,),
            (
                cp.ascontiguousarray(keys_idx, dtype=cp.int64),
                np.int64(m),
                np.int32(self.bucket_size),
                np.int32(rounds),
                b1,
                b2,
                cp.ascontiguousarray(ak, dtype=cp.int64),
                cp.ascontiguousarray(d, dtype=cp.uint8),
                score,
                np.int32(per_key),
                np.int64(step),
                np.int32(by_step),
                prot,
                self.keys,
                self.digest,
                self.score,
                self._bids,
                victim,
                won_round,
                ev_key,
                res,
                overflows,
            ),
        )
        self.counters["overflows"] += int(overflows[0])
        # Evicted (key, row) pairs in round order, then arrival order.
        winners = cp.flatnonzero(won_round >= 0)
        winners = winners[cp.argsort(won_round[winners])]  # stable
        pending = keys_idx[won_round == -1]
        return pending, [ev_key[winners]], [victim[winners]]
