/* A C99 user of the installed libsteptrace: `consumer_c N` records N Forward spans
 * with a Matmul nested in each and N spans of a custom step, annotates one VRAM
 * reservation, waits until the daemon has applied everything and prints its pid.
 * Exit codes: 2 connect failed, 3 custom step refused, 4 flush failed. */
#include <steptrace/steptrace.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char** argv) {
  const int n = argc > 1 ? atoi(argv[1]) : 10;
  const int rc = steptrace_connect(NULL); /* $STEPTRACE_SOCKET */
  if (rc != 0) {
    fprintf(stderr, "steptrace_connect: %d\n", rc);
    return 2;
  }
  const uint32_t custom = steptrace_register_step("consumer_c_step");
  if (custom == UINT32_MAX) return 3;
  for (int i = 0; i < n; ++i) {
    steptrace_start(STEPTRACE_FORWARD);
    steptrace_start(STEPTRACE_MATMUL);
    steptrace_end(STEPTRACE_MATMUL);
    steptrace_end(STEPTRACE_FORWARD);
    steptrace_start(custom);
    steptrace_end(custom);
  }
  steptrace_vram_sample("GPU-consumer", 3000, 4000);
  steptrace_ledger_reserve("GPU-consumer", (uint64_t)getpid(), 1000, "consumer-c");
  const int flushed = steptrace_flush(10000);
  if (flushed != 0) {
    fprintf(stderr, "steptrace_flush: %d\n", flushed);
    return 4;
  }
  printf("%d\n", (int)getpid());
  steptrace_shutdown();
  return 0;
}
