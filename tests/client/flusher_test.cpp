// The flusher against a scripted daemon (a listening socket this test drives frame by
// frame with the shared codec): the handshake before events, the fall back to protocol
// versions 2 and 1 (leases without their lease), drop reports per cause, and the drop accounting at
// exit; and the spare rings of protocol version 8 (one test against the real steptraced, which
// drains a shared ring). Each test runs in its own process (gtest discovery): the library's
// per-process state starts fresh.
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <steptrace/steptrace.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "client/src/client.h"
#include "client/src/flusher.h"
#include "proto/codec.h"
#include "proto/shm_ring.h"
#include "tests/support/daemon_process.h"

namespace steptrace::client {
namespace {

using Clock = std::chrono::steady_clock;

// A test's first event auto-connects to $STEPTRACE_SOCKET (read then): an absent path
// unless the test sets another, so no daemon running on this machine gets the events.
[[maybe_unused]] const int kAbsentSocketEnv =
    ::setenv("STEPTRACE_SOCKET", "/nonexistent-steptrace-dir/steptraced.sock", 1);
// These tests script the socket path frame by frame: rings stay in the library's memory
// (STEPTRACE_SHM_RINGS=0, read at load) and the flusher encodes every event. The shared
// rings of protocol version 5 are tested against the real daemon (shm_ring_test.cpp).
// A test that needs the shared rings runs itself again in a child with
// STEPTRACE_SHM_RINGS=1, which is kept.
[[maybe_unused]] const int kSocketPathEnv = ::setenv("STEPTRACE_SHM_RINGS", "0", 0);

// Whether this process's library offers rings (STEPTRACE_SHM_RINGS=1 at load).
bool shm_rings_on() {
  const char* env = std::getenv("STEPTRACE_SHM_RINGS");
  return env != nullptr && std::string(env) == "1";
}

// For a test that needs the shared rings, in a process whose library read
// STEPTRACE_SHM_RINGS=0 at load: runs the current test in a child of this binary whose
// library offers rings, expects it to pass, and returns true (the caller returns). False
// in that child.
bool ran_with_shm_rings() {
  if (shm_rings_on()) return false;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string filter =
      std::string("--gtest_filter=") + info->test_suite_name() + "." + info->name();
  EXPECT_EQ(
      steptrace::testing::run_process({"/proc/self/exe", filter}, {"STEPTRACE_SHM_RINGS=1"}, 60000),
      0);
  return true;
}

// A daemon that consumes an offered ring before the library's sendmsg returns (it may:
// the frame is out), played inside that call: this binary links with
// -Wl,--wrap=sendmsg (CMakeLists.txt). While on, every ring offered is consumed to its
// head there, and let go at once (consumer_pid 0, as a daemon does after its last pass).
std::atomic<bool> g_consume_in_sendmsg{false};
std::atomic<std::uint64_t> g_consumed_in_sendmsg{0};

void consume_offered_ring(const msghdr* msg) {
  const cmsghdr* c = CMSG_FIRSTHDR(msg);
  if (c == nullptr || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) return;
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(c), sizeof fd);
  void* p = ::mmap(nullptr, proto::kRingHeaderBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return;
  auto* header = static_cast<proto::RingHeader*>(p);
  const std::uint64_t head = proto::ring_field(header->head).load(std::memory_order_acquire);
  const std::uint64_t tail = proto::ring_field(header->tail).load(std::memory_order_acquire);
  proto::ring_field(header->tail).store(head, std::memory_order_release);
  proto::ring_field(header->consumer_pid).store(0, std::memory_order_release);
  g_consumed_in_sendmsg.fetch_add(head - tail);
  ::munmap(p, proto::kRingHeaderBytes);
}

class FakeDaemon {
 public:
  // Listens on `path`, by default a fresh one.
  explicit FakeDaemon(std::string path = "")
      : path_(path.empty() ? dir_.file("d.sock") : std::move(path)) {
    listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path_.c_str(), path_.size() + 1);
    EXPECT_EQ(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    EXPECT_EQ(::listen(listen_fd_, 16), 0);
  }
  ~FakeDaemon() {
    close_connection();
    ::close(listen_fd_);
  }
  FakeDaemon(const FakeDaemon&) = delete;
  FakeDaemon& operator=(const FakeDaemon&) = delete;

  const std::string& path() const { return path_; }

  bool accept_connection(int timeout_ms) {
    close_connection();
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) != 1) return false;
    conn_fd_ = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    decoder_.emplace(proto::Side::kDaemon);
    return conn_fd_ >= 0;
  }
  void close_connection() {
    if (conn_fd_ >= 0) ::close(conn_fd_);
    conn_fd_ = -1;
  }

  // The next message the client sent, decoded as the daemon decodes it; nullopt on
  // timeout, close or a decode error (then error() says which).
  std::optional<proto::Message> next(int timeout_ms = 5000) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      proto::DecodeResult r = decoder_->next();
      if (r.error) {
        error_ = r.error;
        return std::nullopt;
      }
      if (r.message) return r.message;
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return std::nullopt;
      pollfd p{conn_fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left)) != 1) return std::nullopt;
      auto space = decoder_->prepare(64 * 1024);
      const ssize_t n = ::recv(conn_fd_, space.data(), space.size(), 0);
      if (n <= 0) return std::nullopt;
      decoder_->commit(static_cast<std::size_t>(n));
    }
  }
  // True when no byte arrives for `ms`.
  bool quiet_for(int ms) {
    if (decoder_->buffered() > 0) return false;
    pollfd p{conn_fd_, POLLIN, 0};
    return ::poll(&p, 1, ms) == 0;
  }
  std::uint16_t version() const { return decoder_->version(); }
  // The Delivered frame of the last handshake (version 6).
  std::optional<std::uint64_t> delivered() const { return delivered_; }
  std::error_code error() const { return error_; }

  void send_ack(std::uint64_t sequence) {
    std::byte buf[64];
    proto::Encoder enc(buf);
    enc.flush_ack(sequence);
    ASSERT_EQ(::send(conn_fd_, buf, enc.size(), MSG_NOSIGNAL), static_cast<ssize_t>(enc.size()));
  }
  void send_error(proto::ErrorCode code, const std::string& message) {
    std::byte buf[256];
    proto::Encoder enc(buf);
    enc.error(code, message);
    ASSERT_EQ(::send(conn_fd_, buf, enc.size(), MSG_NOSIGNAL), static_cast<ssize_t>(enc.size()));
  }

  // Reads the hello and the handshake Flush; acknowledges it unless told not to.
  // The hello's version, 0 when the stream did not start that way.
  std::uint16_t handshake(bool ack = true) {
    const auto hello = next();
    if (!hello || !std::holds_alternative<proto::Hello>(*hello)) return 0;
    // Version 6: what earlier daemons took comes first.
    if (std::get<proto::Hello>(*hello).version >= proto::kDeliveredProtocolVersion) {
      const auto delivered = next();
      if (!delivered || !std::holds_alternative<proto::Delivered>(*delivered)) return 0;
      delivered_ = std::get<proto::Delivered>(*delivered).events;
    }
    const auto flush = next();
    if (!flush || !std::holds_alternative<proto::FlushRequest>(*flush)) return 0;
    const std::uint64_t seq = std::get<proto::FlushRequest>(*flush).sequence;
    if ((seq & kOwnFlushBit) == 0) return 0;
    if (ack) send_ack(seq);
    return std::get<proto::Hello>(*hello).version;
  }

 private:
  steptrace::testing::TempDir dir_;
  std::string path_;
  int listen_fd_ = -1;
  int conn_fd_ = -1;
  std::optional<proto::Decoder> decoder_;
  std::error_code error_;
  std::optional<std::uint64_t> delivered_;
};

// What a stretch of the stream carried.
struct Seen {
  std::uint64_t events = 0;
  int dropped_frames = 0;  // Dropped (version 1)
  int by_cause_frames = 0;
  proto::DroppedByCause last_by_cause{};
  std::uint64_t last_total = 0;
  std::vector<proto::LedgerRecord> ledger;
};

// Reads messages (acknowledging user flushes) until `until(seen)` or a quiet `ms`.
template <class Until>
Seen read_until(FakeDaemon& daemon, Until until, int timeout_ms = 5000) {
  Seen seen;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (!until(seen) && Clock::now() < deadline) {
    const auto m = daemon.next(100);
    if (!m) {
      if (daemon.error()) break;
      continue;
    }
    if (const auto* events = std::get_if<proto::EventSpan>(&*m)) {
      seen.events += events->size();
    } else if (const auto* d = std::get_if<proto::DroppedReport>(&*m)) {
      ++seen.dropped_frames;
      seen.last_total = d->total_dropped;
    } else if (const auto* c = std::get_if<proto::DroppedByCause>(&*m)) {
      ++seen.by_cause_frames;
      seen.last_by_cause = *c;
    } else if (const auto* l = std::get_if<proto::LedgerRecord>(&*m)) {
      seen.ledger.push_back(*l);
    } else if (const auto* f = std::get_if<proto::FlushRequest>(&*m)) {
      daemon.send_ack(f->sequence);
    }
  }
  return seen;
}

void spans(std::uint32_t step, int n) {
  for (int i = 0; i < n; ++i) {
    steptrace_start(step);
    steptrace_end(step);
  }
}

std::uint64_t by_cause(steptrace_drop_cause cause) { return steptrace_dropped_by_cause(cause); }

TEST(Flusher, EventsFollowOnlyOnceTheDaemonAcknowledgedTheHello) {
  FakeDaemon daemon;
  spans(STEPTRACE_FORWARD, 50);
  ASSERT_EQ(steptrace_connect(daemon.path().c_str()), 0);
  ASSERT_TRUE(daemon.accept_connection(5000));
  const auto hello = daemon.next();
  ASSERT_TRUE(hello && std::holds_alternative<proto::Hello>(*hello));
  EXPECT_EQ(std::get<proto::Hello>(*hello).version, proto::kProtocolVersion);
  // No daemon took anything of this process yet: the 100 events were only recorded.
  const auto delivered = daemon.next();
  ASSERT_TRUE(delivered && std::holds_alternative<proto::Delivered>(*delivered));
  EXPECT_EQ(std::get<proto::Delivered>(*delivered).events, 0u);
  const auto flush = daemon.next();
  ASSERT_TRUE(flush && std::holds_alternative<proto::FlushRequest>(*flush));
  const std::uint64_t seq = std::get<proto::FlushRequest>(*flush).sequence;
  EXPECT_NE(seq & kOwnFlushBit, 0u);
  EXPECT_TRUE(daemon.quiet_for(100));  // nothing more before the ack
  daemon.send_ack(seq);
  const Seen seen = read_until(daemon, [](const Seen& s) { return s.events >= 100; });
  EXPECT_EQ(seen.events, 100u);
  EXPECT_EQ(seen.by_cause_frames, 0);  // nothing was dropped: no report
  EXPECT_EQ(steptrace_dropped(), 0u);
  // Once the batch's Flush is acknowledged the daemon took them: the next connection's
  // Delivered frame says so (what a restarted daemon compares with what it kept).
  read_until(
      daemon, [](const Seen&) { return false; }, 300);  // acks every Flush
  daemon.close_connection();
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), proto::kProtocolVersion);
  EXPECT_EQ(daemon.delivered(), std::optional<std::uint64_t>(100));
  EXPECT_EQ(steptrace_dropped(), 0u);
}

// Auto-connect: the first event starts the flusher with no connection; it keeps trying
// with its backoff and reaches a daemon that starts listening later. Nothing is lost.
TEST(Flusher, AutoConnectReachesADaemonThatAppearsLater) {
  steptrace::testing::TempDir dir;
  const std::string path = dir.file("late.sock");
  ASSERT_EQ(::setenv("STEPTRACE_SOCKET", path.c_str(), 1), 0);
  const auto t0 = Clock::now();
  spans(STEPTRACE_FORWARD, 50);  // no steptrace_connect anywhere
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(500));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // attempts fail meanwhile
  FakeDaemon daemon(path);
  ASSERT_TRUE(daemon.accept_connection(3000));  // the backoff is at most 1 s
  ASSERT_EQ(daemon.handshake(), proto::kProtocolVersion);
  const Seen seen = read_until(daemon, [](const Seen& s) { return s.events >= 100; });
  EXPECT_EQ(seen.events, 100u);
  EXPECT_EQ(steptrace_dropped(), 0u);
}

// A steptrace_connect after an auto-connect, to another path, switches to it.
TEST(Flusher, ExplicitConnectAfterAutoConnectSwitches) {
  FakeDaemon first;
  FakeDaemon second;
  ASSERT_EQ(::setenv("STEPTRACE_SOCKET", first.path().c_str(), 1), 0);
  spans(STEPTRACE_FORWARD, 10);
  ASSERT_TRUE(first.accept_connection(3000));
  ASSERT_EQ(first.handshake(), proto::kProtocolVersion);
  EXPECT_EQ(read_until(first, [](const Seen& s) { return s.events >= 20; }).events, 20u);
  ASSERT_EQ(steptrace_connect(second.path().c_str()), 0);
  ASSERT_TRUE(second.accept_connection(3000));
  ASSERT_EQ(second.handshake(), proto::kProtocolVersion);
  spans(STEPTRACE_BACKWARD, 5);
  EXPECT_EQ(read_until(second, [](const Seen& s) { return s.events >= 10; }).events, 10u);
  EXPECT_EQ(steptrace_dropped(), 0u);
}

// An old daemon: refuses one hello per version in `versions` (the order the client
// must try them) with unsupported_version and closes each connection.
void refuse_hellos(FakeDaemon& daemon, std::initializer_list<std::uint16_t> versions) {
  for (const std::uint16_t refused : versions) {
    ASSERT_TRUE(daemon.accept_connection(5000));
    const auto hello = daemon.next();
    ASSERT_TRUE(hello && std::holds_alternative<proto::Hello>(*hello));
    EXPECT_EQ(std::get<proto::Hello>(*hello).version, refused);
    daemon.send_error(proto::ErrorCode::kUnsupportedVersion, "unsupported protocol version");
    daemon.close_connection();
  }
}

TEST(Flusher, VersionOneDaemonGetsVersionOneAfterEachNewerVersionIsRefusedAndLosesNothing) {
  FakeDaemon daemon;
  steptrace_start(4000);  // unknown step: one invalid drop
  spans(STEPTRACE_MATMUL, 100);
  ASSERT_EQ(steptrace_connect(daemon.path().c_str()), 0);
  // A version-1 daemon refuses the version-8 hello and closes, then versions 7 .. 2.
  ASSERT_NO_FATAL_FAILURE(refuse_hellos(daemon, {8, 7, 6, 5, 4, 3, 2}));
  // The next connection speaks version 1 (and the daemon decodes it as version 1: a
  // DroppedByCause frame would be a decode error).
  ASSERT_TRUE(daemon.accept_connection(5000));
  EXPECT_EQ(daemon.handshake(), 1u);
  EXPECT_EQ(daemon.version(), 1u);
  const Seen seen =
      read_until(daemon, [](const Seen& s) { return s.events >= 200 && s.dropped_frames > 0; });
  EXPECT_FALSE(daemon.error()) << daemon.error().message();
  EXPECT_EQ(seen.events, 200u);  // nothing went to the refused connection
  EXPECT_EQ(seen.dropped_frames, 1);
  EXPECT_EQ(seen.last_total, 1u);
  EXPECT_EQ(seen.by_cause_frames, 0);
  EXPECT_EQ(by_cause(STEPTRACE_DROP_INVALID), 1u);
  EXPECT_EQ(by_cause(STEPTRACE_DROP_IN_FLIGHT), 0u);
  EXPECT_EQ(steptrace_dropped(), 1u);
  // And it stays at version 1 after a later reconnect.
  daemon.close_connection();
  ASSERT_TRUE(daemon.accept_connection(5000));
  EXPECT_EQ(daemon.handshake(), 1u);
}

// The RingAttach frames of the next `ms` (answering flushes): the thread ids they name.
std::vector<std::uint32_t> ring_attaches(FakeDaemon& daemon, int ms) {
  std::vector<std::uint32_t> threads;
  const auto deadline = Clock::now() + std::chrono::milliseconds(ms);
  while (Clock::now() < deadline) {
    const auto m = daemon.next(50);
    if (!m) {
      if (daemon.error()) break;
      continue;
    }
    if (const auto* attach = std::get_if<proto::RingAttach>(&*m)) {
      threads.push_back(attach->thread_id);
    } else if (const auto* f = std::get_if<proto::FlushRequest>(&*m)) {
      daemon.send_ack(f->sequence);
    }
  }
  return threads;
}

// Spare rings (version 8) never reach an older daemon, which would take a spare's thread
// 0 at its word and refuse every record of the thread that takes it: after a version-8
// connection made and offered its spares, the version-7 connection that follows offers
// no ring of thread 0, and a new thread's ring goes with its own id.
TEST(Flusher, SparesOfAVersionEightConnectionAreNotOfferedToAnOlderDaemon) {
  if (ran_with_shm_rings()) return;
  FakeDaemon daemon;
  ASSERT_EQ(steptrace_connect(daemon.path().c_str()), 0);
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), proto::kSpareRingProtocolVersion);
  const std::vector<std::uint32_t> v8 = ring_attaches(daemon, 1000);
  EXPECT_EQ(std::count(v8.begin(), v8.end(), 0u), 2) << "the premise: two spares offered";
  daemon.close_connection();
  ASSERT_NO_FATAL_FAILURE(refuse_hellos(daemon, {8}));
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), 7u);
  std::uint32_t tid = 0;
  std::thread([&tid] {
    tid = static_cast<std::uint32_t>(::gettid());
    spans(STEPTRACE_MATMUL, 10);
  }).join();
  const std::vector<std::uint32_t> v7 = ring_attaches(daemon, 1000);
  EXPECT_EQ(std::count(v7.begin(), v7.end(), 0u), 0) << "a spare offered to a version-7 daemon";
  EXPECT_EQ(std::count(v7.begin(), v7.end(), tid), 1) << "the new thread's ring";
  steptrace_shutdown();
}

// What a daemon consumes from a ring between the moment the library sent the ring's
// RingAttach and the moment its sendmsg returned is delivered too: the next connection's
// Delivered frame counts it (a restarted daemon that lost it counts it as daemon_crash;
// left out, it was lost uncounted).
TEST(Flusher, RecordsADaemonTookWhileTheOfferWasBeingSentAreDelivered) {
  if (ran_with_shm_rings()) return;
  spans(STEPTRACE_FORWARD, 50);  // in this thread's ring, before any connection
  // The clock conversion is ready (kMinBaselineNs after load): the ring is offered, not
  // drained by the flusher, once the hello is acknowledged.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  FakeDaemon daemon;
  g_consume_in_sendmsg = true;
  ASSERT_EQ(steptrace_connect(daemon.path().c_str()), 0);
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), proto::kProtocolVersion);
  EXPECT_EQ(daemon.delivered(), std::optional<std::uint64_t>(0));
  const std::vector<std::uint32_t> attached = ring_attaches(daemon, 500);
  g_consume_in_sendmsg = false;
  EXPECT_EQ(std::count(attached.begin(), attached.end(), static_cast<std::uint32_t>(::gettid())), 1)
      << "the premise: this thread's ring was offered";
  EXPECT_EQ(g_consumed_in_sendmsg.load(), 100u)
      << "the premise: the 100 events were taken from the ring inside sendmsg";
  daemon.close_connection();
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), proto::kProtocolVersion);
  EXPECT_EQ(daemon.delivered(), std::optional<std::uint64_t>(100));
  EXPECT_EQ(steptrace_dropped(), 0u);
  steptrace_shutdown();
}

// The capacities (records) of the spares (RingAttach of thread 0) offered until `n` came
// or 10 s passed, answering flushes meanwhile.
std::vector<std::uint64_t> spares_offered(FakeDaemon& daemon, std::size_t n) {
  std::vector<std::uint64_t> capacities;
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (capacities.size() < n && Clock::now() < deadline) {
    const auto m = daemon.next(50);
    if (!m) {
      if (daemon.error()) break;
      continue;
    }
    if (const auto* attach = std::get_if<proto::RingAttach>(&*m)) {
      if (attach->thread_id == 0) capacities.push_back(attach->capacity);
    } else if (const auto* f = std::get_if<proto::FlushRequest>(&*m)) {
      daemon.send_ack(f->sequence);
    }
  }
  return capacities;
}

// The flusher makes spares only when something they depend on changed since it last
// looked, and must miss no such change: a thread that takes a spare is followed by one
// new spare offered, a new per-thread size (steptrace_set_buffer_size) by two of that size.
TEST(Flusher, ANewSpareFollowsATakenOneAndTwoFollowANewPerThreadSize) {
  if (ran_with_shm_rings()) return;
  FakeDaemon daemon;
  ASSERT_EQ(steptrace_connect(daemon.path().c_str()), 0);
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), proto::kSpareRingProtocolVersion);
  constexpr std::uint64_t kRecords = kDefaultRingBytes / kRingRecordBytes;
  EXPECT_EQ(spares_offered(daemon, 2), std::vector<std::uint64_t>(2, kRecords))
      << "the premise: two spares offered";
  std::thread([] { spans(STEPTRACE_MATMUL, 10); }).join();  // takes one
  EXPECT_EQ(spares_offered(daemon, 1), std::vector<std::uint64_t>(1, kRecords))
      << "no spare made after a thread took one";
  ASSERT_EQ(steptrace_set_buffer_size(kDefaultRingBytes / 2, 0), 0);
  EXPECT_EQ(spares_offered(daemon, 2), std::vector<std::uint64_t>(2, kRecords / 2))
      << "no spares of the new per-thread size";
  steptrace_shutdown();
}

// Unclaimed spares of the per-thread size (what a new thread could take now).
std::size_t spares_kept() {
  RingRegistry& registry = Client::get().state().registry;
  std::lock_guard lock(registry.mu);
  return registry.spares_locked();
}

bool spares_kept_reach(std::size_t n) {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (spares_kept() != n && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return spares_kept() == n;
}

// A spare also follows ring bytes coming back to the budget: with room for two rings, a
// thread takes one of the two spares (no room for another); once it exited and its ring
// was freed, the second spare is made again. Against the real daemon, which maps the
// spares and drains the thread's ring before it answers the thread's flush, so that the
// ring is empty, and freed, when the thread exits.
TEST(Flusher, ASpareFollowsRingBytesComingBackToTheBudget) {
  if (ran_with_shm_rings()) return;
  const steptrace::testing::TempDir dir;
  steptrace::testing::DaemonProcess daemon(dir.file("d.sock"));
  ASSERT_TRUE(daemon.start()) << daemon.log();
  ASSERT_EQ(steptrace_set_buffer_size(kMinRingBytes, 2 * kMinRingBytes), 0);
  ASSERT_EQ(steptrace_connect(daemon.socket().c_str()), 0);
  ASSERT_TRUE(spares_kept_reach(2)) << "the premise: two spares";
  std::size_t while_it_ran = SIZE_MAX;
  std::thread([&while_it_ran] {
    spans(STEPTRACE_MATMUL, 10);
    EXPECT_EQ(steptrace_flush(10000), 0);
    while_it_ran = spares_kept();
  }).join();
  EXPECT_EQ(while_it_ran, 1u) << "the premise: no room for a third ring";
  EXPECT_TRUE(spares_kept_reach(2)) << "no spare made once the thread's ring was freed";
  steptrace_shutdown();
}

TEST(Flusher, LeasesGoWithTheirLeaseToAVersionThreeDaemon) {
  FakeDaemon daemon;
  ASSERT_EQ(steptrace_connect(daemon.path().c_str()), 0);
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), proto::kProtocolVersion);  // 5: leases came with 3
  steptrace_ledger_reserve_lease("GPU-a", 7, 1 << 20, "job", 1500);
  steptrace_ledger_renew("GPU-a", 7, 2500);
  steptrace_ledger_reserve_lease("GPU-a", 8, 1 << 20, "job", 0);  // no lease: refused here
  steptrace_ledger_renew("GPU-a", 7, 604'800'001);                // past 7 days: refused
  ASSERT_EQ(by_cause(STEPTRACE_DROP_INVALID), 2u);
  const Seen seen = read_until(daemon, [](const Seen& s) { return s.ledger.size() >= 2; });
  ASSERT_EQ(seen.ledger.size(), 2u);
  EXPECT_EQ(seen.ledger[0].op, static_cast<std::uint8_t>(proto::LedgerOp::kReserveLease));
  EXPECT_EQ(seen.ledger[0].reservation_id, 7u);
  EXPECT_EQ(seen.ledger[0].bytes, 1u << 20);
  EXPECT_EQ(seen.ledger[0].total_bytes, 1500u);  // the lease's field
  EXPECT_EQ(seen.ledger[1].op, static_cast<std::uint8_t>(proto::LedgerOp::kRenew));
  EXPECT_EQ(seen.ledger[1].total_bytes, 2500u);
}

TEST(Flusher, AVersionTwoDaemonGetsLeasedReservationsWithoutTheLeaseAndNoRenewals) {
  FakeDaemon daemon;
  ASSERT_EQ(steptrace_connect(daemon.path().c_str()), 0);
  ASSERT_NO_FATAL_FAILURE(refuse_hellos(daemon, {8, 7, 6, 5, 4, 3}));
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), 2u);
  steptrace_ledger_reserve_lease("GPU-a", 7, 1 << 20, "job", 1500);
  steptrace_ledger_renew("GPU-a", 7, 1500);
  steptrace_ledger_release("GPU-a", 7);
  // The decoder speaks version 2 here: an op 5 or 6 would be a decode error.
  const Seen seen = read_until(daemon, [](const Seen& s) { return s.ledger.size() >= 2; });
  EXPECT_FALSE(daemon.error()) << daemon.error().message();
  ASSERT_EQ(seen.ledger.size(), 2u);
  EXPECT_EQ(seen.ledger[0].op, static_cast<std::uint8_t>(proto::LedgerOp::kReserve));
  EXPECT_EQ(seen.ledger[0].total_bytes, 0u);
  EXPECT_EQ(seen.ledger[1].op, static_cast<std::uint8_t>(proto::LedgerOp::kRelease));
  EXPECT_EQ(by_cause(STEPTRACE_DROP_INVALID), 1u);  // the renewal
}

TEST(Flusher, DropCountsAreReportedPerCauseWhenTheyChangeAndAfterEachReconnect) {
  FakeDaemon daemon;
  steptrace_start(4000);
  steptrace_end(5000);  // two invalid drops before any connection
  ASSERT_EQ(steptrace_connect(daemon.path().c_str()), 0);
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), proto::kProtocolVersion);
  Seen seen = read_until(daemon, [](const Seen& s) { return s.by_cause_frames > 0; });
  ASSERT_EQ(seen.by_cause_frames, 1);
  const auto& counts = seen.last_by_cause.count;
  EXPECT_EQ(counts[3], 2u);  // invalid
  EXPECT_EQ(counts[0] + counts[1] + counts[2], 0u);
  // Unchanged: not sent again.
  EXPECT_TRUE(daemon.quiet_for(50));
  steptrace_ledger_release(nullptr, 1);  // a third invalid drop
  seen = read_until(daemon, [](const Seen& s) { return s.by_cause_frames > 0; });
  ASSERT_EQ(seen.by_cause_frames, 1);
  EXPECT_EQ(seen.last_by_cause.count[3], 3u);
  // Reconnected: sent once more although unchanged.
  daemon.close_connection();
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), proto::kProtocolVersion);
  seen = read_until(daemon, [](const Seen& s) { return s.by_cause_frames > 0; });
  ASSERT_EQ(seen.by_cause_frames, 1);
  EXPECT_EQ(seen.last_by_cause.count[3], 3u);
  EXPECT_EQ(steptrace_dropped(), 3u);
}

// What a daemon applies of numbered batches (protocol version 7), as the collector does:
// each frame past the last applied position once, whichever connection brings it.
struct BatchCursor {
  std::uint64_t sequence = 0;
  std::uint32_t next = 0;
  std::uint64_t applied_events = 0;
  std::uint64_t skipped_frames = 0;
  std::uint64_t first_sequence = 0;  // of the first Batch frame seen on a connection
  std::uint64_t batches = 0;         // Batch frames seen
};

// Reads a connection as the daemon would, acknowledging every Flush when `ack`, until
// `until(cursor)`, a quiet `timeout_ms`, or (not acknowledging) `stop_after_events` seen.
template <class Until>
void read_batches(FakeDaemon& daemon, BatchCursor& cursor, bool ack, Until until,
                  int timeout_ms = 10000) {
  cursor.first_sequence = 0;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  std::uint64_t sequence = 0;
  std::uint32_t index = 0;
  std::uint32_t left = 0;
  while (!until(cursor) && Clock::now() < deadline) {
    const auto m = daemon.next(100);
    if (!m) {
      if (daemon.error()) break;
      continue;
    }
    if (const auto* b = std::get_if<proto::Batch>(&*m)) {
      ++cursor.batches;
      if (cursor.first_sequence == 0) cursor.first_sequence = b->sequence;
      sequence = b->sequence;
      index = 0;
      left = b->frames;
      continue;
    }
    bool apply = true;
    if (left > 0) {
      apply = sequence > cursor.sequence || (sequence == cursor.sequence && index >= cursor.next);
      if (apply) {
        cursor.sequence = sequence;
        cursor.next = index + 1;
      } else {
        ++cursor.skipped_frames;
      }
      ++index;
      --left;
    }
    if (const auto* events = std::get_if<proto::EventSpan>(&*m)) {
      if (apply) cursor.applied_events += events->size();
    } else if (const auto* f = std::get_if<proto::FlushRequest>(&*m)) {
      if (ack) daemon.send_ack(f->sequence);
    }
  }
}

// Protocol version 7: the batches a daemon did not acknowledge before the connection broke
// (partly written, written and unread, read and unacknowledged) go again on the next
// connection, oldest first, keeping their numbers; applied once each, they add up to
// what was recorded, and nothing counts as in_flight.
TEST(Flusher, BatchesNotAcknowledgedGoAgainOnTheNextConnection) {
  FakeDaemon daemon;
  ASSERT_EQ(steptrace_connect(daemon.path().c_str()), 0);
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), proto::kProtocolVersion);
  // A daemon that reads (applies) some batches and acknowledges none, then dies: far
  // more than the socket buffer is recorded, so a batch is left partly written too.
  spans(STEPTRACE_FORWARD, 120'000);
  BatchCursor cursor;
  read_batches(daemon, cursor, false,
               [](const BatchCursor& c) { return c.applied_events >= 50'000; });
  ASSERT_GE(cursor.applied_events, 50'000u);
  const std::uint64_t first = cursor.first_sequence;
  EXPECT_NE(first, 0u);
  daemon.close_connection();
  // The next daemon (the cursor kept, as a snapshot keeps it) gets them all again.
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), proto::kProtocolVersion);
  read_batches(daemon, cursor, true,
               [](const BatchCursor& c) { return c.applied_events >= 240'000; });
  EXPECT_EQ(cursor.first_sequence, first) << "the oldest unacknowledged batch goes first";
  EXPECT_GT(cursor.skipped_frames, 0u) << "what the first daemon applied came again";
  // Nothing more comes, and nothing twice.
  read_batches(
      daemon, cursor, true, [](const BatchCursor&) { return false; }, 300);
  EXPECT_EQ(cursor.applied_events, 240'000u);
  EXPECT_EQ(steptrace_dropped(), 0u);
  EXPECT_EQ(by_cause(STEPTRACE_DROP_IN_FLIGHT), 0u);
  steptrace_shutdown();
}

// A connection lost in the middle of a resend: what it did not acknowledge goes again
// before the batches that were still waiting, so no batch comes after a later one (a
// daemon would skip it as applied).
TEST(Flusher, AResendCutShortGoesAgainInOrder) {
  FakeDaemon daemon;
  ASSERT_EQ(steptrace_connect(daemon.path().c_str()), 0);
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), proto::kProtocolVersion);
  spans(STEPTRACE_FORWARD, 120'000);
  BatchCursor cursor;
  read_batches(daemon, cursor, false,
               [](const BatchCursor& c) { return c.applied_events >= 60'000; });
  daemon.close_connection();
  // The next daemon applies a little of the resend (none acknowledged), and goes too.
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), proto::kProtocolVersion);
  read_batches(daemon, cursor, false,
               [](const BatchCursor& c) { return c.applied_events >= 100'000; });
  ASSERT_GE(cursor.applied_events, 100'000u);
  daemon.close_connection();
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), proto::kProtocolVersion);
  read_batches(daemon, cursor, true,
               [](const BatchCursor& c) { return c.applied_events >= 240'000; });
  read_batches(
      daemon, cursor, true, [](const BatchCursor&) { return false; }, 300);
  EXPECT_EQ(cursor.applied_events, 240'000u);
  EXPECT_EQ(steptrace_dropped(), 0u);
  steptrace_shutdown();
}

// A daemon that refuses the stream with an Error (say it could not apply the batch's first
// frame) gets nothing again: what it did not acknowledge counts as in_flight.
TEST(Flusher, BatchesRefusedWithAnErrorCountAsInFlight) {
  FakeDaemon daemon;
  ASSERT_EQ(steptrace_connect(daemon.path().c_str()), 0);
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), proto::kProtocolVersion);
  spans(STEPTRACE_FORWARD, 1000);
  BatchCursor cursor;
  read_batches(daemon, cursor, false,
               [](const BatchCursor& c) { return c.applied_events >= 2000; });
  ASSERT_EQ(cursor.applied_events, 2000u);
  daemon.send_error(proto::ErrorCode::kProtocol, "limit_reached: too many processes");
  daemon.close_connection();
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (by_cause(STEPTRACE_DROP_IN_FLIGHT) < 2000 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(by_cause(STEPTRACE_DROP_IN_FLIGHT), 2000u);
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), proto::kProtocolVersion);
  BatchCursor again;
  read_batches(
      daemon, again, true, [](const BatchCursor&) { return false; }, 300);
  EXPECT_EQ(again.batches, 0u) << "a refused batch came again";
  steptrace_shutdown();
}

// Version 6 and earlier: events in a batch the connection could not take when it broke
// count as in_flight (nothing is numbered, so nothing can go again).
TEST(Flusher, EventsInABrokenConnectionsUnsentFramesCountAsInFlightBeforeVersionSeven) {
  FakeDaemon daemon;
  ASSERT_EQ(steptrace_connect(daemon.path().c_str()), 0);
  ASSERT_NO_FATAL_FAILURE(refuse_hellos(daemon, {8, 7}));
  ASSERT_TRUE(daemon.accept_connection(5000));
  ASSERT_EQ(daemon.handshake(), 6u);
  // The daemon stops reading: far more than the socket buffer is recorded (the ring
  // holds 262,144 events), so the flusher is left with a partly written batch.
  spans(STEPTRACE_FORWARD, 120'000);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  daemon.close_connection();
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (by_cause(STEPTRACE_DROP_IN_FLIGHT) == 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_GT(by_cause(STEPTRACE_DROP_IN_FLIGHT), 0u);
  EXPECT_EQ(by_cause(STEPTRACE_DROP_BUFFER_FULL), 0u);
  EXPECT_EQ(steptrace_dropped(),
            by_cause(STEPTRACE_DROP_IN_FLIGHT) + by_cause(STEPTRACE_DROP_NOT_CONNECTED));
  steptrace_shutdown();
}

// At exit, after the final bounded flush: what is still buffered counts as in_flight
// when a daemon was connected (the flush timed out) ...
TEST(Flusher, AtExitEventsLeftWhileConnectedCountAsInFlight) {
  FakeDaemon daemon;  // never accepts: the connection waits in the listen backlog
  ASSERT_EQ(steptrace_connect(daemon.path().c_str()), 0);
  spans(STEPTRACE_FORWARD, 100);
  steptrace_ledger_reserve("GPU-0", 1, 1, "t");
  const auto t0 = Clock::now();
  Client::get().at_exit();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3));  // bounded (500 ms)
  EXPECT_EQ(by_cause(STEPTRACE_DROP_IN_FLIGHT), 201u);
  EXPECT_EQ(steptrace_dropped(), 201u);
  spans(STEPTRACE_FORWARD, 1);  // after exit: not connected
  EXPECT_EQ(by_cause(STEPTRACE_DROP_NOT_CONNECTED), 2u);
  EXPECT_EQ(steptrace_dropped(), 203u);
}

// ... and as not_connected when none was.
TEST(Flusher, AtExitEventsLeftUnconnectedCountAsNotConnected) {
  spans(STEPTRACE_FORWARD, 100);
  steptrace_start(4000);  // invalid stays invalid
  EXPECT_EQ(steptrace_dropped(), 1u);
  Client::get().at_exit();
  EXPECT_EQ(by_cause(STEPTRACE_DROP_NOT_CONNECTED), 200u);
  EXPECT_EQ(by_cause(STEPTRACE_DROP_INVALID), 1u);
  EXPECT_EQ(steptrace_dropped(), 201u);
}

}  // namespace
}  // namespace steptrace::client

// The library's sendmsg calls in this binary (-Wl,--wrap=sendmsg).
extern "C" ssize_t __real_sendmsg(int fd, const msghdr* msg, int flags);   // NOLINT
extern "C" ssize_t __wrap_sendmsg(int fd, const msghdr* msg, int flags) {  // NOLINT
  const ssize_t n = __real_sendmsg(fd, msg, flags);
  if (n > 0 && steptrace::client::g_consume_in_sendmsg.load()) {
    steptrace::client::consume_offered_ring(msg);
  }
  return n;
}
