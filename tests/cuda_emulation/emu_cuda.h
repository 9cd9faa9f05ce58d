// Runs keras_sparse/kernels/*.cu on the host, for tests on machines without a GPU.
//
// Included ahead of the unchanged CUDA source (g++ -include).  Every thread of
// a block is a fiber (ucontext) on one OS thread; fibers run until they exit
// or reach a collective (__ballot_sync, __syncthreads), where the scheduler
// resolves the collective once every live thread of the warp (block) has
// arrived.  A warp whose lanes disagree (some exited, some at a ballot, or at
// different collectives) is reported as divergence, which is undefined on a
// GPU.  Between collectives the threads of a block run one after another in
// a shuffled order (fixed per block), as a GPU promises no order either, so a
// kernel whose result depends on thread order shows it.  Fibers interleave
// only at collectives, so data races within a phase are not exercised: this
// checks a kernel's logic, indexing and warp-level protocol, not its memory
// ordering.
//
// A cooperative launch (cupy's enable_cooperative_groups=True, which a GPU
// runs with every block resident) runs each block on its own OS thread, so
// a grid-wide barrier built from atomics and spinning (as a GPU kernel
// writes it) completes; atomics are then real atomics, and __nanosleep
// yields the OS thread, so spinning blocks let the others run.
#pragma once

#include <sched.h>
#include <ucontext.h>

#include <atomic>
#include <thread>

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// One block runs at a time on an OS thread: its fibers share these.
#define __shared__ static thread_local

namespace ks_emu {

enum State { kRunnable, kAtBallot, kAtSync, kDone, kAborted };

struct Lane {
  ucontext_t context;
  dim3 tid;
  State state = kRunnable;
  unsigned int mask = 0;
  bool predicate = false;
  unsigned int result = 0;
};

constexpr size_t kStackBytes = 64 * 1024;

struct Launch {
  dim3 grid, block, bid;
  std::vector<Lane> lanes;
  std::vector<std::vector<char>>* stacks;
  std::function<void()> body;
  ucontext_t scheduler;
  int current = 0;
  // Cooperative launches: set when a block failed, so that blocks spinning
  // at a grid barrier it will never reach stop instead of hanging.
  std::atomic<bool>* failed = nullptr;
};

// One launch at a time per OS thread; several Python threads may launch.
inline thread_local Launch* active = nullptr;

inline Lane& lane() { return active->lanes[active->current]; }

inline void yield_to_scheduler() {
  swapcontext(&lane().context, &active->scheduler);
}

inline void lane_entry() {
  active->body();
  lane().state = kDone;  // uc_link returns to the scheduler
}

// Resolves the collectives of one block whose live lanes all wait.
// Returns false with `error` set when they cannot all proceed.
inline bool resolve(Launch& L, std::string& error) {
  const int n = static_cast<int>(L.lanes.size());
  bool any_sync = false, all_sync = true;
  for (const Lane& x : L.lanes) {
    if (x.state == kAtSync) any_sync = true;
    if (x.state == kAtBallot) all_sync = false;
  }
  if (any_sync) {
    if (!all_sync) {
      error = "lanes of one block wait at different collectives "
              "(__syncthreads vs __ballot_sync)";
      return false;
    }
    for (Lane& x : L.lanes)
      if (x.state == kAtSync) x.state = kRunnable;
    return true;
  }
  for (int w = 0; w < n; w += 32) {
    const int end = w + 32 < n ? w + 32 : n;
    unsigned int present = 0, waiting = 0, votes = 0;
    for (int i = w; i < end; ++i) {
      const unsigned int bit = 1u << (i - w);
      present |= bit;
      if (L.lanes[i].state == kAtBallot) {
        waiting |= bit;
        if (L.lanes[i].predicate) votes |= bit;
      }
    }
    if (waiting == 0) continue;
    for (int i = w; i < end; ++i) {
      const Lane& x = L.lanes[i];
      if (x.state != kAtBallot) continue;
      const unsigned int needed = x.mask & present;
      if ((needed & waiting) != needed) {
        char buf[200];
        snprintf(buf, sizeof buf,
                 "divergent __ballot_sync in block (%u,%u,%u), warp %d: mask "
                 "0x%08x names lanes that exited (waiting lanes 0x%08x)",
                 L.bid.x, L.bid.y, L.bid.z, w / 32, x.mask, waiting);
        error = buf;
        return false;
      }
    }
    for (int i = w; i < end; ++i) {
      Lane& x = L.lanes[i];
      if (x.state != kAtBallot) continue;
      x.result = votes & x.mask;
      x.state = kRunnable;
    }
  }
  return true;
}

inline int run_block(Launch& L, std::string& error) {
  const int n = static_cast<int>(L.lanes.size());
  for (int i = 0; i < n; ++i) {
    Lane& x = L.lanes[i];
    x.state = kRunnable;
    x.tid.x = i % L.block.x;
    x.tid.y = (i / L.block.x) % L.block.y;
    x.tid.z = i / (L.block.x * L.block.y);
    getcontext(&x.context);
    x.context.uc_stack.ss_sp = (*L.stacks)[i].data();
    x.context.uc_stack.ss_size = kStackBytes;
    x.context.uc_link = &L.scheduler;
    makecontext(&x.context, lane_entry, 0);
  }
  // Fisher-Yates with a per-block LCG: reproducible, but not lane order.
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  unsigned long long state = 0x9E3779B97F4A7C15ULL ^ (L.bid.x + 131ULL * L.bid.y);
  for (int i = n - 1; i > 0; --i) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    const int j = static_cast<int>((state >> 33) % static_cast<unsigned>(i + 1));
    const int t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  for (;;) {
    bool live = false;
    for (int i : order) {
      if (L.lanes[i].state != kRunnable) continue;
      L.current = i;
      swapcontext(&L.scheduler, &L.lanes[i].context);
      if (L.lanes[i].state == kAborted) {  // its fibers are abandoned
        error = "stopped: another block of this cooperative launch failed";
        return 1;
      }
    }
    for (const Lane& x : L.lanes) live = live || x.state != kDone;
    if (!live) return 0;
    if (!resolve(L, error)) return 1;
  }
}

// Runs `body` once per thread of the grid; returns 0, or 1 with `err` set.
// Blocks run one after another, or each on its own OS thread when
// `cooperative` (all resident at once, as a cooperative launch on a GPU).
inline int launch(dim3 grid, dim3 block, std::function<void()> body, char* err,
                  int err_len, int cooperative = 0) {
  const size_t n = static_cast<size_t>(block.x) * block.y * block.z;
  if (cooperative) {
    std::vector<dim3> bids;
    for (unsigned int z = 0; z < grid.z; ++z)
      for (unsigned int y = 0; y < grid.y; ++y)
        for (unsigned int x = 0; x < grid.x; ++x) bids.push_back({x, y, z});
    std::vector<std::string> errors(bids.size());
    std::vector<int> status(bids.size(), 0);
    std::atomic<bool> failed(false);
    std::vector<std::thread> threads;
    for (size_t b = 0; b < bids.size(); ++b)
      threads.emplace_back([&, b] {
        Launch L;
        L.grid = grid;
        L.block = block;
        L.body = body;
        L.bid = bids[b];
        L.lanes.resize(n);
        std::vector<std::vector<char>> stacks;
        while (stacks.size() < n) stacks.emplace_back(kStackBytes);
        L.stacks = &stacks;
        L.failed = &failed;
        active = &L;
        status[b] = run_block(L, errors[b]);
        if (status[b]) failed = true;
        active = nullptr;
      });
    for (std::thread& t : threads) t.join();
    // The first block's own failure, not the stops it caused.
    int first = -1;
    for (size_t b = 0; b < bids.size(); ++b)
      if (status[b] && (first < 0 || errors[first].rfind("stopped:", 0) == 0))
        first = static_cast<int>(b);
    if (first < 0) return 0;
    snprintf(err, err_len, "%s", errors[first].c_str());
    return 1;
  }
  Launch L;
  L.grid = grid;
  L.block = block;
  L.body = std::move(body);
  L.lanes.resize(n);
  // Reused across launches: allocating fresh stacks dominated small launches.
  static thread_local std::vector<std::vector<char>> stack_pool;
  Launch* outer = active;
  // A launch from inside a kernel (none today) must not share its stacks.
  std::vector<std::vector<char>> own_stacks;
  L.stacks = outer ? &own_stacks : &stack_pool;
  while (L.stacks->size() < n) L.stacks->emplace_back(kStackBytes);
  active = &L;
  std::string error;
  int status = 0;
  for (unsigned int z = 0; z < grid.z && !status; ++z)
    for (unsigned int y = 0; y < grid.y && !status; ++y)
      for (unsigned int x = 0; x < grid.x && !status; ++x) {
        L.bid.x = x;
        L.bid.y = y;
        L.bid.z = z;
        status = run_block(L, error);
      }
  active = outer;
  if (status) snprintf(err, err_len, "%s", error.c_str());
  return status;
}

}  // namespace ks_emu

#define threadIdx (ks_emu::lane().tid)
#define blockIdx (ks_emu::active->bid)
#define blockDim (ks_emu::active->block)
#define gridDim (ks_emu::active->grid)

inline unsigned int __ballot_sync(unsigned int mask, bool predicate) {
  ks_emu::Lane& x = ks_emu::lane();
  x.mask = mask;
  x.predicate = predicate;
  x.state = ks_emu::kAtBallot;
  ks_emu::yield_to_scheduler();
  return ks_emu::lane().result;
}

inline void __syncthreads() {
  ks_emu::lane().state = ks_emu::kAtSync;
  ks_emu::yield_to_scheduler();
}

inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __popc(unsigned int x) { return __builtin_popcount(x); }

// Real atomics: within a block fibers switch only at collectives, but the
// blocks of a cooperative launch run on OS threads side by side.
template <typename T>
inline T atomicAdd(T* address, T value) {
  return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}

template <typename T>
inline T atomicMin(T* address, T value) {
  T old = __atomic_load_n(address, __ATOMIC_SEQ_CST);
  while (value < old && !__atomic_compare_exchange_n(address, &old, value, false,
                                                     __ATOMIC_SEQ_CST,
                                                     __ATOMIC_SEQ_CST)) {
  }
  return old;
}

template <typename T>
inline T atomicCAS(T* address, T compare, T value) {
  __atomic_compare_exchange_n(address, &compare, value, false, __ATOMIC_SEQ_CST,
                              __ATOMIC_SEQ_CST);
  return compare;
}

template <typename T>
inline T atomicExch(T* address, T value) {
  return __atomic_exchange_n(address, value, __ATOMIC_SEQ_CST);
}

inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// A spinning thread lets the other blocks' OS threads run, and stops when
// another block of its cooperative launch failed (it would spin forever).
inline void __nanosleep(unsigned int) {
  ks_emu::Launch* L = ks_emu::active;
  if (L && L->failed && L->failed->load()) {
    ks_emu::lane().state = ks_emu::kAborted;
    ks_emu::yield_to_scheduler();  // never resumed
  }
  sched_yield();
}
