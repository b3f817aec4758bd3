// A trainer for client_job_integration_test: a real process using libsteptrace (shared),
// whose job and rank come from its environment (STEPTRACE_JOB, RANK, ...; read by the
// library at load).
//
//   steptrace_job_trainer MODE SOCKET OUTFILE [ARGS...]
//
//   hold N RELEASE       N Forward spans, each with one Matmul span nested inside, then
//                        steptrace_flush (the daemon has applied them), OUTFILE written;
//                        then stays alive (connected) until the file RELEASE exists, and
//                        exits without recording more.
//   nested N A B C       N times Forward { sleep A ms; Matmul { sleep B ms }; sleep C ms },
//                        flushed, OUTFILE written, exit.
//
// OUTFILE gets "key value" lines (pid, dropped), written atomically (rename). Exits 0
// when everything it could check itself held, 2 otherwise, 3 when RELEASE never came.
#include <steptrace/steptrace.h>
#include <sys/stat.h>
#include <unistd.h>
#include <steptrace/steptrace.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <thread>

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "job trainer %d: %s\n", static_cast<int>(getpid()), what);
  std::exit(2);
}

void write_out(const std::string& path) {
  std::map<std::string, long long> values{{"pid", getpid()},
                                          {"dropped", static_cast<long long>(steptrace_dropped())}};
  {
    std::ofstream f(path + ".tmp");
    for (const auto& [k, v] : values) f << k << ' ' << v << '\n';
    if (!f) fail("cannot write the out file");
  }
  if (std::rename((path + ".tmp").c_str(), path.c_str()) != 0) fail("rename");
}

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s MODE SOCKET OUTFILE [ARGS...]\n", argv[0]);
    return 64;
  }
  const std::string mode = argv[1];
  const std::string socket = argv[2];
  const std::string outfile = argv[3];
  const auto arg = [&](int i, int def) { return argc > i ? std::atoi(argv[i]) : def; };
  if (steptrace_connect(socket.c_str()) != 0) fail("connect");

  if (mode == "hold") {
    const int n = arg(4, 100);
    if (argc < 6) fail("hold needs N RELEASE");
    const std::string release = argv[5];
    for (int i = 0; i < n; ++i) {
      steptrace::Span forward(steptrace::Step::kForward);
      { steptrace::Span matmul(steptrace::Step::kMatmul); }
      if ((i + 1) % 1000 == 0 && steptrace_flush(10000) != 0) fail("periodic flush");
    }
    if (steptrace_flush(10000) != 0) fail("flush");
    if (steptrace_dropped() != 0) fail("dropped events");
    write_out(outfile);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (!exists(release)) {
      if (std::chrono::steady_clock::now() > deadline) return 3;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return 0;
  }
  if (mode == "nested") {
    const int n = arg(4, 4);
    const std::chrono::milliseconds before(arg(5, 20));
    const std::chrono::milliseconds inner(arg(6, 10));
    const std::chrono::milliseconds after(arg(7, 5));
    for (int i = 0; i < n; ++i) {
      steptrace::Span forward(steptrace::Step::kForward);
      std::this_thread::sleep_for(before);
      {
        steptrace::Span matmul(steptrace::Step::kMatmul);
        std::this_thread::sleep_for(inner);
      }
      std::this_thread::sleep_for(after);
    }
    if (steptrace_flush(10000) != 0) fail("flush");
    if (steptrace_dropped() != 0) fail("dropped events");
    write_out(outfile);
    return 0;
  }
  fail("unknown mode");
}
