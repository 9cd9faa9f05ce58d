/* The host side of a fixed-vocabulary table with `cache_rows`
 * (keras_sparse.ops.native_cache, for keras_sparse.layers.row_storage.dense_slots).
 *
 * Built on first use by the system C compiler and called through ctypes on
 * the NumPy arrays of the id <-> cache row map and on the cache variables'
 * and the dense store's row arrays, in place. `ks_cache_assign` does what
 * `DenseSlots.assign` does in NumPy (the same slots, victims and counters,
 * to the element); `ks_cache_move_rows` writes the victims' rows down to
 * the store and fills the new ids' rows from it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Errors of ks_cache_assign (nothing changed when returned). */
#define KS_CACHE_OUT_OF_RANGE (-1)
#define KS_CACHE_NO_ROOM (-2)
#define KS_CACHE_NO_MEMORY (-3)

/* Moves ahead whose rows are prefetched. */
#define KS_CACHE_AHEAD 16

/* Entries of the state array of ks_cache_assign. */
enum { KS_HAND, KS_CALLS, KS_HITS, KS_MISSES, KS_EVICTIONS, KS_INFO, KS_INFO2 };

static inline int64_t ks_id(const void *ids, int32_t id_bytes, int64_t p) {
  return id_bytes == 4 ? (int64_t)((const int32_t *)ids)[p]
                       : ((const int64_t *)ids)[p];
}

/* Maps a training batch: every used position of `ids` (`use` NULL: all)
 * gets a cache row. Returns the number m of ids given a row now (>= 0),
 * with `slots` [n] (-1 where unused), `fill` [n] (1 at the first position
 * of each such id), and per fill k in order of first position: `fill_pos`,
 * `fill_ids`, `victims` (the row) and `evicted` (its former id, -1 if
 * empty). CLOCK picks the victims, never a row the batch uses: a hand
 * sweeps the rows, taking the first whose reference bit is clear and that
 * the batch does not use, clearing the bit of each row it passes.
 *
 * `slot_of_id` is the one large array (an int32 per id of the table), read
 * at random: it is read once per position, a few positions ahead of its
 * use, and `slots` keeps what was read (a row, or -2 - k for the k-th
 * missing id) for the later passes.
 *
 * Errors, before anything changes: KS_CACHE_OUT_OF_RANGE (state[KS_INFO]:
 * the first bad id, state[KS_INFO2]: how many are bad), KS_CACHE_NO_ROOM
 * (state[KS_INFO]: the ids left without a row). */
int64_t ks_cache_assign(const void *ids, int32_t id_bytes, const uint8_t *use,
                        int64_t n, int64_t input_dim, int64_t capacity,
                        int32_t *slot_of_id, int64_t *id_of_slot,
                        uint8_t *referenced, int64_t *used_in, int64_t *state,
                        int32_t *slots, uint8_t *fill, int64_t *fill_pos,
                        int64_t *fill_ids, int64_t *victims, int64_t *evicted) {
  int64_t bad = 0, first_bad = 0, positions = 0;
  for (int64_t p = 0; p < n; ++p) {
    if (use && !use[p]) continue;
    int64_t id = ks_id(ids, id_bytes, p);
    ++positions;
    if (id < 0 || id >= input_dim) {
      if (!bad) first_bad = id;
      ++bad;
    }
  }
  if (bad) {
    state[KS_INFO] = first_bad;
    state[KS_INFO2] = bad;
    return KS_CACHE_OUT_OF_RANGE;
  }
  if (fill) memset(fill, 0, (size_t)n);
  if (!positions) {
    for (int64_t p = 0; p < n; ++p) slots[p] = -1;
    return 0;
  }
  /* Distinct missing ids by first position: each marked -2 - k in the map
   * until it gets its row (undone if the batch does not fit). */
  int64_t m = 0, hit_positions = 0;
  for (int64_t p = 0; p < n; ++p) {
    if (p + KS_CACHE_AHEAD < n) {
      int64_t next = ks_id(ids, id_bytes, p + KS_CACHE_AHEAD);
      if (next >= 0 && next < input_dim) __builtin_prefetch(slot_of_id + next);
    }
    if (use && !use[p]) {
      slots[p] = -1;
      continue;
    }
    int64_t id = ks_id(ids, id_bytes, p);
    int32_t s = slot_of_id[id];
    if (s >= 0) {
      ++hit_positions;
    } else if (s == -1) {
      s = (int32_t)(-2 - m);
      slot_of_id[id] = s;
      fill_pos[m] = p;
      fill_ids[m] = id;
      ++m;
    }
    slots[p] = s;
  }
  if (m > capacity - hit_positions) {
    /* Rows the batch's hits use, counted once each. */
    uint8_t *seen = calloc((size_t)capacity, 1);
    int64_t distinct = 0;
    if (seen) {
      for (int64_t p = 0; p < n; ++p) {
        int32_t s = slots[p];
        if (s >= 0 && !seen[s]) {
          seen[s] = 1;
          ++distinct;
        }
      }
      free(seen);
    }
    if (!seen || m > capacity - distinct) {
      for (int64_t k = 0; k < m; ++k) slot_of_id[fill_ids[k]] = -1;
      for (int64_t p = 0; p < n; ++p) slots[p] = -1;
      if (!seen) return KS_CACHE_NO_MEMORY;
      state[KS_INFO] = m - (capacity - distinct);
      return KS_CACHE_NO_ROOM;
    }
  }
  int64_t calls = ++state[KS_CALLS];
  for (int64_t p = 0; p < n; ++p) {
    int32_t s = slots[p];
    if (s >= 0) {
      referenced[s] = 1;
      used_in[s] = calls;
    }
  }
  state[KS_HITS] += positions - m;
  state[KS_MISSES] += m;
  /* CLOCK: terminates within two laps (the room was checked). */
  int64_t hand = state[KS_HAND];
  for (int64_t k = 0; k < m;) {
    int64_t s = hand;
    hand = hand + 1 == capacity ? 0 : hand + 1;
    if (!referenced[s] && used_in[s] != calls) {
      used_in[s] = calls;
      victims[k++] = s;
    } else {
      referenced[s] = 0;
    }
  }
  state[KS_HAND] = hand;
  int64_t evictions = 0;
  for (int64_t k = 0; k < m; ++k) {
    if (k + KS_CACHE_AHEAD < m) {
      int64_t old = id_of_slot[victims[k + KS_CACHE_AHEAD]];
      if (old >= 0) __builtin_prefetch(slot_of_id + old, 1);
    }
    int64_t v = victims[k];
    int64_t old = id_of_slot[v];
    evicted[k] = old;
    if (old >= 0) {
      slot_of_id[old] = -1;
      ++evictions;
    }
    id_of_slot[v] = fill_ids[k];
    slot_of_id[fill_ids[k]] = (int32_t)v;
    referenced[v] = 0;
    if (fill) fill[fill_pos[k]] = 1;
  }
  state[KS_EVICTIONS] += evictions;
  /* Hits keep their rows (victims are never a row of the batch); missing
   * ids take their victims. */
  for (int64_t p = 0; p < n; ++p) {
    int32_t s = slots[p];
    if (s <= -2) slots[p] = (int32_t)victims[-2 - (int64_t)s];
  }
  return m;
}

/* Asks for a row's first and last cache lines: rows are not aligned to
 * lines (a 64-byte row usually spans two), and rows of up to two lines are
 * the common case. */
static inline void ks_prefetch_row(const char *row, size_t width, int write) {
  if (write) {
    __builtin_prefetch(row, 1);
    __builtin_prefetch(row + width - 1, 1);
  } else {
    __builtin_prefetch(row, 0);
    __builtin_prefetch(row + width - 1, 0);
  }
}

/* Carries out m moves on `fields` row arrays: for each k, the row
 * `victims[k]` of every cache array is written to the store at id
 * `evicted[k]` (skipped where -1), then the store's row of `fill_ids[k]`
 * is copied into it. An evicted id is never one filled in the same call,
 * so the moves are independent. */
void ks_cache_move_rows(int64_t m, const int64_t *victims,
                        const int64_t *evicted, const int64_t *fill_ids,
                        int64_t fields, char *const *cache,
                        char *const *store, const int64_t *row_bytes) {
  for (int64_t f = 0; f < fields; ++f) {
    size_t width = (size_t)row_bytes[f];
    char *rows = cache[f], *stored = store[f];
    for (int64_t k = 0; k < m; ++k) {
      if (k + KS_CACHE_AHEAD < m) { /* random rows: ask for them early */
        int64_t next = k + KS_CACHE_AHEAD;
        ks_prefetch_row(stored + fill_ids[next] * width, width, 0);
        ks_prefetch_row(rows + victims[next] * width, width, 1);
        if (evicted[next] >= 0)
          ks_prefetch_row(stored + evicted[next] * width, width, 1);
      }
      char *row = rows + victims[k] * width;
      if (evicted[k] >= 0) memcpy(stored + evicted[k] * width, row, width);
      memcpy(row, stored + fill_ids[k] * width, width);
    }
  }
}
