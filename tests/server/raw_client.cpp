// raw_client: a test client that speaks steptrace's wire protocol directly through
// proto::Encoder (no libsteptrace), so integration tests control every byte and every
// timestamp, and can misbehave on purpose.
//
//   raw_client SOCKET good [--threads T] [--pairs N] [--dur NS] [--nest] [--custom NAME]
//                          [--ledger] [--dropped K] [--hold-ms MS] [--sent-file PATH]
//       hello; register NAME as step 256 (with --custom); per thread id 1..T: N pairs of
//       Forward start/end lasting NS ns (with --nest a Matmul pair inside each Forward,
//       lasting NS/2; with --custom a pair of the custom step); --ledger: reserve 1000
//       bytes on GPU-raw (reservation id = own pid, task "raw-task"); --dropped: report K
//       dropped; then Flush and wait for its FlushAck (exit 0), then stay connected MS ms.
//       --sent-file PATH: create PATH once every frame has been written to the socket.
//       --customs K (with --custom NAME): register K steps NAME-0000 .. as 256.. instead
//       of one, and record a pair of each in every pair of every thread (the soak's
//       state-size bomb: threads x K per-thread step states and K histograms).
//   raw_client SOCKET garbage|oversize|badversion|badstep
//       send a bad stream; exit 0 when the daemon answers with an Error frame and closes.
//   raw_client SOCKET truncated   hello plus half a frame, then close (exit 0).
//   raw_client SOCKET silent      connect, send nothing; exit 0 when the daemon closes.
//   raw_client SOCKET slow [--interval-ms MS]
//       hello, then one byte of a 24-byte frame every MS ms (default 2000); exit 0 when
//       the daemon closes the connection before the frame is complete.
// Exit status: 0 as described, 1 usage, 2 connect failed, 3 the daemon did not react as
// expected (with a line on stderr).
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "proto/codec.h"

namespace {

using namespace steptrace;

int fail(const char* what) {
  std::fprintf(stderr, "raw_client: %s\n", what);
  return 3;
}

int connect_to(const char* path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path, sizeof addr.sun_path - 1);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return -1;
  return fd;
}

bool send_all(int fd, const void* data, std::size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

bool send_bytes(int fd, std::span<const std::byte> bytes) {
  return send_all(fd, bytes.data(), bytes.size());
}

// Reads daemon frames until one is decoded, the daemon closes, or timeout.
enum class Reply { kFlushAck, kError, kClosed, kTimeout, kBad };
Reply read_reply(int fd, proto::Decoder& decoder, int timeout_ms, std::uint64_t* value = nullptr) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    auto r = decoder.next();
    if (r.error) return Reply::kBad;
    if (r.message) {
      if (auto* ack = std::get_if<proto::FlushAck>(&*r.message)) {
        if (value) *value = ack->sequence;
        return Reply::kFlushAck;
      }
      if (auto* err = std::get_if<proto::ErrorReport>(&*r.message)) {
        if (value) *value = err->code;
        std::fprintf(stderr, "raw_client: daemon error %u: %s\n", err->code,
                     std::string(proto::field_view(err->message)).c_str());
        return Reply::kError;
      }
      return Reply::kBad;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return Reply::kTimeout;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    auto space = decoder.prepare(4096);
    const ssize_t n = ::recv(fd, space.data(), space.size(), 0);
    if (n == 0) return Reply::kClosed;
    if (n < 0) {
      if (errno == EINTR) continue;
      return Reply::kClosed;  // ECONNRESET: closed
    }
    decoder.commit(static_cast<std::size_t>(n));
  }
}

// Waits until the daemon closes the connection (ignoring what it sends).
bool wait_closed(int fd, int timeout_ms) {
  proto::Decoder decoder(proto::Side::kClient);
  for (;;) {
    const Reply r = read_reply(fd, decoder, timeout_ms);
    if (r == Reply::kClosed) return true;
    if (r == Reply::kTimeout || r == Reply::kBad) return false;
  }
}

std::vector<std::byte> hello_bytes(std::uint16_t version = proto::kProtocolVersion) {
  std::vector<std::byte> buf(sizeof(proto::Hello));
  proto::Encoder encoder(buf);
  encoder.hello("raw-test", "raw_client");
  proto::Hello h;
  std::memcpy(&h, buf.data(), sizeof h);
  h.version = version;
  std::memcpy(buf.data(), &h, sizeof h);
  return buf;
}

proto::EventRecord event(std::uint64_t ts, std::uint32_t tid, std::uint16_t step,
                         proto::EventKind kind) {
  return proto::EventRecord{ts, tid, step, static_cast<std::uint8_t>(kind), 0};
}

struct GoodOptions {
  int threads = 1;
  int pairs = 10;
  std::uint64_t dur = 1000;
  bool nest = false;
  std::string custom;
  int customs = 1;  // with custom: how many steps (named NAME-%04d when more than one)
  bool ledger = false;
  long long dropped = -1;
  int hold_ms = 0;
  int interval_ms = 2000;
  std::string sent_file;  // created once every frame is written to the socket
};

int run_good(int fd, const GoodOptions& o) {
  std::vector<std::byte> buf(1 << 20);
  proto::Encoder encoder(buf);
  if (!send_bytes(fd, hello_bytes())) return fail("send hello");
  if (!o.custom.empty()) {
    for (int k = 0; k < o.customs; ++k) {
      char name[64];
      std::snprintf(name, sizeof name, "%.40s-%04d", o.custom.c_str(), k);
      const auto step = static_cast<std::uint16_t>(proto::kFirstCustomStep + k);
      if (!encoder.register_step(step, o.customs == 1 ? o.custom : std::string(name)))
        return fail("register the custom steps");
    }
  }
  std::vector<proto::EventRecord> events;
  std::uint64_t ts = 1'000'000;
  for (int t = 1; t <= o.threads; ++t) {
    for (int i = 0; i < o.pairs; ++i) {
      const auto tid = static_cast<std::uint32_t>(t);
      events.push_back(event(ts, tid, 0, proto::EventKind::kStart));
      if (o.nest) {
        events.push_back(event(ts + 10, tid, 2, proto::EventKind::kStart));
        events.push_back(event(ts + 10 + o.dur / 2, tid, 2, proto::EventKind::kEnd));
      }
      events.push_back(event(ts + o.dur, tid, 0, proto::EventKind::kEnd));
      for (int k = 0; !o.custom.empty() && k < o.customs; ++k) {
        const auto step = static_cast<std::uint16_t>(proto::kFirstCustomStep + k);
        events.push_back(event(ts + o.dur + 5, tid, step, proto::EventKind::kStart));
        events.push_back(event(ts + o.dur + 5 + o.dur, tid, step, proto::EventKind::kEnd));
      }
      ts += 3 * o.dur + 100;
    }
  }
  std::span<const proto::EventRecord> rest(events);
  while (!rest.empty()) {
    const std::size_t n = encoder.events(rest);
    if (n == 0) {
      if (!send_bytes(fd, encoder.bytes())) return fail("send events");
      encoder.clear();
      continue;
    }
    rest = rest.subspan(n);
  }
  if (o.ledger) {
    proto::LedgerRecord r{};
    r.timestamp_ns = ts;
    r.reservation_id = static_cast<std::uint64_t>(::getpid());
    r.bytes = 1000;
    r.thread_id = 1;
    r.op = static_cast<std::uint8_t>(proto::LedgerOp::kReserve);
    proto::set_field(r.gpu_uuid, "GPU-raw");
    proto::set_field(r.task, "raw-task");
    encoder.ledger(r);
  }
  if (o.dropped >= 0) encoder.dropped(static_cast<std::uint64_t>(o.dropped));
  encoder.flush(42);
  if (!send_bytes(fd, encoder.bytes())) return fail("send frames");
  if (!o.sent_file.empty()) {
    std::FILE* f = std::fopen(o.sent_file.c_str(), "w");
    if (f == nullptr || std::fclose(f) != 0) return fail("create the --sent-file");
  }
  proto::Decoder decoder(proto::Side::kClient);
  std::uint64_t seq = 0;
  const Reply r = read_reply(fd, decoder, 10000, &seq);
  if (r != Reply::kFlushAck || seq != 42) return fail("no FlushAck(42)");
  if (o.hold_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o.hold_ms));
  return 0;
}

int expect_error_and_close(int fd, std::uint32_t code) {
  proto::Decoder decoder(proto::Side::kClient);
  std::uint64_t got = 0;
  const Reply r = read_reply(fd, decoder, 10000, &got);
  if (r != Reply::kError) return fail("no Error frame");
  if (got != code) return fail("unexpected error code");
  if (!wait_closed(fd, 10000)) return fail("daemon did not close after the Error frame");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: raw_client SOCKET MODE [options]\n");
    return 1;
  }
  const std::string mode = argv[2];
  GoodOptions o;
  for (int i = 3; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "raw_client: %s needs a value\n", a.c_str());
        std::exit(1);
      }
      return argv[++i];
    };
    if (a == "--threads")
      o.threads = std::atoi(value());
    else if (a == "--pairs")
      o.pairs = std::atoi(value());
    else if (a == "--dur")
      o.dur = std::strtoull(value(), nullptr, 10);
    else if (a == "--nest")
      o.nest = true;
    else if (a == "--custom")
      o.custom = value();
    else if (a == "--customs")
      o.customs = std::atoi(value());
    else if (a == "--ledger")
      o.ledger = true;
    else if (a == "--dropped")
      o.dropped = std::atoll(value());
    else if (a == "--hold-ms")
      o.hold_ms = std::atoi(value());
    else if (a == "--interval-ms")
      o.interval_ms = std::atoi(value());
    else if (a == "--sent-file")
      o.sent_file = value();
    else {
      std::fprintf(stderr, "raw_client: unknown option %s\n", a.c_str());
      return 1;
    }
  }
  if (o.customs < 1 || o.customs > 4096) {
    std::fprintf(stderr, "raw_client: --customs takes 1 .. 4096\n");
    return 1;
  }
  const int fd = connect_to(argv[1]);
  if (fd < 0) {
    std::perror("raw_client: connect");
    return 2;
  }
  int rc = 1;
  if (mode == "good") {
    rc = run_good(fd, o);
  } else if (mode == "garbage") {
    const char junk[] = "\xF7garbage that is not a hello at all.........................";
    rc = send_all(fd, junk, sizeof junk - 1)
             ? expect_error_and_close(fd, static_cast<std::uint32_t>(proto::ErrorCode::kProtocol))
             : fail("send");
  } else if (mode == "badversion") {
    const auto hello = hello_bytes(99);
    rc = send_bytes(fd, hello)
             ? expect_error_and_close(
                   fd, static_cast<std::uint32_t>(proto::ErrorCode::kUnsupportedVersion))
             : fail("send");
  } else if (mode == "oversize" || mode == "badstep") {
    auto bytes = hello_bytes();
    if (mode == "oversize") {
      const proto::FrameHeader header{1u << 30,
                                      static_cast<std::uint16_t>(proto::FrameType::kEvents), 0};
      const auto* p = reinterpret_cast<const std::byte*>(&header);
      bytes.insert(bytes.end(), p, p + sizeof header);
    } else {
      // An event for custom step 300, never registered.
      std::array<std::byte, 64> buf{};
      proto::Encoder encoder(buf);
      const proto::EventRecord e = event(1, 1, 300, proto::EventKind::kStart);
      encoder.events(std::span(&e, 1));
      bytes.insert(bytes.end(), encoder.bytes().begin(), encoder.bytes().end());
    }
    rc = send_bytes(fd, bytes)
             ? expect_error_and_close(fd, static_cast<std::uint32_t>(proto::ErrorCode::kProtocol))
             : fail("send");
  } else if (mode == "truncated") {
    auto bytes = hello_bytes();
    std::array<std::byte, 64> buf{};
    proto::Encoder encoder(buf);
    const proto::EventRecord e = event(1, 1, 0, proto::EventKind::kStart);
    encoder.events(std::span(&e, 1));
    bytes.insert(bytes.end(), encoder.bytes().begin(), encoder.bytes().begin() + 12);
    rc = send_bytes(fd, bytes) ? 0 : fail("send");
  } else if (mode == "silent") {
    rc = wait_closed(fd, 20000) ? 0 : fail("daemon did not close a silent connection");
  } else if (mode == "slow") {
    const auto hello = hello_bytes();
    if (!send_bytes(fd, hello)) return fail("send hello");
    std::array<std::byte, 64> buf{};
    proto::Encoder encoder(buf);
    const proto::EventRecord e = event(1, 1, 0, proto::EventKind::kStart);
    encoder.events(std::span(&e, 1));
    bool closed = false;
    for (std::size_t i = 0; i < encoder.size() && !closed; ++i) {
      closed = !send_all(fd, &encoder.bytes()[i], 1) || wait_closed(fd, o.interval_ms);
    }
    rc = closed ? 0 : fail("daemon did not close a slow connection");
  } else {
    std::fprintf(stderr, "raw_client: unknown mode %s\n", mode.c_str());
  }
  ::close(fd);
  return rc;
}
