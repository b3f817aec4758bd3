// A test trainer that dies: a real process using libsteptrace (shared) that records a
// given number of events and then ends without any flush, the ways trainers die. Used by
// client_shm_death_test (shm_death_test.cpp).
//
//   steptrace_dying_trainer SOCKET EVENTS DEATH [READY GO]
//
// 1. steptrace_connect(SOCKET); one warm-up Backward span (2 events: it makes the main
//    thread's ring, a sealed memfd); steptrace_flush(5000). A flush is answered only once
//    no ring waits for its RingAck, so from here on the daemon maps the ring and drains
//    it itself (protocol version 5), unless it refused it (stats: shared_rings.refused).
// 2. With READY and GO: writes the file READY, then waits until the file GO exists (the
//    test stops the daemon meanwhile), at most 60 s (else exit 3).
// 3. EVENTS events of Forward, alternately steptrace_start and steptrace_end, with no
//    flush: EVENTS / 2 complete spans, and an odd EVENTS leaves one span open.
// 4. DEATH, at once, with nothing flushed and no at-exit hook run:
//      kill   raise(SIGKILL)                                     status 128 + 9
//      exit   _exit(0)                                           status 0
//      segv   a write to a read-only page, SIGSEGV's default     status 128 + 11
//             action (a sanitizer's handler is removed first)
//      abort  abort(), SIGABRT's default action                  status 128 + 6
//      live   not yet: writes the file GO.done and waits for a signal to end it (its
//             connection stays open; the test kills it)
//      thread-kill  step 3 runs on a new thread (its first events: its ring is made or
//             taken now), which raises SIGKILL right after them     status 128 + 9
//    No core is written (RLIMIT_CORE 0, not dumpable).
//
// Exit 2 when a step before the death failed (connect or flush), 64 on bad arguments.
#include <fcntl.h>
#include <signal.h>
#include <steptrace/steptrace.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "dying_trainer %d: %s\n", static_cast<int>(::getpid()), what);
  std::_Exit(2);
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

void write_file(const std::string& path) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot write the ready file");
  const std::string text = std::to_string(::getpid()) + "\n";
  if (::write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
    fail("cannot write the ready file");
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("cannot rename the ready file");
}

// The signal's default action, whatever a runtime (a sanitizer) installed.
void default_action(int sig) {
  struct sigaction sa {};
  sa.sa_handler = SIG_DFL;
  sigemptyset(&sa.sa_mask);
  ::sigaction(sig, &sa, nullptr);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, sig);
  ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
}

void no_core() {
  const rlimit zero{0, 0};
  ::setrlimit(RLIMIT_CORE, &zero);
  ::prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 && argc != 6) {
    std::fprintf(stderr,
                 "usage: %s SOCKET EVENTS kill|exit|segv|abort|live|thread-kill [READY GO]\n",
                 argv[0]);
    return 64;
  }
  const std::string socket = argv[1];
  char* end = nullptr;
  const long long events = std::strtoll(argv[2], &end, 10);
  const std::string death = argv[3];
  if (end == argv[2] || *end != '\0' || events < 0 ||
      (death != "kill" && death != "exit" && death != "segv" && death != "abort" &&
       death != "live" && death != "thread-kill")) {
    std::fprintf(stderr, "%s: bad arguments\n", argv[0]);
    return 64;
  }
  // Made before recording: the write that faults must not be an allocation's.
  void* page = ::mmap(nullptr, 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED) fail("mmap");

  // 1. Connected, and the ring handed to the daemon.
  if (steptrace_connect(socket.c_str()) != 0) fail("steptrace_connect");
  steptrace_start(STEPTRACE_BACKWARD);
  steptrace_end(STEPTRACE_BACKWARD);
  if (steptrace_flush(5000) != 0) fail("steptrace_flush");

  // 2. Ready; wait for the go.
  if (argc == 6) {
    write_file(argv[4]);
    const std::string go = argv[5];
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!file_exists(go)) {
      if (std::chrono::steady_clock::now() > deadline) return 3;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

  // 3. The events, unflushed.
  const auto record = [events] {
    for (long long i = 0; i < events; ++i) {
      if (i % 2 == 0) {
        steptrace_start(STEPTRACE_FORWARD);
      } else {
        steptrace_end(STEPTRACE_FORWARD);
      }
    }
  };
  if (death == "thread-kill") {
    std::thread fresh([&record] {
      record();
      ::raise(SIGKILL);
    });
    fresh.join();
    fail("survived its death");
  }
  record();

  // 4. The death.
  if (death == "live") {
    if (argc == 6) write_file(std::string(argv[5]) + ".done");
    for (;;) ::pause();
  }
  if (death == "kill") {
    ::raise(SIGKILL);
  } else if (death == "exit") {
    ::_exit(0);
  } else if (death == "segv") {
    no_core();
    default_action(SIGSEGV);
    *static_cast<volatile char*>(page) = 1;
  } else {
    no_core();
    default_action(SIGABRT);
    std::abort();
  }
  fail("survived its death");
}
