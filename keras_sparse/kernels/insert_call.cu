// One lookup_or_insert per block of one launch: probe, dedup of the
// absent keys, admission (count-min sketch), placement and eviction rounds,
// touch, counters.  A launch runs one table's call, or the calls of several
// tables (a training step's hash fields), one block each (ks_insert_calls).
// Nothing is read back by the host in between; the host reads one small
// summary afterwards (status and output sizes).
//
// The result is bit-identical to ArrayTable._insert_call (the CPU twin) for
// the same call sequence, because every order the twin relies on is rebuilt
// here from stable, data-determined operations (block prefix sums, a stable
// radix sort, atomicMin bids): the unique absent keys in order of first
// occurrence, placement ranks by pending order within a bucket, the earliest
// bidder winning an evicted slot, and the pending order of the next round
// (claim losers, then eviction losers).  A concurrent CAS insert would pick
// slots in a nondeterministic order, so it is deliberately not used.
//
// Counters, the size change and a failure are added to acct[] on the device
// (KS_A_*), so calls can follow each other with no host read at all; the
// host reads acct[] when it needs a count (stats, size, a raised error).  A
// failed call (full table with eviction=None) commits nothing and leaves a
// status that makes later calls do nothing until the host has read it.
//
// One block serves batches of up to ~64K keys (embedding batches), where
// launches and host syncs, not bandwidth, set the time.  Larger batches run
// the same phases on several blocks of one cooperative launch
// (ks_insert_grid, barriers and prefix sums across blocks: KsGrid), so their
// result is the same and they need no host sync either; a step's large
// calls run side by side on teams of blocks.  A batch of more keys than the
// table has rows also counts its distinct keys (status 3 when they
// outnumber the rows), so it runs on the grid too.

#include "ks_groups.cuh"

#define KS_MAX 0x7FFFFFFFFFFFFFFFLL

// KS_PROFILE builds (benchmarks/gpu_call_phases.py) record, at each
// KS_MARK, the phase id, the team's first block and the time, as thread 0
// of each team passes it (after the barrier that ends the phase before).
#ifdef KS_PROFILE
__device__ unsigned long long ks_prof[3 * 65536];
__device__ unsigned int ks_prof_n;
template <class G>
__device__ void ks_mark(const G& g, int id) {
  if (g.t != 0) return;
  const unsigned int k = atomicAdd(&ks_prof_n, 1u);
  if (k >= 65536) return;
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  ks_prof[3 * k] = id;
  ks_prof[3 * k + 1] = blockIdx.x;
  ks_prof[3 * k + 2] = now;
}
#define KS_MARK(g, id) ks_mark(g, id)
#else
#define KS_MARK(g, id)
#endif


// acct[] words (ACCOUNT in keras_sparse/table/insert_call.py).  Sums over
// the calls since the host last read them, except KS_A_PLACED/EVICTED (the
// last call's output lengths).
#define KS_A_HITS 0
#define KS_A_MISSES 1
#define KS_A_INSERTS 2
#define KS_A_EVICTIONS 3
#define KS_A_REJECTED 4
#define KS_A_OVERFLOWS 5
#define KS_A_SIZE 6      // change of the table size
#define KS_A_STATUS 7    // 0 ok; 1 table full before placing; 2 both buckets full;
                         // 3 more distinct keys than rows
#define KS_A_NEW 8       // the failed call's admitted absent keys (its message)
#define KS_A_PLACED 9    // rows given to keys in the last call (new_rows' length)
#define KS_A_EVICTED 10  // evicted keys of the last call (evicted_keys' length)

__device__ __forceinline__ int ks_bits(i64 x) {  // bit length of x >= 0
  int b = 0;
  while (x > 0) {
    ++b;
    x >>= 1;
  }
  return b;
}

// Table and call state shared by the phases (all device pointers).
struct KsTable {
  i64* keys;
  unsigned char* dig;
  i64* score;
  i64* load;
  bool* holey;
  const i64* sentinel;
  unsigned int* stamp;  // protection marks: stamp[s] == call_stamp
  i64* bids;            // per bucket, KS_MAX between calls
  int S;
  i64 step;
  int prot_is_step;  // LRU: protected == score is this step
  int use_stamp;     // otherwise protected == stamped in this call
  unsigned int call_stamp;
};

__device__ __forceinline__ bool ks_protected(const KsTable& T, i64 s) {
  return T.prot_is_step ? T.score[s] == T.step : T.stamp[s] == T.call_stamp;
}

__device__ __forceinline__ void ks_write(const KsTable& T, i64 s, i64 key,
                                         unsigned char d, i64 sc) {
  T.keys[s] = key;
  T.dig[s] = d;
  T.score[s] = sc;
  if (T.use_stamp) T.stamp[s] = T.call_stamp;
}

// One eviction round of the keys L[0..ml) (indices of the admitted keys):
// each takes the first lowest-score unprotected slot of its two buckets (a
// key whose buckets hold only protected slots overflows), the earliest
// bidder of a slot wins it, and the others go to out[out_base..) in order.
// Evicted (key, row) pairs are appended at *nev.  Returns the losers' count.
template <class G>
__device__ i64 ks_evict_round(G& g, const KsTable& T, const i64* L, i64 ml, i64* out,
                              i64 out_base, i64* victim, const i64* pk,
                              const i64* pb1, const i64* pb2, const i64* pd,
                              const i64* pscore, i64* res, i64* ev_keys,
                              i64* ev_rows, i64* nev, i64* s_over) {
  const int S = T.S;
  for (i64 i = g.t; i < ml; i += g.nt) {
    const i64 a = L[i];
    i64 best = KS_MAX, slot = -1;
    for (int c = 0; c < 2; ++c) {
      const i64 base = (c == 0 ? pb1[a] : pb2[a]) * (i64)S;
      for (int j = 0; j < S; ++j) {
        const i64 sc = ks_protected(T, base + j) ? KS_MAX : T.score[base + j];
        if (slot < 0 || sc < best) {
          best = sc;
          slot = base + j;
        }
      }
    }
    if (ks_protected(T, slot)) {  // both buckets hold only this call's keys
      victim[i] = -1;
      atomicAdd((u64*)s_over, 1ULL);
    } else {
      victim[i] = slot;
      atomicMin(&T.bids[slot / S], i);
    }
  }
  g.sync();
  const i64 won = ks_compact(
      g, ml, *nev,
      [&](i64 i) { return victim[i] >= 0 && T.bids[victim[i] / S] == i; },
      [&](i64 i, i64 o) {
        const i64 s = victim[i], a = L[i];
        ev_keys[o] = T.keys[s];
        ev_rows[o] = s;
        ks_write(T, s, pk[a], (unsigned char)pd[a], pscore[a]);
        res[a] = s;
      });
  *nev += won;
  const i64 lost = ks_compact(
      g, ml, out_base,
      [&](i64 i) { return victim[i] >= 0 && T.bids[victim[i] / S] != i; },
      [&](i64 i, i64 o) { out[o] = L[i]; });
  for (i64 i = g.t; i < ml; i += g.nt)
    if (victim[i] >= 0) T.bids[victim[i] / S] = KS_MAX;
  g.sync();
  return lost;
}

// One call (one table, one batch) run by the threads of g.
template <class G>
__device__ void ks_insert_body(
    G& g,    const i64* __restrict__ k, const bool* use, int has_use,
    int first_only, i64 n, u64 salt, u64 nb, int S, i64 capacity, i64 size,
    int eviction, i64 step, int score_prot, i64 admit_after, i64* tkeys,
    unsigned char* tdig, i64* tscore, i64* load, bool* holey,
    const i64* __restrict__ sentinel, unsigned int* stamp, unsigned int call_stamp,
    i64* bids, int use_sketch, unsigned int* sketch, int depth, i64 width, int shift,
    const u64* __restrict__ sketch_salts, i64* ws, i64 H, i64* rows, int* rows32,
    int write32,
    bool* fresh, i64* new_rows, i64* ev_keys, i64* ev_rows, i64* acct) {
  const i64 t = g.t;
  const bool lfu = eviction == 2;
  // Workspace (int64 words): 20 arrays of n, then the dedup set of H.
  i64* MP = ws;           // positions of absent keys, ascending
  i64* setslot = MP + n;  // dedup-set slot of each absent key
  i64* inv = setslot + n;   // unique index of each absent key
  i64* U = inv + n;         // unique -> index into MP of its first occurrence
  i64* ucnt = U + n;        // sightings per unique key
  i64* est = ucnt + n;      // sketch estimate per unique key
  i64* adm = est + n;       // unique -> admitted index, or -1
  i64* pk = adm + n;        // admitted: key, buckets, digest, new score, row
  i64* pb1 = pk + n;
  i64* pb2 = pb1 + n;
  i64* pd = pb2 + n;
  i64* pscore = pd + n;
  i64* res = pscore + n;
  i64* P = res + n;         // pending (ping-pong with Q)
  i64* Q = P + n;
  i64* ch = Q + n;          // chosen bucket / roomy flag per pending key
  i64* F = ch + n;          // pending indices of keys without room
  i64* comp = F + n;        // sort words (ping-pong with comp2)
  i64* comp2 = comp + n;
  i64* cslot = comp2 + n;   // claim result per roomy key / victim per key
  i64* hs_state = cslot + n;
  i64* hs_key = hs_state + H;
  i64* hs_first = hs_key + H;
  i64* hs_cnt = hs_first + H;
  i64* hs_uid = hs_cnt + H;

  i64& s_over = g.c[KS_C_OVER];
  i64& s_miss = g.c[KS_C_MISS];
  i64& s_rej = g.c[KS_C_REJ];
  i64& s_unused = g.c[KS_C_UNUSED];
  // Clean outputs of a call that does nothing (an earlier or this call failed).
  auto refuse = [&]() {
    for (i64 i = t; i < n; i += g.nt) {
      rows[i] = -1;
      fresh[i] = false;
      if (write32) rows32[i] = -1;
    }
    if (t == 0) {
      acct[KS_A_PLACED] = 0;
      acct[KS_A_EVICTED] = 0;
    }
  };
  if (acct[KS_A_STATUS] != 0) {
    refuse();
    return;
  }
  size += acct[KS_A_SIZE];
  if (t == 0) {
    s_unused = 0;
    s_over = 0;
    s_miss = 0;
    s_rej = 0;
  }
  g.sync();  // before any thread counts into them
  KS_MARK(g, 1);  // start
  KsTable T;
  T.keys = tkeys;
  T.dig = tdig;
  T.score = tscore;
  T.load = load;
  T.holey = holey;
  T.sentinel = sentinel;
  T.stamp = stamp;
  T.bids = bids;
  T.S = S;
  T.step = step;
  T.prot_is_step = score_prot;
  T.use_stamp = !score_prot && eviction != 0;
  T.call_stamp = call_stamp;

  // Probe (one thread per key; a key lives in at most one slot).
  for (i64 i = t; i < n; i += g.nt) {
    if (has_use && !use[i]) {  // padding: no row, not counted
      rows[i] = -1;
      fresh[i] = false;
      atomicAdd((u64*)&s_unused, 1ULL);
      continue;
    }
    const i64 key = k[i];
    const u64 h = ks_mix64((u64)key, salt);
    i64 b[2];
    ks_buckets(h, nb, &b[0], &b[1]);
    const unsigned char d = (unsigned char)(h & 0xFF);
    i64 found = -1;
    for (int c = 0; c < 2 && found < 0; ++c) {
      const i64 base = b[c] * (i64)S;
      for (int j = 0; j < S; ++j) {
        if (tdig[base + j] == d && tkeys[base + j] == key) {
          found = base + j;
          break;
        }
      }
    }
    rows[i] = found;
    fresh[i] = found < 0;  // "absent" until the end of the call
  }
  g.sync();
  KS_MARK(g, 2);  // probed
  const i64 nm = ks_compact(
      g, n, 0, [&](i64 i) { return fresh[i]; }, [&](i64 i, i64 o) { MP[o] = i; });
  KS_MARK(g, 3);  // absent keys listed

  i64 nu = 0, na = 0;
  // Count-min cell of unique key u in sketch row r (CountMinSketch._cells).
  auto cell = [&](i64 u, int r) {
    return (i64)(ks_mix64((u64)k[MP[U[u]]], sketch_salts[r]) >> shift) + r * width;
  };
  if (nm > 0) {
    // Dedup: a set keyed by the key; the first occurrence is the least index.
    // Sized by the absent keys (at most half full), not the batch: a call of
    // mostly hits clears little of it.
    i64 hm = 2;
    while (hm < 2 * nm && hm < H) hm <<= 1;
    for (i64 h = t; h < hm; h += g.nt) {
      hs_state[h] = 0;
      hs_first[h] = KS_MAX;
      hs_cnt[h] = 0;
    }
    g.sync();
    for (i64 j = t; j < nm; j += g.nt) {
      const i64 key = k[MP[j]];
      i64 h = (i64)(ks_mix64((u64)key, 0x2545F4914F6CDD1DULL) & (u64)(hm - 1));
      for (;;) {
        const u64 st = atomicCAS((u64*)&hs_state[h], 0ULL, 1ULL);
        if (st == 0ULL) {
          hs_key[h] = key;
          __threadfence();
          atomicExch((u64*)&hs_state[h], 2ULL);
          break;
        }
        while (*(volatile i64*)&hs_state[h] == 1) {
        }
        __threadfence();  // the key its writer fenced before publishing it
        if (*(volatile i64*)&hs_key[h] == key) break;
        h = (h + 1) & (hm - 1);
      }
      setslot[j] = h;
      atomicMin(&hs_first[h], j);
      atomicAdd((u64*)&hs_cnt[h], 1ULL);
    }
    g.sync();
    KS_MARK(g, 4);  // dedup set filled
    nu = ks_compact(
        g, nm, 0, [&](i64 j) { return hs_first[setslot[j]] == j; },
        [&](i64 j, i64 o) {
          U[o] = j;
          ucnt[o] = hs_cnt[setslot[j]];
          hs_uid[setslot[j]] = o;
        });
    for (i64 j = t; j < nm; j += g.nt) inv[j] = hs_uid[setslot[j]];
    // Admission: add this call's sightings, then read the estimates.
    if (use_sketch) {
      for (i64 u = t; u < nu; u += g.nt)
        for (int r = 0; r < depth; ++r)
          atomicAdd(&sketch[cell(u, r)], (unsigned int)ucnt[u]);
      g.sync();
      for (i64 u = t; u < nu; u += g.nt) {
        i64 e = KS_MAX;
        for (int r = 0; r < depth; ++r) e = ks_imin(e, (i64)sketch[cell(u, r)]);
        est[u] = e;
      }
    }
    g.sync();
    for (i64 u = t; u < nu; u += g.nt) adm[u] = -1;
    g.sync();
    na = ks_compact(
        g, nu, 0, [&](i64 u) { return !use_sketch || est[u] >= admit_after; },
        [&](i64 u, i64 a) {
          adm[u] = a;
          const i64 key = k[MP[U[u]]];
          const u64 h = ks_mix64((u64)key, salt);
          pk[a] = key;
          ks_buckets(h, nb, &pb1[a], &pb2[a]);
          pd[a] = (i64)(h & 0xFF);
          pscore[a] = lfu ? ucnt[u] : step;
          res[a] = -1;
          P[a] = a;
        });
  }
  KS_MARK(g, 5);  // unique and admitted keys listed

  // Undoes this call's sketch additions (a failed call leaves no trace there).
  auto unsketch = [&]() {
    if (!use_sketch) return;
    for (i64 u = t; u < nu; u += g.nt)
      for (int r = 0; r < depth; ++r)
        atomicAdd(&sketch[cell(u, r)], (unsigned int)(-ucnt[u]));
  };
  // Fails the call before it changed anything (the status stops later calls
  // until the host reads it).
  auto fail = [&](int status, i64 keys) {
    unsketch();
    refuse();
    if (t == 0) {
      acct[KS_A_STATUS] = status;
      acct[KS_A_NEW] = keys;
    }
  };
  // A batch of more keys than the table has rows may hold more distinct
  // admitted keys than rows (ArrayTable._check_batch_fits): count the
  // distinct hit rows by marking each with this call's stamp (hits are
  // stamped below anyway, when stamps protect them).  A call of hits only
  // fits: its keys hold rows already.
  if (na > 0 && n > capacity) {
    i64& hit_rows = g.c[KS_C_HIT_ROWS];
    if (t == 0) hit_rows = 0;
    g.sync();
    for (i64 i = t; i < n; i += g.nt) {
      const i64 r = rows[i];
      // A plain read first: most repeats of a row then skip the atomic.
      if (r >= 0 && *(volatile unsigned int*)&stamp[r] != call_stamp &&
          atomicExch(&stamp[r], call_stamp) != call_stamp)
        atomicAdd((u64*)&hit_rows, 1ULL);
    }
    g.sync();
    if (na + hit_rows > capacity) {
      fail(3, na + hit_rows);
      return;
    }
  }
  if (na > 0 && eviction == 0 && na > capacity - size) {
    fail(1, na);
    return;
  }
  if (nm > 0 && score_prot) {  // hits first: they are protected by score
    for (i64 i = t; i < n; i += g.nt)
      if (rows[i] >= 0) tscore[rows[i]] = step;
  }
  if (na > 0 && T.use_stamp) {  // hits are protected from the evictions
    for (i64 i = t; i < n; i += g.nt)
      if (rows[i] >= 0) stamp[rows[i]] = call_stamp;
  }
  // Before placement reads the marks (with nothing to place, the barrier
  // after the rounds serves).
  if (na > 0) g.sync();
  KS_MARK(g, 6);  // checked, hits marked

  // Placement rounds (ArrayTable._place).
  i64 mp = na, nev = 0, n_filled = 0;
  const int max_rounds = 4 * S + 8;
  const int bucket_bits = ks_bits((i64)nb - 1);
  for (int round = 0; round < max_rounds && mp > 0; ++round) {
    KS_MARK(g, 7);  // a placement round
    for (i64 i = t; i < mp; i += g.nt) {
      const i64 a = P[i];
      const i64 l1 = load[pb1[a]], l2 = load[pb2[a]];
      const i64 c = l1 <= l2 ? pb1[a] : pb2[a];
      ch[i] = (ks_imin(l1, l2) < S) ? c : -1 - c;  // negative: no room
    }
    g.sync();
    // Roomy keys as sort words (bucket, rank among the roomy keys).
    const i64 nr = ks_compact(
        g, mp, 0, [&](i64 i) { return ch[i] >= 0; }, [&](i64 i, i64 o) { F[o] = i; });
    const int sh = ks_bits(nr > 1 ? nr - 1 : 1);
    for (i64 j = t; j < nr; j += g.nt) comp[j] = (ch[F[j]] << sh) | j;
    g.sync();
    KS_MARK(g, 8);  // roomy keys listed
    i64 nq = 0;
    if (nr > 0) {
      // comp is in order of j (its low sh bits): sort by the bucket bits only.
      i64* sorted = ks_sort(g, comp, comp2, nr, sh, bucket_bits + sh);
      KS_MARK(g, 9);  // sorted by bucket
      const i64 mask = (1LL << sh) - 1;
      for (i64 x = t; x < nr; x += g.nt) {
        const i64 c = sorted[x] >> sh, j = sorted[x] & mask;
        const i64 free_slots = (i64)S - load[c];
        i64 rank = 0;
        while (rank < free_slots && x - rank - 1 >= 0 && (sorted[x - rank - 1] >> sh) == c)
          ++rank;
        i64 slot = -1;
        if (rank < free_slots) {
          i64 pos = load[c] + rank;
          if (holey[c]) {  // the rank-th free position, reading the keys
            i64 r = rank;
            for (int p = 0; p < S; ++p) {
              if (tkeys[c * S + p] == sentinel[c]) {
                if (r == 0) {
                  pos = p;
                  break;
                }
                --r;
              }
            }
          }
          slot = c * S + pos;
        }
        cslot[j] = slot;
      }
      g.sync();  // every load and key read before the writes
      for (i64 j = t; j < nr; j += g.nt) {
        const i64 s = cslot[j];
        if (s < 0) continue;
        const i64 a = P[F[j]];
        ks_write(T, s, pk[a], (unsigned char)pd[a], pscore[a]);
        res[a] = s;
        atomicAdd((u64*)&load[s / S], 1ULL);
      }
      g.sync();
      KS_MARK(g, 10);  // claims written
      // Claim losers retry first, in pending order.
      nq = ks_compact(
          g, nr, 0, [&](i64 j) { return cslot[j] < 0; },
          [&](i64 j, i64 o) { Q[o] = P[F[j]]; });
      n_filled += nr - nq;
    }
    const i64 nf = ks_compact(
        g, mp, 0, [&](i64 i) { return ch[i] < 0; }, [&](i64 i, i64 o) { F[o] = P[i]; });
    if (nf > 0) {
      if (eviction == 0) {  // both buckets full: undo this call's fills
        for (i64 a = t; a < na; a += g.nt) {
          const i64 s = res[a];
          if (s < 0) continue;
          const i64 b = s / S;
          tkeys[s] = sentinel[b];
          tdig[s] = 0;
          tscore[s] = 0;
          atomicAdd((u64*)&load[b], (u64)(-1LL));
          holey[b] = true;
        }
        g.sync();  // every undo before the outputs are cleared
        fail(2, na);
        return;
      }
      if (nr == 0) {
        // No key has room: eviction frees no slot, so every later round
        // evicts too; run them all here.
        i64* L = F;
        i64* out = comp;
        i64 ml = nf;
        for (int r = round; r < max_rounds && ml > 0; ++r) {
          ml = ks_evict_round(g, T, L, ml, out, 0, cslot, pk, pb1, pb2, pd, pscore, res,
                              ev_keys, ev_rows, &nev, &s_over);
          i64* x = L;
          L = out;
          out = x;
        }
        mp = ml;
        break;
      }
      nq += ks_evict_round(g, T, F, nf, Q, nq, comp, pk, pb1, pb2, pd, pscore, res,
                           ev_keys, ev_rows, &nev, &s_over);
    }
    i64* x = P;
    P = Q;
    Q = x;
    mp = nq;
  }
  // Keys still pending after the last round overflow (no row).  With
  // nothing placed no thread wrote what another reads next.
  if (na > 0) {
    if (t == 0) s_over += mp;
    g.sync();
  }
  KS_MARK(g, 11);  // placed

  // Hits' scores (unless touched before placement).
  if (!(nm > 0 && score_prot) && eviction != 0) {
    for (i64 i = t; i < n; i += g.nt) {
      if (rows[i] < 0) continue;
      if (lfu)
        atomicAdd((u64*)&tscore[rows[i]], 1ULL);
      else
        tscore[rows[i]] = step;
    }
  }
  // Before the absent keys' rows land where this pass reads (none: no wait).
  if (nm > 0) g.sync();
  KS_MARK(g, 12);  // hits touched
  // Rows of the absent keys, and the counts of ArrayTable._miss_counts.
  for (i64 j = t; j < nm; j += g.nt) {
    const i64 a = adm[inv[j]];
    const i64 r = a >= 0 ? res[a] : -1;
    rows[MP[j]] = r;
    // first_only: only where the new row first appears, so a step draws one
    // initial vector per new row.
    fresh[MP[j]] = r >= 0 && (!first_only || U[inv[j]] == j);
  }
  if (write32) {  // a training step's int32 rows, written in its own buffer
    if (nm > 0) g.sync();  // the absent keys' rows are written just above
    for (i64 i = t; i < n; i += g.nt) rows32[i] = (int)rows[i];
  }
  for (i64 u = t; u < nu; u += g.nt) {
    const i64 c = ucnt[u];
    const i64 upto = !use_sketch ? 1
                                 : ks_imin(c, admit_after - (est[u] - c) > 1
                                                  ? admit_after - (est[u] - c)
                                                  : 1);
    const bool placed = adm[u] >= 0 && res[adm[u]] >= 0;
    atomicAdd((u64*)&s_miss, (u64)(placed ? upto : c));
    atomicAdd((u64*)&s_rej, (u64)(upto - (adm[u] >= 0 ? 1 : 0)));
  }
  i64 placed = 0;
  if (na > 0) {
    placed = ks_compact(
        g, na, 0, [&](i64 a) { return res[a] >= 0; },
        [&](i64 a, i64 o) { new_rows[o] = res[a]; });
  } else if (nu > 0) {
    g.sync();  // the counts above reach thread 0 (no compact to wait at)
  }
  KS_MARK(g, 13);  // outputs written
  if (t == 0) {
    acct[KS_A_HITS] += n - s_unused - s_miss;
    acct[KS_A_MISSES] += s_miss;
    acct[KS_A_INSERTS] += placed;
    acct[KS_A_EVICTIONS] += nev;
    acct[KS_A_REJECTED] += s_rej;
    acct[KS_A_OVERFLOWS] += s_over;
    acct[KS_A_SIZE] += n_filled;
    acct[KS_A_PLACED] = placed;
    acct[KS_A_EVICTED] = nev;
  }
}

// Words of one call's record in ks_insert_calls' descriptor (DESC_WORDS in
// keras_sparse/table/insert_call.py, which writes them in this order).
#define KS_DESC_WORDS 40

// The call of one record (KS_DESC_WORDS words) run by the threads of g.
template <class G>
__device__ void ks_insert_record(G& g, const i64* d) {
  ks_insert_body(
      g, (const i64*)d[0], (const bool*)d[1], (int)d[2], (int)d[3], d[4], (u64)d[5],
      (u64)d[6], (int)d[7], d[8], d[9], (int)d[10], d[11], (int)d[12], d[13],
      (i64*)d[14], (unsigned char*)d[15], (i64*)d[16], (i64*)d[17], (bool*)d[18],
      (const i64*)d[19], (unsigned int*)d[20], (unsigned int)d[21], (i64*)d[22],
      (int)d[23], (unsigned int*)d[24], (int)d[25], d[26], (int)d[27],
      (const u64*)d[28], (i64*)d[29], d[30], (i64*)d[31], (int*)d[32], (int)d[33],
      (bool*)d[34], (i64*)d[35], (i64*)d[36], (i64*)d[37], (i64*)d[38]);
}

// Block b runs the call of record b: one launch serves one table call, or
// the calls of several tables (a step's hash fields) side by side.  Each
// record names its own table, keys, outputs, workspace and account, so the
// blocks share nothing and their results equal separate calls.
extern "C" __global__ void ks_insert_calls(const i64* __restrict__ desc) {
  __shared__ int s_cnt[16 * KS_FT];
  __shared__ i64 s_c[5];
  KsBlock g{(i64)threadIdx.x, (i64)KS_FT, s_cnt, s_c};
  ks_insert_record(g, desc + (i64)blockIdx.x * KS_DESC_WORDS);
}

// The calls of `records` records by `teams` teams of blocks (KsGrid), one
// cooperative launch, no host sync, whatever the batch size (calls of more
// than ~64K keys).  Team j runs records j, j + teams, ... one after another,
// each on all its blocks; records run by different teams must name
// different tables and workspaces.  gws: [0, teams) a flag per team, set
// when one of its calls failed or met an unread failure; then, from word
// ks_team_base(teams), one scratch region of ks_team_words(blocks per team)
// per team (KsGrid), zeroed before the first launch of this layout.
__host__ __device__ inline i64 ks_team_base(int teams) { return (teams + 7) & ~7; }
__host__ __device__ inline i64 ks_team_words(int blocks) {
  return KS_G_TOTALS + 2 * (i64)blocks + 8 * (i64)blocks * KS_FT;
}

extern "C" __global__ void __launch_bounds__(KS_FT, 1)
    ks_insert_grid(const i64* __restrict__ desc, int records, i64* gws, int teams) {
  const int tb = gridDim.x / teams, team = blockIdx.x / tb;
  KsGrid g(gws + ks_team_base(teams) + team * ks_team_words(tb), tb);
  if (g.t == 0) gws[team] = 0;  // only this team writes its flag
  for (int r = team; r < records; r += teams) {
    const i64* d = desc + (i64)r * KS_DESC_WORDS;
    ks_insert_record(g, d);
    g.sync();  // the record's counters are read before the next zeroes them
    if (g.t == 0 && ((i64*)d[38])[KS_A_STATUS] != 0) gws[team] = 1;
  }
}
