/* A C99 user of steptrace::client from add_subdirectory(steptrace) (see CMakeLists.txt
 * here): `subdir_consumer ABSENT_SOCKET` checks <steptrace/version.h>, records spans
 * with no daemon listening (the library keeps or counts them, never blocks), and prints
 * "steptrace <version>". Exit codes: 2 usage, 3 version macros disagree, 4 connect did
 * not fail with -ENOENT, 5 custom step refused, 6 flush did not fail. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <steptrace/steptrace.h>
#include <steptrace/version.h>
#include <string.h>

/* The numbers are defined, and usable by the preprocessor (a non-integer is an error). */
#if !defined(STEPTRACE_VERSION_MAJOR) || !defined(STEPTRACE_VERSION_MINOR) || \
    !defined(STEPTRACE_VERSION_PATCH) || !defined(STEPTRACE_VERSION_STRING)
#error "<steptrace/version.h> does not define the four STEPTRACE_VERSION_* macros"
#elif STEPTRACE_VERSION_MAJOR + STEPTRACE_VERSION_MINOR + STEPTRACE_VERSION_PATCH < 0
#error "STEPTRACE_VERSION_MAJOR/MINOR/PATCH are not version numbers"
#endif

#define SUBDIR_STR2(x) #x
#define SUBDIR_STR(x) SUBDIR_STR2(x)

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s ABSENT_SOCKET\n", argv[0]);
    return 2;
  }
  static const char joined[] = SUBDIR_STR(STEPTRACE_VERSION_MAJOR) "." SUBDIR_STR(
      STEPTRACE_VERSION_MINOR) "." SUBDIR_STR(STEPTRACE_VERSION_PATCH);
  if (strcmp(joined, STEPTRACE_VERSION_STRING) != 0) {
    fprintf(stderr, "%s != %s\n", joined, STEPTRACE_VERSION_STRING);
    return 3;
  }
  const int rc = steptrace_connect(argv[1]);
  if (rc != -ENOENT) {
    fprintf(stderr, "steptrace_connect(%s): %d\n", argv[1], rc);
    return 4;
  }
  const uint32_t custom = steptrace_register_step("subdir_consumer_step");
  if (custom == UINT32_MAX) return 5;
  for (int i = 0; i < 100; ++i) {
    steptrace_start(STEPTRACE_FORWARD);
    steptrace_start(custom);
    steptrace_end(custom);
    steptrace_end(STEPTRACE_FORWARD);
  }
  if (steptrace_flush(100) == 0) return 6;
  steptrace_shutdown();
  printf("steptrace %s\n", STEPTRACE_VERSION_STRING);
  return 0;
}
