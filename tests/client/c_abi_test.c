/* libsteptrace from plain C99 (-Wall -Wextra -Werror -pedantic): a round trip with the
 * daemon whose socket is argv[1]. Writes "pid N" to argv[2]; exits 0 on success. */
#include <steptrace/steptrace.h>

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

static int check(int ok, const char* what) {
  if (!ok) fprintf(stderr, "c_abi_test: %s failed\n", what);
  return ok ? 0 : 1;
}

int main(int argc, char** argv) {
  int failures = 0;
  int i;
  uint32_t custom;
  FILE* out;
  if (argc < 3) {
    fprintf(stderr, "usage: %s SOCKET OUTFILE\n", argv[0]);
    return 64;
  }
  failures += check(steptrace_set_buffer_size(1u << 20, 0) == 0, "set_buffer_size");
  failures += check(steptrace_set_buffer_size(1024, 0) == -EINVAL, "set_buffer_size range");
  failures += check(steptrace_connect(argv[1]) == 0, "connect");
  custom = steptrace_register_step("CStep");
  failures += check(custom != UINT32_MAX, "register_step");
  failures += check(steptrace_register_step("CStep") == custom, "stable id");
  for (i = 0; i < 100; ++i) {
    steptrace_start(STEPTRACE_FORWARD);
    if (i % 2 == 0) {
      steptrace_start(custom);
      steptrace_end(custom);
    }
    steptrace_end(STEPTRACE_FORWARD);
  }
  steptrace_start(STEPTRACE_LEDGER_RESERVE);
  steptrace_ledger_reserve("GPU-c-abi", 7, 1u << 20, "c-task");
  steptrace_end(STEPTRACE_LEDGER_RESERVE);
  steptrace_vram_sample("GPU-c-abi", 1u << 30, 2u << 30);
  failures += check(steptrace_flush(10000) == 0, "flush");
  failures += check(steptrace_dropped() == 0, "dropped == 0");
  for (i = 0; i < STEPTRACE_DROP_CAUSE_COUNT; ++i) {
    failures += check(steptrace_dropped_by_cause(i) == 0, "dropped_by_cause == 0");
  }
  failures += check(steptrace_dropped_by_cause(STEPTRACE_DROP_INVALID) == 0, "invalid == 0");
  out = fopen(argv[2], "w");
  if (out != NULL) {
    fprintf(out, "pid %ld\n", (long)getpid());
    fclose(out);
  }
  steptrace_shutdown();
  return failures == 0 ? 0 : 1;
}
