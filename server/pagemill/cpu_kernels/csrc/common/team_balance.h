// How a team's threads share a linear's blocks: in proportion to how fast
// each went in the previous calls, not evenly (the share() of gemm_bf16.h
// and int8_rows.h, on tiles or vectors).
//
// Why: serving at 64 concurrent requests on 2 cores, the router, the load
// generator and the shard's gRPC threads share the cores with the two
// OpenMP threads, and mostly with the first: perf put 25% more time in the
// master's GEMM tiles than in the worker's for the same blocks, while the
// worker waited in libgomp's barriers for ~25% of its time. Alone, the two
// threads take the same time for the same blocks, so the shares stay even.
//
// Each output block is still computed by one thread with the same
// arithmetic, so the results do not depend on the shares (bit for bit).
// The state lives with the thread that calls into the library (the shard's
// model thread), one per team size (begin_team), and changes only between
// parallel regions (end_team): the team reads the shares and each thread
// adds its own busy time.
#pragma once
#include <stdint.h>

#include <chrono>
#include <vector>

namespace pagemill::balance {

constexpr int kMaxThreads = 64;
// How far one region's measurement moves the shares, and the most a thread's share may
// differ from an even one (a thread descheduled once does not lose its share for long).
constexpr double kStep = 0.25;
constexpr double kMaxSkew = 0.5;

inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct TeamBalance {
  int nt = 0;
  double cum[kMaxThreads + 1] = {};  // thread t's share of a call's units: [cum[t], cum[t + 1])
  alignas(64) double busy[kMaxThreads] = {};  // seconds each thread spent in its shares

  // Before a region of `threads` threads: a new team size starts even.
  void begin(int threads) {
    if (threads < 1 || threads > kMaxThreads) threads = 1;
    if (threads != nt) {
      nt = threads;
      for (int t = 0; t <= nt; ++t) cum[t] = (double)t / nt;
    }
    for (int t = 0; t < nt; ++t) busy[t] = 0;
  }

  // After the region: each share moves toward the fraction that would have made the threads
  // finish together at the speeds just measured (share / busy time).
  void update() {
    if (nt < 2) return;
    double speed[kMaxThreads], total = 0;
    for (int t = 0; t < nt; ++t) {
      if (busy[t] <= 0) return;  // a thread without a share: nothing measured
      speed[t] = (cum[t + 1] - cum[t]) / busy[t];
      total += speed[t];
    }
    double share[kMaxThreads], sum = 0;
    const double even = 1.0 / nt;
    for (int t = 0; t < nt; ++t) {
      const double s = (1 - kStep) * (cum[t + 1] - cum[t]) + kStep * speed[t] / total;
      const double lo = even * (1 - kMaxSkew), hi = even * (1 + kMaxSkew);
      share[t] = s < lo ? lo : (s > hi ? hi : s);
      sum += share[t];
    }
    for (int t = 0; t < nt; ++t) cum[t + 1] = cum[t] + share[t] / sum;
    cum[nt] = 1.0;
  }
};

// The calling thread's balance for teams of `threads` threads, begun (busy times cleared); null
// for one thread. One per team size, shared by every kernel that calls it: how fast each
// thread goes is the thread's, not the kernel's.
inline TeamBalance* begin_team(int threads) {
  static thread_local std::vector<TeamBalance> by_size(kMaxThreads + 1);  // never moves
  if (threads < 2 || threads > kMaxThreads) return nullptr;
  by_size[threads].begin(threads);
  return &by_size[threads];
}

// After the team's region: the shares move toward the speeds measured in it.
inline void end_team(TeamBalance* b) {
  if (b) b->update();
}

// Thread t's first unit of `units` (t == nt: units): by `cum` where the team is the one the
// balance was made for, else evenly.
inline int64_t bound(const TeamBalance* b, int64_t units, int t, int nt) {
  if (!b || b->nt != nt) return units * t / nt;
  if (t >= nt) return units;
  return (int64_t)(units * b->cum[t] + 0.5);
}

// Adds the scope's seconds to thread t's busy time (nothing without a balance).
struct Busy {
  TeamBalance* b;
  int t;
  double t0;
  Busy(TeamBalance* balance, int thread, int nt)
      : b(balance && balance->nt == nt ? balance : nullptr), t(thread), t0(b ? now() : 0) {}
  ~Busy() {
    if (b) b->busy[t] += now() - t0;
  }
};

}  // namespace pagemill::balance
