/* The smallest C user of libsteptrace: time a few spans of a toy "training step",
 * annotate a VRAM reservation and its release, and flush so the daemon has it all before
 * exiting. No steptrace_connect: the library connects by itself at the first event (to
 * $STEPTRACE_SOCKET, else the default path) and says once on stderr when it cannot. Run
 * it with STEPTRACE_SOCKET pointing at a running steptraced, then look at
 * `steptrace report --pid <its pid>`. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <steptrace/steptrace.h>

#define N 32

static float a[N * N], b[N * N], c[N * N];

static void matmul(void) {
  steptrace_start(STEPTRACE_MATMUL);
  for (int i = 0; i < N; ++i) {
    for (int j = 0; j < N; ++j) {
      float sum = 0.0f;
      for (int k = 0; k < N; ++k) sum += a[i * N + k] * b[k * N + j];
      c[i * N + j] = sum;
    }
  }
  steptrace_end(STEPTRACE_MATMUL);
}

int main(void) {
  const char* gpu = "GPU-00000000-minimal-c-0000-000000000000";
  const uint64_t reservation = (uint64_t)getpid();
  int rc;
  for (int i = 0; i < N * N; ++i) {
    a[i] = (float)(i % 7) * 0.5f;
    b[i] = (float)(i % 5) * 0.25f;
  }
  /* A custom step, named like the built-in ones. */
  const uint32_t checkpoint = steptrace_register_step("Checkpoint");

  steptrace_start(STEPTRACE_LEDGER_RESERVE);
  steptrace_ledger_reserve(gpu, reservation, 64u << 20, "minimal-c");
  steptrace_end(STEPTRACE_LEDGER_RESERVE);

  for (int step = 0; step < 5; ++step) {
    steptrace_start(STEPTRACE_FORWARD);
    matmul();
    steptrace_end(STEPTRACE_FORWARD);
    steptrace_start(STEPTRACE_BACKWARD);
    matmul();
    steptrace_end(STEPTRACE_BACKWARD);
  }
  if (checkpoint != UINT32_MAX) {
    steptrace_start(checkpoint);
    steptrace_end(checkpoint);
  }

  steptrace_start(STEPTRACE_LEDGER_RELEASE);
  steptrace_ledger_release(gpu, reservation);
  steptrace_end(STEPTRACE_LEDGER_RELEASE);

  rc = steptrace_flush(2000);
  printf("minimal: pid %d, 5 steps recorded, c[0] = %g, flush %s, %llu events dropped\n",
         (int)getpid(), (double)c[0], rc == 0 ? "ok" : strerror(-rc),
         (unsigned long long)steptrace_dropped());
  steptrace_shutdown();
  return rc == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
