// A ledger worker: a real process using libsteptrace's VRAM-ledger annotations, its
// behaviour chosen by argv. Used by ledger_integration_test.
//
//   ledger_worker SOCKET reserve GPU ID BYTES TASK     reserve, exit holding it (a leak)
//   ledger_worker SOCKET hold GPU ID BYTES TASK [GPU ID BYTES TASK]...
//       reserve them all, print "ready", then serve stdin until EOF (or a kill):
//       "release GPU ID" releases and prints "released"
//   ledger_worker SOCKET release GPU ID
//   ledger_worker SOCKET cleanup GPU ID HOLDER_PID
//   ledger_worker SOCKET sample GPU FREE_BYTES TOTAL_BYTES
//   ledger_worker SOCKET anomalies GPU HELD_ID         the fixed set of anomalies below
//   ledger_worker SOCKET lease GPU ID BYTES TASK LEASE_MS HEARTBEAT_MS
//       reserve with a lease of LEASE_MS (steptrace_ledger_reserve_lease), print "ready",
//       then renew it for LEASE_MS every HEARTBEAT_MS (a trainer's heartbeat; 0: never)
//       while serving stdin until EOF (or a kill):
//       "hang" stops the heartbeat, flushes and prints "hung N" (N renewals sent so far):
//           from then on the process lives on but renews nothing (it hangs);
//       "renew GPU ID LEASE_MS" renews once and prints "renewed";
//       "release GPU ID" releases and prints "released"
//
// Every command ends with steptrace_flush, so when the process has printed its line or
// exited 0 the daemon has applied everything it recorded. Exit status: 0 success, 2 no
// daemon or a flush failed, 3 something was dropped, 64 usage.
#include <poll.h>
#include <steptrace/steptrace.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;

// Longer than the 63 characters the ABI keeps, so the client cuts it and flags the cut.
const std::string kOverLong(80, 'x');

[[noreturn]] void fail(const std::string& what, int status) {
  std::fprintf(stderr, "ledger_worker %d: %s\n", static_cast<int>(getpid()), what.c_str());
  std::exit(status);
}

[[noreturn]] void usage() {
  fail("usage: ledger_worker SOCKET reserve|hold|lease|release|cleanup|sample|anomalies ARGS...",
       64);
}

std::uint64_t number(std::string_view text) {
  std::uint64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) usage();
  return value;
}

// After a daemon restart the flusher reconnects with backoff and a flush fails with
// -ENOTCONN meanwhile: retry until the deadline, then give up loudly.
void flush_or_die() {
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  int rc = steptrace_flush(5000);
  while (rc != 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    rc = steptrace_flush(5000);
  }
  if (rc != 0) fail("steptrace_flush failed: " + std::to_string(rc), 2);
  if (steptrace_dropped() != 0) {
    fail("dropped " + std::to_string(steptrace_dropped()) + " events", 3);
  }
}

// One line on stdout, unbuffered: the test reads it through a pipe.
void say(const std::string& line) {
  const std::string out = line + "\n";
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::write(STDOUT_FILENO, out.data() + done, out.size() - done);
    if (n <= 0) fail("cannot write to stdout", 2);
    done += static_cast<std::size_t>(n);
  }
}

// Lines from stdin, read with poll so that a heartbeat can run while none arrives.
class StdinLines {
 public:
  // The next line (without its newline), or nullopt at end of input; while waiting,
  // calls `tick` every `tick_ms` (0: never).
  std::optional<std::string> next(int tick_ms, const std::function<void()>& tick) {
    auto next_tick = Clock::now() + std::chrono::milliseconds(tick_ms);
    for (;;) {
      if (const auto nl = pending_.find('\n'); nl != std::string::npos) {
        std::string line = pending_.substr(0, nl);
        pending_.erase(0, nl + 1);
        return line;
      }
      if (eof_) return std::nullopt;
      int timeout = -1;
      if (tick_ms > 0) {
        const auto now = Clock::now();
        if (now >= next_tick) {
          tick();
          next_tick = now + std::chrono::milliseconds(tick_ms);
          continue;
        }
        timeout = static_cast<int>(
            std::chrono::duration_cast<std::chrono::milliseconds>(next_tick - now).count() + 1);
      }
      pollfd p{STDIN_FILENO, POLLIN, 0};
      const int ready = ::poll(&p, 1, timeout);
      if (ready < 0 && errno != EINTR) fail("poll on stdin failed", 2);
      if (ready <= 0) continue;
      char buf[256];
      const ssize_t n = ::read(STDIN_FILENO, buf, sizeof buf);
      if (n == 0) eof_ = true;
      if (n < 0 && errno != EINTR) fail("cannot read stdin", 2);
      if (n > 0) pending_.append(buf, static_cast<std::size_t>(n));
    }
  }

 private:
  std::string pending_;
  bool eof_ = false;
};

std::uint32_t lease_ms(std::string_view text) {
  const std::uint64_t value = number(text);
  if (value > UINT32_MAX) usage();
  return static_cast<std::uint32_t>(value);
}

// `lease`: reserve with a lease, renew it on a heartbeat until told to hang.
void lease(char** args) {
  const std::string gpu = args[0];
  const std::uint64_t id = number(args[1]);
  const std::uint32_t lease = lease_ms(args[4]);
  int heartbeat_ms = static_cast<int>(std::min<std::uint64_t>(number(args[5]), 3600000));
  steptrace_ledger_reserve_lease(gpu.c_str(), id, number(args[2]), args[3], lease);
  flush_or_die();
  say("ready");
  std::uint64_t renewals = 0;
  const auto heartbeat = [&] {
    steptrace_ledger_renew(gpu.c_str(), id, lease);
    ++renewals;
  };
  StdinLines lines;
  while (const auto line = lines.next(heartbeat_ms, heartbeat)) {
    std::istringstream in(*line);
    std::string verb;
    std::string req_gpu;
    std::string req_id;
    std::string req_lease;
    in >> verb;
    if (verb == "hang") {
      heartbeat_ms = 0;
      flush_or_die();
      say("hung " + std::to_string(renewals));
    } else if (verb == "renew" && (in >> req_gpu >> req_id >> req_lease)) {
      steptrace_ledger_renew(req_gpu.c_str(), number(req_id), lease_ms(req_lease));
      flush_or_die();
      say("renewed");
    } else if (verb == "release" && (in >> req_gpu >> req_id)) {
      steptrace_ledger_release(req_gpu.c_str(), number(req_id));
      flush_or_die();
      say("released");
    } else {
      fail("bad request: " + *line, 64);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) usage();
  const std::string_view command = argv[2];
  const int nargs = argc - 3;
  char** args = argv + 3;
  if (const int rc = steptrace_connect(argv[1]); rc != 0) {
    fail("steptrace_connect: " + std::to_string(rc), 2);
  }

  if (command == "reserve" && nargs == 4) {
    steptrace_ledger_reserve(args[0], number(args[1]), number(args[2]), args[3]);
    flush_or_die();
  } else if (command == "hold" && nargs > 0 && nargs % 4 == 0) {
    for (int i = 0; i < nargs; i += 4) {
      steptrace_ledger_reserve(args[i], number(args[i + 1]), number(args[i + 2]), args[i + 3]);
    }
    flush_or_die();
    say("ready");
    std::string line;
    while (std::getline(std::cin, line)) {
      std::istringstream in(line);
      std::string verb;
      std::string gpu;
      std::string id;
      if (!(in >> verb >> gpu >> id) || verb != "release") fail("bad request: " + line, 64);
      steptrace_ledger_release(gpu.c_str(), number(id));
      flush_or_die();
      say("released");
    }
  } else if (command == "release" && nargs == 2) {
    steptrace_ledger_release(args[0], number(args[1]));
    flush_or_die();
  } else if (command == "cleanup" && nargs == 3) {
    steptrace_ledger_cleanup(args[0], number(args[1]), static_cast<std::uint32_t>(number(args[2])));
    flush_or_die();
  } else if (command == "sample" && nargs == 3) {
    steptrace_vram_sample(args[0], number(args[1]), number(args[2]));
    flush_or_die();
  } else if (command == "lease" && nargs == 6) {
    lease(args);
  } else if (command == "anomalies" && nargs == 2) {
    // Each record is an anomaly that must change nothing in the view but its counts:
    //   unknown_release, unknown_cleanup, duplicate_reservation, zero_byte_reserve,
    //   gpu_uuid_truncated, task_truncated: each on a reserve that would otherwise be
    //   valid (a new id, nonzero bytes), so only the over-long string refuses it.
    const char* gpu = args[0];
    const std::uint64_t held = number(args[1]);
    constexpr std::uint64_t kUnknown = 0xdead0000beefULL;
    steptrace_ledger_release(gpu, kUnknown);
    steptrace_ledger_cleanup(gpu, kUnknown + 1, 1);
    steptrace_ledger_reserve(gpu, held, 4096, "duplicate");
    steptrace_ledger_reserve(gpu, kUnknown + 2, 0, "zero");
    steptrace_ledger_reserve(kOverLong.c_str(), kUnknown + 3, 4096, "long-gpu");
    steptrace_ledger_reserve(gpu, kUnknown + 4, 4096, kOverLong.c_str());
    flush_or_die();
  } else {
    usage();
  }
  return 0;  // the atexit hook flushes (bounded) and stops the flusher
}
