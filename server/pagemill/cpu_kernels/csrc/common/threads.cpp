// Thread placement for the shard (shard/cpu_pinning.py): each thread of the calling thread's
// OpenMP team pinned to a core of its own.
#include <omp.h>
#include <sched.h>

extern "C" {

// Thread t of a team of n started by the caller (the caller is thread 0) runs only on cpus[t]
// from now on; the team's threads are kept by libgomp for the caller's later regions (torch's
// and ours). Returns how many threads could not be pinned (0: all were).
int pagemill_bind_team(int n, const int* cpus) {
  if (n < 1) return 0;
  int failed = 0;
#pragma omp parallel num_threads(n) reduction(+ : failed)
  {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[omp_get_thread_num()], &set);
    failed += sched_setaffinity(0, sizeof(set), &set) != 0;
    failed += omp_get_num_threads() != n && omp_get_thread_num() == 0;  // a smaller team than asked
  }
  return failed;
}
}
