// Shared-memory rings (protocol version 5) against a hostile local tenant: the test
// itself is the hostile producer. It speaks the wire protocol with raw sockets and the
// shared codec, crafts the descriptors it passes (SCM_RIGHTS) and the rings behind them
// (memfd_create, ftruncate, F_ADD_SEALS, mmap), and lies in every way it can, against the
// real steptraced. Each case asserts the daemon's answer (RingAck, or the connection
// closed with bad_ring), that it still answers `ping`, its counters in `stats --json`
// (shared_rings, protocol_errors.by_kind, limits_hit), the descriptors and mappings it
// holds (/proc/PID/fd, /proc/PID/maps), and that a well-behaved client alongside (the
// real steptrace_test_trainer, libsteptrace with its own shm rings) keeps exact counts:
//   - a descriptor that is not a sealed memfd of exactly the stated size (a pipe, a
//     socket, a file, an unsealed memfd, one page short or over, a huge one, F_SEAL_WRITE,
//     a read-only or O_PATH one), or whose header contradicts the frame, is refused
//     kRefusedFd and closed at once;
//   - a RingAttach without a descriptor is refused and the connection stays; a third
//     descriptor waiting for a frame, more than two in one message (MSG_CTRUNC), a bad
//     capacity or clock scale fail that connection only (bad_ring); descriptors on text
//     commands are closed; a flood of all of it leaks no descriptor in the daemon and
//     leaves its reserve of waiting descriptors empty; a tenant holding that reserve
//     costs another client no event;
//   - a ring whose head lies (beyond tail + capacity, below tail, 2^63) is dropped, the
//     connection stays, nothing more is folded from it; positions wrapping past 2^64 are
//     fine; bad records are skipped and counted (records_refused, the process's
//     dropped_by_cause.refused) and the good records around them folded exactly;
//   - threads rewriting heads, tails, counters and slots at random while the daemon
//     drains (and a second connection mapping the same memfds) crash nothing, close no
//     connection, and cost the trainer recording alongside nothing;
//   - the ring budgets (max_rings_per_process, max_rings_per_uid,
//     max_ring_bytes_per_process, max_ring_bytes_per_uid, max_rings over all
//     connections, each mapped ring holding one descriptor) refuse kRefusedLimit, count
//     limits_hit, are given back when a connection closes, thousands of refused attempts
//     cost no descriptor or mapping, and one uid's full budget leaves another uid's rings
//     mapped (as uid 4242, root only);
//   - a ring sealed F_SEAL_SHRINK cannot be truncated (EPERM), and punched holes read as
//     zeros (refused records, or a head out of range), so no SIGBUS path exists; the
//     daemon reads slots with pread, so a head claiming a whole ring the producer never
//     wrote commits no memory in the daemon or the memfd.
// Run against the ASan build (build with STEPTRACE_SANITIZE) for the scribbling case's
// full value: TearDown fails on any sanitizer report in the daemon's log.
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "proto/codec.h"
#include "proto/shm_ring.h"
#include "tests/support/daemon_process.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

namespace steptrace::proto {
// gtest prints a RingStatus by name (found by argument-dependent lookup).
static void PrintTo(RingStatus status, std::ostream* os) {  // NOLINT(readability-identifier-naming)
  switch (status) {
    case RingStatus::kMapped:
      *os << "kMapped";
      return;
    case RingStatus::kRefusedLimit:
      *os << "kRefusedLimit";
      return;
    case RingStatus::kRefusedFd:
      *os << "kRefusedFd";
      return;
  }
  *os << "RingStatus(" << static_cast<std::uint32_t>(status) << ")";
}
}  // namespace steptrace::proto

namespace steptrace::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;
using proto::RingStatus;

constexpr int kTimeoutMs = 10000;
constexpr std::uint64_t kCapacity = proto::kMinShmRingRecords;          // 4096 records, 64 KiB
constexpr std::uint64_t kRingBytes = proto::shm_ring_bytes(kCapacity);  // the memfd's size
// What the budgets and shared_rings.bytes_mapped count: the slots (the header page is
// bounded by the ring-count limits).
constexpr std::uint64_t kSlotBytes = proto::shm_ring_slot_bytes(kCapacity);
constexpr std::uint16_t kForward = 0;  // proto/steps.h
// Named so the daemon's /proc/PID/maps shows which mappings are ours.
constexpr const char* kMemfdName = "hostile-ring";

// Polls `done` every 10 ms until it holds or `timeout_ms` passed.
template <class F>
bool eventually(F&& done, int timeout_ms = kTimeoutMs) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (Clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// A memfd of `size` bytes with `seals` added (0: none), not mapped.
UniqueFd make_memfd(std::uint64_t size, int seals,
                    unsigned flags = MFD_CLOEXEC | MFD_ALLOW_SEALING) {
  UniqueFd fd(::memfd_create(kMemfdName, flags));
  if (fd.get() < 0) return fd;
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) return UniqueFd();
  if (seals != 0 && ::fcntl(fd.get(), F_ADD_SEALS, seals) != 0) return UniqueFd();
  return fd;
}

proto::EventRecord record(std::uint64_t ts, std::uint32_t tid, std::uint16_t step,
                          proto::EventKind kind) {
  return {ts, tid, step, static_cast<std::uint8_t>(kind), 0};
}

// `n` start/end pairs of `step` on thread `tid`, stamped from `ts` on (ticks are ns: the
// hostile client sends ClockSync{} with scale 0).
std::vector<proto::EventRecord> pairs(std::uint32_t tid, std::uint16_t step, int n,
                                      std::uint64_t& ts) {
  std::vector<proto::EventRecord> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(record(ts += 1000, tid, step, proto::EventKind::kStart));
    out.push_back(record(ts += 1000, tid, step, proto::EventKind::kEnd));
  }
  return out;
}

// A ring the way the library makes one (proto/shm_ring.h), but the test holds the pen:
// a sealed memfd of exactly shm_ring_bytes(capacity), mapped shared here too.
class CraftedRing {
 public:
  explicit CraftedRing(std::uint32_t thread_id, std::uint64_t capacity = kCapacity,
                       int seals = F_SEAL_SHRINK | F_SEAL_GROW)
      : thread_id_(thread_id), capacity_(capacity), bytes_(proto::shm_ring_bytes(capacity)) {
    fd_ = make_memfd(bytes_, seals);
    if (fd_.get() < 0) return;
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_.get(), 0);
    if (p == MAP_FAILED) return;
    base_ = static_cast<std::byte*>(p);
    header().magic = proto::kRingMagic;
    header().layout_version = proto::kRingLayoutVersion;
    header().thread_id = thread_id;
    header().capacity = capacity;
  }
  ~CraftedRing() {
    if (base_ != nullptr) ::munmap(base_, bytes_);
  }
  CraftedRing(const CraftedRing&) = delete;
  CraftedRing& operator=(const CraftedRing&) = delete;

  bool ok() const { return base_ != nullptr; }
  int fd() const { return fd_.get(); }
  std::uint32_t thread_id() const { return thread_id_; }
  std::uint64_t capacity() const { return capacity_; }
  std::uint64_t bytes() const { return bytes_; }
  proto::RingHeader& header() { return *reinterpret_cast<proto::RingHeader*>(base_); }

  std::uint64_t head() { return proto::ring_field(header().head).load(std::memory_order_acquire); }
  std::uint64_t tail() { return proto::ring_field(header().tail).load(std::memory_order_acquire); }
  void set_head(std::uint64_t head) {
    proto::ring_field(header().head).store(head, std::memory_order_release);
  }
  void set_tail(std::uint64_t tail) {
    proto::ring_field(header().tail).store(tail, std::memory_order_release);
  }
  // Slot `index` (any position: masked).
  void write_slot(std::uint64_t index, const proto::EventRecord& r) {
    std::memcpy(base_ + proto::kRingHeaderBytes + (index & (capacity_ - 1)) * sizeof r, &r,
                sizeof r);
  }
  void write_bytes(std::uint64_t slot, const void* data, std::size_t n) {
    std::memcpy(base_ + proto::kRingHeaderBytes + (slot & (capacity_ - 1)) * 16, data, n);
  }
  // Writes `records` after the head, then publishes them (release store of the head).
  void publish(std::span<const proto::EventRecord> records) {
    const std::uint64_t head = this->head();
    for (std::size_t i = 0; i < records.size(); ++i) write_slot(head + i, records[i]);
    set_head(head + records.size());
  }

 private:
  std::uint32_t thread_id_;
  std::uint64_t capacity_;
  std::uint64_t bytes_;
  UniqueFd fd_;
  std::byte* base_ = nullptr;
};

// A hostile client: raw socket, proto::Encoder out, proto::Decoder(kClient) in.
class RawClient {
 public:
  struct Answer {
    enum Kind { kFlushAck, kRingAck, kError, kClosed, kTimeout, kBad } kind = kTimeout;
    std::uint64_t sequence = 0;
    proto::RingAck ring{};
    std::string error;
    static Answer of(Kind kind) {
      Answer a;
      a.kind = kind;
      return a;
    }
  };

  explicit RawClient(const std::string& socket) {
    fd_ = UniqueFd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, socket.c_str(), socket.size() + 1);
    if (::connect(fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      fd_.reset();
      return;
    }
    // A daemon that stops reading must fail the test, not hang it.
    const timeval timeout{kTimeoutMs / 1000, 0};
    ::setsockopt(fd_.get(), SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  }

  bool connected() const { return fd_.get() >= 0; }
  int native() const { return fd_.get(); }
  void close() { fd_.reset(); }

  // Sends `bytes` with one sendmsg, the descriptors `fds` riding on its first byte.
  bool send(std::span<const std::byte> bytes, std::span<const int> fds = {}) {
    if (!connected()) return false;
    iovec iov{const_cast<std::byte*>(bytes.data()), bytes.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    std::vector<std::uint64_t> control;  // 8-byte aligned, as a cmsghdr needs
    if (!fds.empty()) {
      const std::size_t space = CMSG_SPACE(fds.size() * sizeof(int));
      control.resize((space + 7) / 8);
      msg.msg_control = control.data();
      msg.msg_controllen = space;
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
      std::memcpy(CMSG_DATA(c), fds.data(), fds.size() * sizeof(int));
    }
    ssize_t n;
    do {
      n = ::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n < 0) return false;
    std::size_t sent = static_cast<std::size_t>(n);
    while (sent < bytes.size()) {  // the rest as plain bytes
      const ssize_t w = ::send(fd_.get(), bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return false;
      sent += static_cast<std::size_t>(w);
    }
    return true;
  }
  bool send_fd(std::span<const std::byte> bytes, int fd) { return send(bytes, std::span(&fd, 1)); }

  // Frames made by `make(encoder)`.
  template <class F>
  static std::vector<std::byte> frames(F&& make) {
    std::vector<std::byte> buf(64 * 1024);
    proto::Encoder encoder(buf);
    make(encoder);
    buf.resize(encoder.size());
    return buf;
  }

  // Hello (version `version`), ClockSync{} (scale 0: ticks are ns), Flush; true once
  // its FlushAck is back.
  bool handshake(std::uint16_t version = proto::kProtocolVersion) {
    const auto bytes = frames([&](proto::Encoder& e) {
      e.hello("hostile-0.0", "hostile", version);
      if (version >= proto::kShmProtocolVersion) e.clock_sync(proto::ClockSync{});
    });
    return send(bytes) && flush();
  }

  // The same with a Delivered frame after the hello, as libsteptrace sends it: the
  // process's events that daemons took before this connection.
  bool handshake_delivered(std::uint64_t delivered) {
    const auto bytes = frames([&](proto::Encoder& e) {
      e.hello("hostile-0.0", "hostile", proto::kProtocolVersion);
      e.delivered(delivered);
      e.clock_sync(proto::ClockSync{});
    });
    return send(bytes) && flush();
  }

  // A Flush (the daemon folds every ring of the connection before it answers); true
  // once its FlushAck is back. `fd`: a descriptor passed along on the frame.
  bool flush(int fd = -1) {
    const std::uint64_t sequence = ++sequence_;
    const auto bytes = frames([&](proto::Encoder& e) { e.flush(sequence); });
    if (!(fd >= 0 ? send_fd(bytes, fd) : send(bytes))) return false;
    const Answer a = next();
    return a.kind == Answer::kFlushAck && a.sequence == sequence;
  }

  // A RingAttach frame (with `fds` on it); the RingAck's status, nullopt when none came.
  std::optional<RingStatus> attach(std::uint32_t ring_id, std::uint32_t thread_id,
                                   std::uint64_t capacity, std::span<const int> fds) {
    const auto bytes =
        frames([&](proto::Encoder& e) { e.ring_attach(ring_id, thread_id, capacity); });
    if (!send(bytes, fds)) return std::nullopt;
    const Answer a = next();
    if (a.kind != Answer::kRingAck || a.ring.ring_id != ring_id) return std::nullopt;
    return static_cast<RingStatus>(a.ring.status);
  }
  std::optional<RingStatus> attach(std::uint32_t ring_id, std::uint32_t thread_id,
                                   std::uint64_t capacity, int fd) {
    return fd >= 0 ? attach(ring_id, thread_id, capacity, std::span(&fd, 1))
                   : attach(ring_id, thread_id, capacity, std::span<const int>{});
  }
  std::optional<RingStatus> attach(std::uint32_t ring_id, const CraftedRing& ring) {
    return attach(ring_id, ring.thread_id(), ring.capacity(), ring.fd());
  }

  // The next daemon frame, or the end of the connection.
  Answer next(int timeout_ms = kTimeoutMs) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      auto r = decoder_.next();
      if (r.error) return Answer::of(Answer::kBad);
      if (r.message) {
        Answer a;
        if (const auto* ack = std::get_if<proto::FlushAck>(&*r.message)) {
          a.kind = Answer::kFlushAck;
          a.sequence = ack->sequence;
        } else if (const auto* ring = std::get_if<proto::RingAck>(&*r.message)) {
          a.kind = Answer::kRingAck;
          a.ring = *ring;
        } else if (const auto* error = std::get_if<proto::ErrorReport>(&*r.message)) {
          a.kind = Answer::kError;
          a.error = std::string(proto::field_view(error->message));
        } else {
          a.kind = Answer::kBad;
        }
        return a;
      }
      if (eof_ || !connected()) return Answer::of(Answer::kClosed);
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return Answer::of(Answer::kTimeout);
      pollfd p{fd_.get(), POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      auto space = decoder_.prepare(4096);
      const ssize_t n = ::recv(fd_.get(), space.data(), space.size(), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        eof_ = true;  // EOF, or ECONNRESET: closed either way
        continue;
      }
      decoder_.commit(static_cast<std::size_t>(n));
    }
  }

  // Reads until the daemon closes the connection; the message of the Error frame it sent
  // first ("" without one), nullopt when it did not close within the timeout.
  std::optional<std::string> closed_by_daemon(int timeout_ms = kTimeoutMs) {
    std::string error;
    for (;;) {
      const Answer a = next(timeout_ms);
      if (a.kind == Answer::kError) error = a.error;
      if (a.kind == Answer::kClosed) return error;
      if (a.kind == Answer::kTimeout || a.kind == Answer::kBad) return std::nullopt;
    }
  }

 private:
  UniqueFd fd_;
  proto::Decoder decoder_{proto::Side::kClient};
  std::uint64_t sequence_ = 0;
  bool eof_ = false;
};

// `n` rings of threads first_thread, first_thread + 1, ...; check all_made() before use.
std::vector<std::unique_ptr<CraftedRing>> crafted_rings(std::uint32_t n,
                                                        std::uint32_t first_thread) {
  std::vector<std::unique_ptr<CraftedRing>> out;
  for (std::uint32_t i = 0; i < n; ++i)
    out.push_back(std::make_unique<CraftedRing>(first_thread + i));
  return out;
}
bool all_made(const std::vector<std::unique_ptr<CraftedRing>>& rings) {
  return std::all_of(rings.begin(), rings.end(), [](const auto& r) { return r->ok(); });
}

std::size_t open_fds(pid_t pid) {
  std::size_t n = 0;
  std::error_code ec;
  for (fs::directory_iterator it("/proc/" + std::to_string(pid) + "/fd", ec), end; !ec && it != end;
       it.increment(ec)) {
    ++n;
  }
  return n;
}

// The daemon's mappings of memfds this test made (kMemfdName).
std::size_t hostile_mappings(pid_t pid) {
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  const std::string needle = std::string("/memfd:") + kMemfdName;
  std::size_t n = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find(needle) != std::string::npos) ++n;
  }
  return n;
}

// The daemon's descriptors of memfds this test made: one per mapped ring (it reads the
// slots with pread).
std::size_t hostile_descriptors(pid_t pid) {
  const std::string needle = std::string("/memfd:") + kMemfdName;
  std::size_t n = 0;
  std::error_code ec;
  for (fs::directory_iterator it("/proc/" + std::to_string(pid) + "/fd", ec), end; !ec && it != end;
       it.increment(ec)) {
    const fs::path target = fs::read_symlink(it->path(), ec);
    if (!ec && target.string().find(needle) != std::string::npos) ++n;
  }
  return n;
}

// RssShmem of /proc/PID/status: the shared-memory pages resident in its mappings.
std::uint64_t rss_shmem_kib(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("RssShmem:", 0) == 0) return std::stoull(line.substr(9));
  }
  return 0;
}

std::uint64_t count_of(const json& object, const std::string& key) {
  return object.is_object() ? object.value(key, std::uint64_t{0}) : 0;
}

class HostileShmRingTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (!daemon_) return;
    EXPECT_TRUE(daemon_->running()) << "the daemon died\n" << daemon_->log();
    if (daemon_->running()) {
      EXPECT_EQ(daemon_->stop(), 0) << daemon_->log();
    }
    const std::string log = daemon_->log();
    EXPECT_EQ(log.find("Sanitizer"), std::string::npos) << log;
    EXPECT_EQ(log.find("runtime error"), std::string::npos) << log;
  }

  std::string socket() const { return dir_.file("d.sock"); }
  pid_t daemon_pid() const { return daemon_->pid(); }

  // Starts steptraced with `limits` (members of the config's "limits" object) and `top`
  // (more top-level members, each followed by a comma).
  void start(const std::string& limits = "", const std::string& top = "") {
    const std::string config = dir_.file("steptraced.json");
    std::ofstream(config) << "{" << top << "\"limits\": {" << limits << "}}\n";
    daemon_ =
        std::make_unique<DaemonProcess>(socket(), std::vector<std::string>{"--config", config});
    ASSERT_TRUE(daemon_->start()) << daemon_->log();
  }

  json stats() const {
    const auto text = command(socket(), "stats --json");
    EXPECT_TRUE(text.has_value()) << "no answer to stats";
    return json::parse(text.value_or("{}"), nullptr, false);
  }
  json rings() const { return stats()["shared_rings"]; }
  std::uint64_t protocol_errors(const std::string& kind) const {
    return count_of(stats()["protocol_errors"]["by_kind"], kind);
  }
  std::uint64_t limits_hit(const std::string& limit) const {
    return count_of(stats()["limits_hit"], limit);
  }
  // `report --json`'s entry of process `pid` (null when absent).
  json process(pid_t pid) const {
    const json report =
        json::parse(command(socket(), "report --json").value_or("{}"), nullptr, false);
    for (const auto& p : report.value("processes", json::array())) {
      if (p.value("pid", 0) == pid) return p;
    }
    return nullptr;
  }
  // How many spans of `step` the daemon holds for process `pid`.
  std::uint64_t spans(pid_t pid, const std::string& step) const {
    const json p = process(pid);
    if (!p.is_object()) return 0;
    for (const auto& s : p["steps"]) {
      if (s["step"] == step) return s["count"].get<std::uint64_t>();
    }
    return 0;
  }
  void expect_pong() const {
    EXPECT_EQ(command(socket(), "ping"), std::optional<std::string>("pong\n")) << daemon_->log();
  }
  // The daemon's descriptors once they stop changing (the connections of start()'s and
  // earlier commands' are closed).
  std::size_t settled_fds() const {
    std::size_t n = open_fds(daemon_pid());
    for (int i = 0; i < 100; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      const std::size_t again = open_fds(daemon_pid());
      if (again == n) break;
      n = again;
    }
    return n;
  }
  // The daemon's descriptors come back to `count` (a probe or a reply may hold one for
  // a moment: polled).
  void expect_fds(std::size_t count) const {
    EXPECT_TRUE(eventually([&] { return open_fds(daemon_pid()) == count; }))
        << "the daemon holds " << open_fds(daemon_pid()) << " descriptors, " << count << " before";
  }
  // Once every ring is unmapped: the counters and /proc/PID/maps agree.
  void expect_nothing_mapped() const {
    EXPECT_TRUE(eventually([&] {
      const json r = rings();
      return r["mapped"] == 0 && r["bytes_mapped"] == 0;
    })) << rings().dump();
    EXPECT_EQ(hostile_mappings(daemon_pid()), 0u);
  }

  // The well-behaved neighbour: steptrace_test_trainer `threads` (T threads x N Matmul
  // spans, flushed), libsteptrace with shared-memory rings.
  struct Trainer {
    pid_t pid = -1;
    std::string out;
    int threads = 0;
    int spans = 0;
  };
  Trainer start_trainer(int threads = 4, int spans = 2000) {
    Trainer t;
    t.out = dir_.file("trainer-" + std::to_string(++trainers_));
    t.threads = threads;
    t.spans = spans;
    t.pid = spawn_process({STEPTRACE_TEST_TRAINER, "threads", socket(), t.out,
                           std::to_string(threads), std::to_string(spans)},
                          {"STEPTRACE_QUIET=1"});
    return t;
  }
  // It exited 0 and the daemon holds exactly its spans: T x N Matmul and nothing else,
  // nothing dropped, unmatched or abandoned, by its count and by the daemon's.
  void expect_exact(const Trainer& t) const {
    SCOPED_TRACE("trainer pid " + std::to_string(t.pid));
    ASSERT_EQ(wait_or_kill(t.pid, 120000), 0) << daemon_->log();
    std::ifstream out(t.out);
    std::string key;
    long long value = 0;
    bool read_dropped = false;
    while (out >> key >> value) {
      if (key.rfind("dropped", 0) == 0) {
        EXPECT_EQ(value, 0) << key;
        read_dropped = true;
      }
    }
    EXPECT_TRUE(read_dropped) << "no drop counts in " << t.out;
    const json p = process(t.pid);
    ASSERT_TRUE(p.is_object()) << "the daemon does not know the trainer";
    const std::uint64_t expected = static_cast<std::uint64_t>(t.threads) * t.spans;
    std::uint64_t matmul = 0;
    for (const auto& s : p["steps"]) {
      if (s["step"] == "Matmul") {
        matmul = s["count"].get<std::uint64_t>();
      } else {
        ADD_FAILURE() << "a step the trainer never recorded: " << s.dump();
      }
    }
    EXPECT_EQ(matmul, expected) << p.dump();
    EXPECT_EQ(p["dropped"], 0) << p.dump();
    EXPECT_EQ(p["unmatched_ends"], 0) << p.dump();
    EXPECT_EQ(p["abandoned"], 0) << p.dump();
  }
  void run_trainer_exactly() { expect_exact(start_trainer()); }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  int trainers_ = 0;
};

// ---- 1. descriptors -----------------------------------------------------------------------

TEST_F(HostileShmRingTest, DescriptorsThatAreNotASealedMemfdOfTheStatedSizeAreRefusedAndClosed) {
  ASSERT_NO_FATAL_FAILURE(start());
  RawClient hostile(socket());
  ASSERT_TRUE(hostile.handshake());
  const std::size_t fds_before = settled_fds();

  struct Bad {
    std::string what;
    UniqueFd fd;
  };
  std::vector<Bad> bad;
  int ends[2];
  ASSERT_EQ(::pipe2(ends, O_CLOEXEC), 0);
  bad.push_back({"a pipe's read end", UniqueFd(ends[0])});
  bad.push_back({"a pipe's write end", UniqueFd(ends[1])});
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends), 0);
  bad.push_back({"a socket", UniqueFd(ends[0])});
  bad.push_back({"its peer", UniqueFd(ends[1])});
  bad.push_back({"an eventfd", UniqueFd(::eventfd(0, EFD_CLOEXEC))});
  bad.push_back({"/dev/zero", UniqueFd(::open("/dev/zero", O_RDWR | O_CLOEXEC))});
  bad.push_back({"a directory", UniqueFd(::open(dir_.path().c_str(), O_RDONLY | O_DIRECTORY))});
  {
    const std::string path = dir_.file("ring-file");
    UniqueFd file(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    ASSERT_EQ(::ftruncate(file.get(), kRingBytes), 0);
    bad.push_back({"a regular file of the right size", std::move(file)});
  }
  bad.push_back({"a memfd that cannot be sealed", make_memfd(kRingBytes, 0, MFD_CLOEXEC)});
  bad.push_back({"an unsealed memfd", make_memfd(kRingBytes, 0)});
  bad.push_back({"a memfd sealed but not against shrinking",
                 make_memfd(kRingBytes, F_SEAL_GROW | F_SEAL_SEAL)});
  bad.push_back(
      {"a sealed memfd one page too small", make_memfd(kRingBytes - 4096, F_SEAL_SHRINK)});
  bad.push_back({"a sealed memfd one page too big", make_memfd(kRingBytes + 4096, F_SEAL_SHRINK)});
  bad.push_back({"a sealed memfd one byte too big", make_memfd(kRingBytes + 1, F_SEAL_SHRINK)});
  bad.push_back({"a huge sealed memfd (64 GiB, sparse)",
                 make_memfd(std::uint64_t{64} << 30, F_SEAL_SHRINK | F_SEAL_GROW)});
  bad.push_back({"a memfd sealed F_SEAL_WRITE (no shared writable mapping)",
                 make_memfd(kRingBytes, F_SEAL_SHRINK | F_SEAL_WRITE)});
  bad.push_back({"a memfd sealed F_SEAL_FUTURE_WRITE",
                 make_memfd(kRingBytes, F_SEAL_SHRINK | F_SEAL_FUTURE_WRITE)});
  {
    // A good ring, passed as a read-only or an O_PATH descriptor.
    const UniqueFd good = make_memfd(kRingBytes, F_SEAL_SHRINK | F_SEAL_GROW);
    const std::string self = "/proc/self/fd/" + std::to_string(good.get());
    bad.push_back({"a sealed memfd opened read-only", UniqueFd(::open(self.c_str(), O_RDONLY))});
    bad.push_back({"a sealed memfd opened O_PATH", UniqueFd(::open(self.c_str(), O_PATH))});
  }
  // Sealed memfds of the right size whose header does not say what the frame says.
  std::vector<std::unique_ptr<CraftedRing>> liars;
  auto liar = [&](const std::string& what, auto&& lie) {
    liars.push_back(std::make_unique<CraftedRing>(7));
    ASSERT_TRUE(liars.back()->ok());
    lie(liars.back()->header());
    const std::string self = "/proc/self/fd/" + std::to_string(liars.back()->fd());
    bad.push_back({what, UniqueFd(::open(self.c_str(), O_RDWR | O_CLOEXEC))});
  };
  liar("a ring without the magic", [](proto::RingHeader& h) { h.magic = 0; });
  liar("a ring of a later layout", [](proto::RingHeader& h) { h.layout_version = 2; });
  liar("a ring whose header names another capacity",
       [](proto::RingHeader& h) { h.capacity = kCapacity * 2; });
  liar("a ring whose header names another thread", [](proto::RingHeader& h) { h.thread_id = 8; });
  std::uint32_t ring_id = 0;
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.what);
    ASSERT_GE(b.fd.get(), 0);
    EXPECT_EQ(hostile.attach(++ring_id, 7, kCapacity, b.fd.get()), RingStatus::kRefusedFd);
  }
  // Each refused descriptor is closed at once: the daemon holds none of them.
  expect_fds(fds_before);
  EXPECT_EQ(hostile_mappings(daemon_pid()), 0u);
  json r = rings();
  EXPECT_EQ(r["refused"], bad.size()) << r.dump();
  EXPECT_EQ(r["attached"], 0) << r.dump();
  EXPECT_EQ(r["mapped"], 0) << r.dump();
  EXPECT_EQ(r["bytes_mapped"], 0) << r.dump();
  EXPECT_EQ(protocol_errors("bad_ring"), 0u);
  EXPECT_TRUE(stats()["limits_hit"].empty()) << stats()["limits_hit"].dump();

  // The connection is as good as before: a well-made ring is mapped and read.
  CraftedRing ring(7);
  ASSERT_TRUE(ring.ok());
  EXPECT_EQ(hostile.attach(++ring_id, ring), RingStatus::kMapped);
  std::uint64_t ts = 1'000'000;
  ring.publish(pairs(7, kForward, 3, ts));
  ASSERT_TRUE(hostile.flush());
  r = rings();
  EXPECT_EQ(r["attached"], 1) << r.dump();
  EXPECT_EQ(r["mapped"], 1) << r.dump();
  EXPECT_EQ(r["bytes_mapped"], kSlotBytes) << r.dump();
  EXPECT_EQ(r["events"], 6) << r.dump();
  EXPECT_EQ(spans(::getpid(), "Forward"), 3u);
  EXPECT_EQ(hostile_mappings(daemon_pid()), 1u);

  expect_pong();
  run_trainer_exactly();
  hostile.close();
  expect_nothing_mapped();
}

// A spare ring (protocol version 8: a RingAttach of thread 0) is mapped before any thread
// has it. Records published while its header still names thread 0 are refused (cause refused);
// once the header names a thread, its records are read as that thread's; the thread is
// taken once, so a header rewritten to another thread later changes nothing (that
// thread's records are refused, the first thread's still read). A spare's header may also
// name its thread before the daemon reads the RingAttach.
TEST_F(HostileShmRingTest, ASpareRingIsReadAsTheThreadItsHeaderNamesOnceAndForAll) {
  ASSERT_NO_FATAL_FAILURE(start());
  RawClient hostile(socket());
  ASSERT_TRUE(hostile.handshake());
  CraftedRing spare(0);
  ASSERT_TRUE(spare.ok());
  ASSERT_EQ(hostile.attach(1, spare), RingStatus::kMapped);
  std::uint64_t ts = 1'000'000;
  spare.publish(pairs(0, kForward, 2, ts));  // nobody's records
  ASSERT_TRUE(hostile.flush());
  json r = rings();
  EXPECT_EQ(r["events"], 0) << r.dump();
  EXPECT_EQ(r["records_refused"], 4) << r.dump();

  proto::ring_thread_field(spare.header()).store(4321, std::memory_order_release);
  spare.publish(pairs(4321, kForward, 3, ts));
  ASSERT_TRUE(hostile.flush());
  r = rings();
  EXPECT_EQ(r["events"], 6) << r.dump();
  EXPECT_EQ(r["records_refused"], 4) << r.dump();
  EXPECT_EQ(spans(::getpid(), "Forward"), 3u);

  proto::ring_thread_field(spare.header()).store(999, std::memory_order_release);
  spare.publish(pairs(999, kForward, 1, ts));
  spare.publish(pairs(4321, kForward, 1, ts));
  ASSERT_TRUE(hostile.flush());
  r = rings();
  EXPECT_EQ(r["events"], 8) << r.dump();
  EXPECT_EQ(r["records_refused"], 6) << r.dump();
  EXPECT_EQ(spans(::getpid(), "Forward"), 4u);

  // Claimed before the attach: mapped, and read as the header's thread.
  CraftedRing early(0);
  ASSERT_TRUE(early.ok());
  proto::ring_thread_field(early.header()).store(4322, std::memory_order_release);
  early.publish(pairs(4322, kForward, 2, ts));
  ASSERT_EQ(hostile.attach(2, early), RingStatus::kMapped);
  ASSERT_TRUE(hostile.flush());
  r = rings();
  EXPECT_EQ(r["events"], 12) << r.dump();
  EXPECT_EQ(r["records_refused"], 6) << r.dump();
  EXPECT_EQ(spans(::getpid(), "Forward"), 6u);
  EXPECT_EQ(protocol_errors("bad_ring"), 0u);
  hostile.close();
  expect_nothing_mapped();
}

// ---- 2. descriptors without frames, frames without descriptors ----------------------------

TEST_F(HostileShmRingTest, ARingAttachWithoutADescriptorIsRefusedAndTheConnectionStays) {
  ASSERT_NO_FATAL_FAILURE(start());
  RawClient hostile(socket());
  ASSERT_TRUE(hostile.handshake());
  EXPECT_EQ(hostile.attach(1, 7, kCapacity, -1), RingStatus::kRefusedFd);
  EXPECT_EQ(hostile.attach(2, 7, proto::kMaxShmRingRecords, -1), RingStatus::kRefusedFd);
  EXPECT_TRUE(hostile.flush());
  const json r = rings();
  EXPECT_EQ(r["refused"], 2) << r.dump();
  EXPECT_EQ(r["attached"], 0) << r.dump();
  EXPECT_EQ(r["mapped"], 0) << r.dump();
  EXPECT_EQ(protocol_errors("bad_ring"), 0u);
  EXPECT_TRUE(stats()["limits_hit"].empty()) << stats()["limits_hit"].dump();
  expect_pong();
  run_trainer_exactly();
}

// A descriptor is taken by the next RingAttach frame decoded on its connection; others
// may wait, two at most (a partial send can leave one waiting when the next arrives). A
// third waiting, more than two in one read (MSG_CTRUNC), a RingAttach of a bad capacity,
// a ClockSync of a bad scale: the daemon closes that connection (bad_ring), closes every
// descriptor it held for it, and nothing changes for a bystander with a mapped ring.
TEST_F(HostileShmRingTest, StrayDescriptorsAndBadRingFramesCloseOnlyTheirOwnConnection) {
  ASSERT_NO_FATAL_FAILURE(start());
  RawClient bystander(socket());  // a v5 client with a ring, never misbehaving
  ASSERT_TRUE(bystander.handshake());
  CraftedRing good(11);
  ASSERT_TRUE(good.ok());
  ASSERT_EQ(bystander.attach(1, good), RingStatus::kMapped);
  const std::size_t fds_before = settled_fds();
  const UniqueFd memfd = make_memfd(kRingBytes, F_SEAL_SHRINK | F_SEAL_GROW);
  const auto attach_frame =
      RawClient::frames([](proto::Encoder& e) { e.ring_attach(1, 7, kCapacity); });
  const auto flush_frame = RawClient::frames([](proto::Encoder& e) { e.flush(99); });
  const std::array<int, 3> three{memfd.get(), memfd.get(), memfd.get()};
  const std::span<const int> one = std::span(three).first(1);
  const std::span<const int> two = std::span(three).first(2);
  std::uint64_t bad_ring = 0;
  std::uint64_t attached = 1;
  auto expect_closed_with = [&](RawClient& c, const std::string& error) {
    const auto message = c.closed_by_daemon();
    ASSERT_TRUE(message.has_value()) << "the daemon did not close the connection";
    EXPECT_EQ(message->rfind(error, 0), 0u) << *message;
  };
  {
    SCOPED_TRACE("two descriptors on one RingAttach: one is taken, one waits; a third fails");
    RawClient c(socket());
    ASSERT_TRUE(c.handshake());
    CraftedRing ring(7);
    ASSERT_TRUE(ring.ok());
    const std::array<int, 2> fds{ring.fd(), memfd.get()};
    ASSERT_TRUE(c.send(attach_frame, fds));
    const RawClient::Answer ack = c.next();
    ASSERT_EQ(ack.kind, RawClient::Answer::kRingAck);
    EXPECT_EQ(static_cast<RingStatus>(ack.ring.status), RingStatus::kMapped);
    ++attached;
    // The frame is complete and no other takes the second: stray.
    expect_closed_with(c, "bad_ring: a descriptor without a RingAttach frame to take it");
    ++bad_ring;
  }
  {
    SCOPED_TRACE("a RingAttach cut after its descriptor: it waits; a third in flight fails");
    RawClient c(socket());
    ASSERT_TRUE(c.handshake());
    // One RingAttach sent in three pieces, each with a descriptor.
    const std::span<const std::byte> frame(attach_frame);
    ASSERT_TRUE(c.send(frame.subspan(0, 5), one));
    ASSERT_TRUE(c.send(frame.subspan(5, 1), one)) << "two waiting are allowed (cut sends)";
    ASSERT_TRUE(c.send(frame.subspan(6, 1), one));
    expect_closed_with(c, "bad_ring: descriptors without RingAttach frames to take them");
    ++bad_ring;
  }
  {
    SCOPED_TRACE("a descriptor on a Flush frame: answered, then closed");
    RawClient c(socket());
    ASSERT_TRUE(c.handshake());
    EXPECT_TRUE(c.flush(memfd.get()));
    expect_closed_with(c, "bad_ring: a descriptor without a RingAttach frame to take it");
    ++bad_ring;
  }
  {
    SCOPED_TRACE("three descriptors in one message: cut off (MSG_CTRUNC)");
    RawClient c(socket());
    ASSERT_TRUE(c.handshake());
    ASSERT_TRUE(c.send(attach_frame, three));
    expect_closed_with(c, "bad_ring: descriptors cut off (MSG_CTRUNC)");
    ++bad_ring;
  }
  for (const std::uint64_t capacity :
       {kCapacity + 1, kCapacity / 2, proto::kMaxShmRingRecords * 2}) {
    SCOPED_TRACE("a capacity of " + std::to_string(capacity));
    RawClient c(socket());
    ASSERT_TRUE(c.handshake());
    ASSERT_TRUE(
        c.send(RawClient::frames([&](proto::Encoder& e) { e.ring_attach(1, 7, capacity); }), one));
    expect_closed_with(c, "bad_ring");
    ++bad_ring;
  }
  {
    SCOPED_TRACE("a ClockSync scale of 2^42");
    RawClient c(socket());
    ASSERT_TRUE(c.handshake());
    ASSERT_TRUE(c.send(RawClient::frames([](proto::Encoder& e) {
      e.clock_sync(proto::ClockSync{0, 0, proto::kMaxClockScale});
    })));
    expect_closed_with(c, "bad_ring");
    ++bad_ring;
  }
  {
    SCOPED_TRACE("RingAttach on a version 4 connection");
    RawClient c(socket());
    ASSERT_TRUE(c.handshake(4));
    ASSERT_TRUE(c.send(attach_frame, one));
    expect_closed_with(c, "unknown_frame_type");
  }
  {
    SCOPED_TRACE("descriptors on text commands: closed, the commands answered");
    RawClient c(socket());
    const std::string ping = "ping\n";
    const auto bytes = std::as_bytes(std::span(ping));
    ASSERT_TRUE(c.send(bytes, one));  // on the first read, before the dialect is known
    ASSERT_TRUE(c.send(bytes, two));
    ::shutdown(c.native(), SHUT_WR);
    std::string reply;
    char buf[256];
    for (;;) {
      pollfd p{c.native(), POLLIN, 0};
      if (::poll(&p, 1, kTimeoutMs) <= 0) break;
      const ssize_t n = ::recv(c.native(), buf, sizeof buf, 0);
      if (n <= 0) break;
      reply.append(buf, static_cast<std::size_t>(n));
    }
    EXPECT_EQ(reply, "pong\npong\n");
  }
  EXPECT_EQ(protocol_errors("bad_ring"), bad_ring);
  EXPECT_EQ(protocol_errors("unknown_frame_type"), 1u);
  // Every descriptor those connections passed is closed with them (the ring mapped on
  // the first is unmapped with it).
  expect_fds(fds_before);
  EXPECT_TRUE(eventually([&] { return rings()["mapped"] == 1; })) << rings().dump();
  const json r = rings();
  EXPECT_EQ(r["attached"], attached) << r.dump();
  EXPECT_EQ(r["refused"], 0) << r.dump();
  EXPECT_EQ(hostile_mappings(daemon_pid()), 1u);

  // The bystander's connection and ring went on as if nothing happened.
  std::uint64_t ts = 1'000'000;
  good.publish(pairs(11, kForward, 5, ts));
  ASSERT_TRUE(bystander.flush());
  EXPECT_EQ(spans(::getpid(), "Forward"), 5u);
  EXPECT_EQ(rings()["events"], 10);
  expect_pong();
  run_trainer_exactly();
}

// A flood of connections that pass descriptors every wrong way (too many waiting, 253 in
// one message, with a bad frame, left waiting when the client hangs up, refused): once
// they are gone the daemon holds exactly the descriptors it held before, and its count of
// descriptors waiting for a frame (at most 32 for all connections) is back to zero: a
// client that then attaches 40 rings one after the other gets them all mapped.
TEST_F(HostileShmRingTest, AFloodOfStrayDescriptorsLeaksNoneInTheDaemon) {
  ASSERT_NO_FATAL_FAILURE(start());
  const std::size_t fds_before = settled_fds();
  const UniqueFd memfd = make_memfd(kRingBytes, F_SEAL_SHRINK | F_SEAL_GROW);
  std::vector<int> many;  // SCM_MAX_FD: the most one message may carry
  for (int i = 0; i < 253; ++i) many.push_back(memfd.get());
  const std::span<const int> one = std::span(many).first(1);
  const std::span<const int> two = std::span(many).first(2);
  const auto attach_frame =
      RawClient::frames([](proto::Encoder& e) { e.ring_attach(1, 7, kCapacity); });
  const auto bad_attach_frame =
      RawClient::frames([](proto::Encoder& e) { e.ring_attach(1, 7, kCapacity + 1); });
  const auto flush_frame = RawClient::frames([](proto::Encoder& e) { e.flush(99); });
  constexpr int kRounds = 300;
  int closed = 0;
  for (int i = 0; i < kRounds; ++i) {
    SCOPED_TRACE("round " + std::to_string(i));
    RawClient c(socket());
    ASSERT_TRUE(c.handshake());
    switch (i % 6) {
      case 0:  // two on a RingAttach (one taken, one stray), two more on a Flush
        ASSERT_TRUE(c.send(attach_frame, two));
        c.send(flush_frame, two);  // may find the connection closed already
        break;
      case 1:
        ASSERT_TRUE(c.send(attach_frame, many));
        break;
      case 2:  // stray on a Flush: answered, then closed
        c.flush(memfd.get());
        c.flush(memfd.get());
        c.send(flush_frame, one);
        break;
      case 3:
        ASSERT_TRUE(c.send(bad_attach_frame, one));
        break;
      case 4:  // a descriptor cut with its RingAttach (waits), then the client hangs up
        ASSERT_TRUE(
            c.send(std::vector<std::byte>(attach_frame.begin(), attach_frame.begin() + 5), one));
        continue;
      case 5: {  // a refused one, and a connection that stays well
        int pipe_ends[2];
        ASSERT_EQ(::pipe2(pipe_ends, O_CLOEXEC), 0);
        const UniqueFd read_end(pipe_ends[0]), write_end(pipe_ends[1]);
        EXPECT_EQ(c.attach(1, 7, kCapacity, read_end.get()), RingStatus::kRefusedFd);
        EXPECT_TRUE(c.flush());
        continue;
      }
    }
    ASSERT_TRUE(c.closed_by_daemon().has_value());
    ++closed;
  }
  EXPECT_EQ(protocol_errors("bad_ring"), static_cast<std::uint64_t>(closed));
  expect_fds(fds_before);

  RawClient good(socket());
  ASSERT_TRUE(good.handshake());
  const auto rings_made = crafted_rings(40, 100);
  ASSERT_TRUE(all_made(rings_made));
  for (std::uint32_t i = 0; i < 40; ++i) {
    EXPECT_EQ(good.attach(i, *rings_made[i]), RingStatus::kMapped) << "ring " << i;
  }
  EXPECT_EQ(rings()["mapped"], 40);
  EXPECT_EQ(hostile_mappings(daemon_pid()), 40u);
  EXPECT_EQ(hostile_descriptors(daemon_pid()), 40u);
  good.close();
  expect_nothing_mapped();
  expect_fds(fds_before);
  expect_pong();
  run_trainer_exactly();
}

// Descriptors that no RingAttach takes: a descriptor still waiting once every frame of
// its read is decoded (it came on a Flush frame) closes its own connection (bad_ring),
// so a tenant cannot hoard the daemon's reserve of waiting descriptors
// (kMaxPendingRingFds, 32; kMaxPendingRingFdsPerUid, 8, for descriptors whose RingAttach
// is cut). What it must not do to another client: close its connection, refuse its ring
// or lose its events.
TEST_F(HostileShmRingTest, StrayDescriptorsHeldByOneTenantDoNotRefuseAnotherClientsRing) {
  ASSERT_NO_FATAL_FAILURE(start());
  const std::size_t fds_before = settled_fds();
  const UniqueFd memfd = make_memfd(kRingBytes, F_SEAL_SHRINK | F_SEAL_GROW);
  std::vector<std::unique_ptr<RawClient>> holders;
  for (int i = 0; i < 16; ++i) {
    holders.push_back(std::make_unique<RawClient>(socket()));
    ASSERT_TRUE(holders.back()->handshake());
    // The Flush is applied and answered, then the daemon closes the connection for the
    // descriptor no frame took (so the second send fails).
    holders.back()->flush(memfd.get());
    EXPECT_FALSE(holders.back()->flush(memfd.get())) << "holder " << i;
  }
  EXPECT_EQ(protocol_errors("bad_ring"), 16u);
  RawClient other(socket());
  ASSERT_TRUE(other.handshake());
  CraftedRing ring(21);
  ASSERT_TRUE(ring.ok());
  EXPECT_EQ(other.attach(1, ring), RingStatus::kMapped);
  EXPECT_EQ(rings()["refused"], 0);
  EXPECT_TRUE(other.flush());
  expect_pong();
  expect_exact(start_trainer(2, 1000));
  holders.clear();
  expect_fds(fds_before + 2);  // `other`'s connection and its ring's memfd
}

// ---- 3. a producer that lies ------------------------------------------------------------------

TEST_F(HostileShmRingTest, AHeadOutOfRangeDropsOnlyThatRingAndTheConnectionStays) {
  ASSERT_NO_FATAL_FAILURE(start());
  RawClient hostile(socket());
  ASSERT_TRUE(hostile.handshake());
  std::uint64_t ts = 1'000'000;
  std::uint64_t forward = 0;

  // A full ring (head - tail == capacity) is in range: all of it is read.
  CraftedRing full(301);
  ASSERT_TRUE(full.ok());
  ASSERT_EQ(hostile.attach(1, full), RingStatus::kMapped);
  full.publish(pairs(301, kForward, static_cast<int>(kCapacity / 2), ts));
  forward += kCapacity / 2;
  ASSERT_TRUE(hostile.flush());
  EXPECT_EQ(full.tail(), kCapacity) << "the daemon freed what it read";
  EXPECT_EQ(rings()["events"], kCapacity);

  // One past the capacity: dropped, nothing of it read; the connection stays.
  const auto more = pairs(301, kForward, 100, ts);
  for (std::size_t i = 0; i < more.size(); ++i) full.write_slot(full.head() + i, more[i]);
  full.set_head(full.tail() + kCapacity + 1);
  ASSERT_TRUE(hostile.flush());
  json r = rings();
  EXPECT_EQ(r["bad_rings"], 1) << r.dump();
  EXPECT_EQ(r["mapped"], 0) << r.dump();
  EXPECT_EQ(r["bytes_mapped"], 0) << r.dump();
  EXPECT_EQ(r["events"], kCapacity) << r.dump();
  EXPECT_EQ(protocol_errors("bad_ring"), 1u);
  EXPECT_EQ(hostile_mappings(daemon_pid()), 0u);
  // Made honest again, it is not read any more: the daemon let go of it.
  full.set_head(kCapacity + more.size());
  ASSERT_TRUE(hostile.flush());
  EXPECT_EQ(rings()["events"], kCapacity);

  // A head below the tail (after some honest records).
  CraftedRing below(302);
  ASSERT_TRUE(below.ok());
  ASSERT_EQ(hostile.attach(2, below), RingStatus::kMapped);
  below.publish(pairs(302, kForward, 5, ts));
  forward += 5;
  ASSERT_TRUE(hostile.flush());
  const auto unpublished = pairs(302, kForward, 5, ts);  // written, never published
  for (std::size_t i = 0; i < unpublished.size(); ++i) {
    below.write_slot(below.head() + i, unpublished[i]);
  }
  below.set_head(below.tail() - 1);
  ASSERT_TRUE(hostile.flush());
  EXPECT_EQ(rings()["bad_rings"], 2);

  // Offered with a tail ahead of its head; offered with a head of 2^63.
  CraftedRing ahead(303);
  ASSERT_TRUE(ahead.ok());
  ahead.set_tail(1000);
  ahead.set_head(10);
  ASSERT_EQ(hostile.attach(3, ahead), RingStatus::kMapped);
  CraftedRing far(304);
  ASSERT_TRUE(far.ok());
  far.set_head(std::uint64_t{1} << 63);
  ASSERT_EQ(hostile.attach(4, far), RingStatus::kMapped);
  ASSERT_TRUE(hostile.flush());
  EXPECT_EQ(rings()["bad_rings"], 4);

  // Positions are free-running 64-bit counters: records across their wrap are in range.
  CraftedRing wrap(305);
  ASSERT_TRUE(wrap.ok());
  wrap.set_tail(~std::uint64_t{0} - 3);
  wrap.set_head(~std::uint64_t{0} - 3);
  ASSERT_EQ(hostile.attach(5, wrap), RingStatus::kMapped);
  wrap.publish(pairs(305, kForward, 4, ts));
  forward += 4;
  ASSERT_TRUE(hostile.flush());
  EXPECT_EQ(wrap.tail(), 4u);

  r = rings();
  EXPECT_EQ(r["bad_rings"], 4) << r.dump();
  EXPECT_EQ(r["attached"], 5) << r.dump();
  EXPECT_EQ(r["mapped"], 1) << r.dump();
  EXPECT_EQ(r["events"], 2 * forward) << r.dump();
  EXPECT_EQ(r["records_refused"], 0) << r.dump();
  EXPECT_EQ(protocol_errors("bad_ring"), 4u);
  EXPECT_EQ(spans(::getpid(), "Forward"), forward);
  EXPECT_EQ(process(::getpid())["dropped"], 0);
  EXPECT_TRUE(hostile.flush()) << "a lying ring never costs the connection";
  expect_pong();
  run_trainer_exactly();
  hostile.close();
  expect_nothing_mapped();
}

// A graceful stop with the process still connected: a record of a custom step whose
// RegisterStep has not arrived is not refused (it would be, were the process gone) but
// left in the ring, with what follows it, for the next daemon, to which the process
// registers its steps again; nothing of it is lost or counted twice.
TEST_F(HostileShmRingTest, AGracefulStopLeavesRecordsWaitingForARegistrationToTheNextDaemon) {
  ASSERT_NO_FATAL_FAILURE(start());
  RawClient first(socket());
  ASSERT_TRUE(first.handshake());
  CraftedRing ring(201);
  ASSERT_TRUE(ring.ok());
  ASSERT_EQ(first.attach(1, ring), RingStatus::kMapped);
  std::uint64_t ts = 1'000'000;
  std::vector<proto::EventRecord> records = pairs(201, kForward, 2, ts);
  const std::uint16_t custom = proto::kFirstCustomStep;
  records.push_back(record(ts += 1000, 201, custom, proto::EventKind::kStart));
  records.push_back(record(ts += 1000, 201, custom, proto::EventKind::kEnd));
  const auto last = pairs(201, kForward, 1, ts += 1000);
  records.insert(records.end(), last.begin(), last.end());
  ring.publish(records);
  ASSERT_TRUE(first.flush());
  ASSERT_EQ(ring.tail(), 4u) << "the premise: the custom step's record waits";
  ASSERT_EQ(daemon_->stop(SIGTERM), 0) << daemon_->log();
  EXPECT_EQ(ring.tail(), 4u) << "records waiting for a registration were consumed at the stop";

  ASSERT_NO_FATAL_FAILURE(start());
  RawClient next(socket());
  ASSERT_TRUE(next.handshake());
  ASSERT_TRUE(next.send(
      RawClient::frames([&](proto::Encoder& e) { e.register_step(custom, "custom-0"); })));
  ASSERT_EQ(next.attach(1, ring), RingStatus::kMapped);
  ASSERT_TRUE(next.flush());
  EXPECT_EQ(ring.tail(), records.size());
  const json r = rings();
  EXPECT_EQ(r["events"], 4) << r.dump();
  EXPECT_EQ(r["records_refused"], 0) << r.dump();
  const json p = process(::getpid());
  EXPECT_EQ(p["dropped"], 0) << p.dump();
  EXPECT_EQ(spans(::getpid(), "Forward"), 1u) << p.dump();
  EXPECT_EQ(spans(::getpid(), "custom-0"), 1u) << p.dump();
  next.close();
  first.close();
}

TEST_F(HostileShmRingTest, BadRecordsAreSkippedAndCountedAndTheGoodOnesAroundThemFoldedExactly) {
  ASSERT_NO_FATAL_FAILURE(start());
  RawClient hostile(socket());
  ASSERT_TRUE(hostile.handshake());
  CraftedRing ring(201);
  ASSERT_TRUE(ring.ok());
  ASSERT_EQ(hostile.attach(1, ring), RingStatus::kMapped);
  std::uint64_t ts = 1'000'000;
  std::vector<proto::EventRecord> records;
  auto good = [&](int n) {
    const auto p = pairs(201, kForward, n, ts);
    records.insert(records.end(), p.begin(), p.end());
  };
  auto start_record = [&] { return record(ts += 1000, 201, kForward, proto::EventKind::kStart); };
  good(3);
  proto::EventRecord bad = start_record();
  bad.kind = 3;  // neither start nor end
  records.push_back(bad);
  bad.kind = 0;
  records.push_back(bad);
  good(2);
  bad = start_record();
  bad.reserved = 1;
  records.push_back(bad);
  good(2);
  bad = start_record();
  bad.thread_id = 999;  // not the ring's thread
  records.push_back(bad);
  good(2);
  bad = start_record();
  bad.step = 200;  // neither built in nor custom
  records.push_back(bad);
  bad.step = proto::kFirstCustomStep + proto::kMaxCustomSteps;
  records.push_back(bad);
  bad.step = 0xFFFF;
  records.push_back(bad);
  good(1);
  constexpr std::uint64_t kRefused = 7;
  ring.publish(records);
  ASSERT_TRUE(hostile.flush());
  json r = rings();
  EXPECT_EQ(r["events"], 20) << r.dump();
  EXPECT_EQ(r["records_refused"], kRefused) << r.dump();
  EXPECT_EQ(r["bad_rings"], 0) << r.dump();
  EXPECT_EQ(r["mapped"], 1) << r.dump();
  EXPECT_EQ(ring.tail(), records.size()) << "bad records are consumed, not left to block";
  json p = process(::getpid());
  EXPECT_EQ(spans(::getpid(), "Forward"), 10u) << p.dump();
  EXPECT_EQ(p["unmatched_ends"], 0) << p.dump();
  EXPECT_EQ(p["dropped_by_cause"]["refused"], kRefused) << p.dump();
  EXPECT_EQ(p["dropped_by_cause"]["invalid"], 0) << p.dump();
  EXPECT_EQ(p["dropped"], kRefused) << p.dump();
  EXPECT_EQ(protocol_errors("bad_ring"), 0u);

  // A custom step never registered waits in the ring (its RegisterStep may be on its
  // way), holding back what follows it; the last pass, when the connection closes,
  // refuses it and folds the rest.
  std::vector<proto::EventRecord> tail_records{
      record(ts += 1000, 201, static_cast<std::uint16_t>(proto::kFirstCustomStep),
             proto::EventKind::kStart)};
  const auto last = pairs(201, kForward, 1, ts);
  tail_records.insert(tail_records.end(), last.begin(), last.end());
  ring.publish(tail_records);
  ASSERT_TRUE(hostile.flush());
  r = rings();
  EXPECT_EQ(r["events"], 20) << r.dump();
  EXPECT_EQ(r["records_refused"], kRefused) << r.dump();
  expect_pong();
  hostile.close();
  ASSERT_TRUE(eventually([&] { return rings()["records_refused"] == kRefused + 1; }))
      << rings().dump();
  EXPECT_EQ(rings()["events"], 22);
  p = process(::getpid());
  EXPECT_EQ(spans(::getpid(), "Forward"), 11u) << p.dump();
  EXPECT_EQ(p["dropped_by_cause"]["refused"], kRefused + 1) << p.dump();
  EXPECT_EQ(p["dropped_by_cause"]["invalid"], 0) << p.dump();
  EXPECT_EQ(p["dropped_by_cause"]["buffer_full"], 0) << p.dump();
  EXPECT_EQ(p["dropped_by_cause"]["not_connected"], 0) << p.dump();
  EXPECT_EQ(p["dropped_by_cause"]["in_flight"], 0) << p.dump();
  expect_nothing_mapped();

  // The skipped records are in what the daemon took: the process's next connection says
  // it delivered every record past the tail (as libsteptrace does: the tail moved by a
  // daemon), and none of them is counted again as lost by a crash, on any connection.
  const std::uint64_t consumed = ring.tail();
  for (int again = 0; again < 2; ++again) {
    RawClient next(socket());
    ASSERT_TRUE(next.handshake_delivered(consumed));
    p = process(::getpid());
    EXPECT_EQ(p["dropped_by_cause"]["daemon_crash"], 0) << p.dump();
    EXPECT_EQ(p["dropped_by_cause"]["refused"], kRefused + 1) << p.dump();
    EXPECT_EQ(p["events"].get<std::uint64_t>() + p["dropped"].get<std::uint64_t>(), consumed)
        << p.dump();
    next.close();
  }
  run_trainer_exactly();
}

// A producer that "publishes" slots it never wrote: the daemon reads zeros (refused
// records), and must not pay for them. BLOCKED: the daemon reads the slots through its
// MAP_SHARED mapping, and a read fault on a hole of a shmem file allocates the page (in the
// daemon's memory cgroup, since the daemon faulted it). So a producer that writes one
// header page and sets head = capacity makes the daemon commit the whole ring: 16 MiB
// here, up to max_ring_bytes_per_uid (8 GiB by default) per uid, and the pages outlive the
// daemon's mapping (the producer's memfd holds them) while the budget is given back:
// attach, let it drain, disconnect, repeat, and the memory charged to steptraced grows
// without bound (seen: 4 rounds of 64 MiB left 256 MiB of shmem with bytes_mapped 0).
// pread(2) of a hole does not allocate (shmem reads holes as the zero page): reading the
// slots from the descriptor (kept open) instead of the mapping would close this.
// The daemon maps only a ring's header and reads its slots with pread: a hole the
// producer never wrote reads as zeros (refused records) and commits no page, where a
// read through a mapping would allocate every page of it, charged to the daemon.
TEST_F(HostileShmRingTest, AProducerCannotMakeTheDaemonCommitMemoryItNeverWrote) {
  ASSERT_NO_FATAL_FAILURE(start());
  RawClient hostile(socket());
  ASSERT_TRUE(hostile.handshake());
  constexpr std::uint64_t kSparse = std::uint64_t{1} << 20;  // 16 MiB of slots
  // Only its header page is ever written.
  CraftedRing ring(90, kSparse);
  ASSERT_TRUE(ring.ok());
  ASSERT_EQ(hostile.attach(1, ring), RingStatus::kMapped);
  const std::uint64_t before = rss_shmem_kib(daemon_pid());
  ring.set_head(kSparse);
  ASSERT_TRUE(hostile.flush());
  EXPECT_EQ(rings()["records_refused"], kSparse);
  EXPECT_LT(rss_shmem_kib(daemon_pid()), before + 1024)
      << "the daemon's reads committed the holes the producer never wrote";
  // Nor did the file grow: still only the header page is allocated in it.
  struct stat st {};
  ASSERT_EQ(::fstat(ring.fd(), &st), 0);
  EXPECT_LE(st.st_blocks * 512, 2 * 4096) << "pages allocated in the memfd";
  expect_pong();
  run_trainer_exactly();
}

// ---- 4. a producer scribbling while the daemon drains ---------------------------------------

// Two threads rewrite the heads, tails, drop counters, flags and slots of every ring the
// hostile client attached, at random, in a tight loop, while the client keeps attaching
// rings (some also on a second connection: one memfd mapped twice), sends ClockSyncs of
// random scales and Flushes (each one a drain), and the real trainer records alongside.
// Run it against the ASan build of steptraced (build-hostile-asan) for the full value.
TEST_F(HostileShmRingTest, AProducerScribblingOnItsRingsWhileTheDaemonDrainsHurtsNoOne) {
  ASSERT_NO_FATAL_FAILURE(start());
  RawClient hostile(socket());
  RawClient twin(socket());
  ASSERT_TRUE(hostile.handshake());
  ASSERT_TRUE(twin.handshake());
  const Trainer trainer = start_trainer(4, 5000);

  constexpr int kScribblers = 2;
  struct Lane {
    std::mutex mu;
    std::vector<CraftedRing*> rings;
  };
  std::array<Lane, kScribblers> lanes;
  std::vector<std::unique_ptr<CraftedRing>> owned;  // outlive the scribblers
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> writes{0};
  const std::uint64_t seed = static_cast<std::uint64_t>(::getpid());
  SCOPED_TRACE("seed " + std::to_string(seed));
  // Mostly scribbles a live ring can survive (records, junk, heads in range, counters),
  // so the daemon keeps reading scribbled slots; now and then a lie that kills the ring
  // (a head out of range, an orphaned flag), and the main loop attaches fresh ones.
  auto scribble = [&](int lane_index) {
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(lane_index));
    Lane& lane = lanes[static_cast<std::size_t>(lane_index)];
    while (!stop.load(std::memory_order_relaxed)) {
      CraftedRing* ring = nullptr;
      {
        std::lock_guard lock(lane.mu);
        const std::size_t n = lane.rings.size();
        if (n > 0) ring = lane.rings[n - 1 - rng() % std::min<std::size_t>(n, 8)];  // the newest
      }
      if (ring == nullptr) {
        std::this_thread::yield();
        continue;
      }
      const std::uint64_t cap = ring->capacity();
      proto::RingHeader& h = ring->header();
      const std::uint64_t op = rng() % 1000;
      if (op < 400) {  // plausible records, honestly published while they fit
        const std::uint64_t head = ring->head();
        const std::uint64_t n = rng() % 64;
        if (head + n - ring->tail() <= cap) {
          for (std::uint64_t i = 0; i < n; ++i) {
            ring->write_slot(head + i,
                             record(rng() % (std::uint64_t{1} << 40), ring->thread_id(),
                                    static_cast<std::uint16_t>(rng() % 4),
                                    rng() % 2 ? proto::EventKind::kStart : proto::EventKind::kEnd));
          }
          ring->set_head(head + n);
        }
      } else if (op < 700) {  // junk over slots, the ones being read too
        for (int i = 0; i < 16; ++i) {
          const std::uint64_t junk[2] = {rng(), rng()};
          const std::uint64_t slot = rng() % 2 ? ring->tail() + rng() % 64 : rng();
          ring->write_bytes(slot, junk, sizeof junk);
        }
      } else if (op < 850) {  // a head anywhere in range of the daemon's tail
        ring->set_head(ring->tail() + rng() % (cap + 1));
      } else if (op < 900) {  // drop counters (they may only make the process's count grow)
        proto::ring_field(h.dropped_buffer_full).store(rng() % 1000, std::memory_order_relaxed);
        proto::ring_field(h.dropped_not_connected).store(rng() % 1000, std::memory_order_relaxed);
      } else if (op < 950) {  // the fields the daemon checked once, at the RingAttach
        proto::ring_field(h.capacity).store(rng(), std::memory_order_relaxed);
        std::atomic_ref<std::uint32_t>(h.thread_id)
            .store(static_cast<std::uint32_t>(rng()), std::memory_order_relaxed);
        std::atomic_ref<std::uint32_t>(h.magic).store(static_cast<std::uint32_t>(rng()),
                                                      std::memory_order_relaxed);
      } else if (op < 990) {  // the daemon's own fields: it never reads them back
        ring->set_tail(ring->tail() + rng() % 3 - 1);
        proto::ring_field(h.consumer_pid).store(rng(), std::memory_order_relaxed);
      } else {  // lies that end the ring
        switch (rng() % 4) {
          case 0:
            ring->set_head(rng());
            break;
          case 1:
            ring->set_head(ring->tail() - 1 - rng() % 8);
            break;
          case 2:
            ring->set_head(ring->tail() + cap + 1 + rng() % 8);
            break;
          case 3:
            proto::ring_field(h.orphaned).store(1, std::memory_order_release);
            break;
        }
      }
      writes.fetch_add(1, std::memory_order_relaxed);
    }
  };
  // Stopped and joined however the test leaves (an ASSERT returns early).
  struct Scribblers {
    std::atomic<bool>& stop;
    std::vector<std::thread> threads;
    ~Scribblers() { join(); }
    void join() {
      stop = true;
      for (auto& t : threads) {
        if (t.joinable()) t.join();
      }
    }
  } scribblers{stop, {}};
  for (int k = 0; k < kScribblers; ++k) scribblers.threads.emplace_back(scribble, k);

  std::mt19937_64 rng(seed);
  std::uint32_t ring_id = 0;
  int flushes = 0;
  const auto until = Clock::now() + std::chrono::milliseconds(1500);
  for (int i = 0; Clock::now() < until; ++i) {
    if (i % 4 == 0 && owned.size() < 512) {
      auto ring = std::make_unique<CraftedRing>(1000 + ring_id);
      ASSERT_TRUE(ring->ok());
      ASSERT_EQ(hostile.attach(++ring_id, *ring), RingStatus::kMapped);
      if (ring_id % 3 == 0) {
        ASSERT_EQ(twin.attach(ring_id, *ring), RingStatus::kMapped);
      }
      Lane& lane = lanes[ring_id % kScribblers];
      std::lock_guard lock(lane.mu);
      lane.rings.push_back(ring.get());
      owned.push_back(std::move(ring));
    }
    const proto::ClockSync clock{rng(), rng(), rng() % proto::kMaxClockScale};
    ASSERT_TRUE(hostile.send(RawClient::frames([&](proto::Encoder& e) { e.clock_sync(clock); })));
    ASSERT_TRUE(hostile.flush()) << "flush " << flushes;
    ++flushes;
    if (i % 8 == 0) {
      ASSERT_TRUE(twin.flush());
    }
    if (i % 32 == 0) {
      ASSERT_TRUE(daemon_->running()) << daemon_->log();
      expect_pong();
    }
  }
  scribblers.join();

  ASSERT_TRUE(daemon_->running()) << daemon_->log();
  EXPECT_TRUE(hostile.flush()) << "scribbled rings never cost the connection";
  EXPECT_TRUE(twin.flush());
  expect_pong();
  expect_exact(trainer);
  const json r = rings();
  std::cout << "scribbler: " << writes.load() << " writes, " << owned.size() << " rings, "
            << flushes << " flushes; daemon: " << r.dump() << "\n";
  EXPECT_GT(r["attached"].get<std::uint64_t>(), owned.size());  // plus the trainer's
  EXPECT_GT(r["records_refused"].get<std::uint64_t>(), 0u) << "no scribbled slot was ever read";
  EXPECT_EQ(r["refused"], 0) << r.dump();
  hostile.close();
  twin.close();
  expect_nothing_mapped();
}

// ---- 5. budgets -------------------------------------------------------------------------------

TEST_F(HostileShmRingTest,
       TheRingPastMaxRingsPerProcessIsRefusedAndThousandsOfAttemptsCostNothing) {
  ASSERT_NO_FATAL_FAILURE(start("\"max_rings_per_process\": 4"));
  RawClient hostile(socket());
  ASSERT_TRUE(hostile.handshake());
  const std::size_t fds_before = settled_fds();
  const auto made = crafted_rings(4, 50);
  ASSERT_TRUE(all_made(made));
  for (std::uint32_t i = 0; i < 4; ++i) {
    EXPECT_EQ(hostile.attach(i, *made[i]), RingStatus::kMapped);
  }
  CraftedRing fifth(60);
  ASSERT_TRUE(fifth.ok());
  EXPECT_EQ(hostile.attach(5, fifth), RingStatus::kRefusedLimit);
  json r = rings();
  EXPECT_EQ(r["attached"], 4) << r.dump();
  EXPECT_EQ(r["refused"], 1) << r.dump();
  EXPECT_EQ(r["mapped"], 4) << r.dump();
  EXPECT_EQ(r["bytes_mapped"], 4 * kSlotBytes) << r.dump();
  EXPECT_EQ(limits_hit("max_rings_per_process"), 1u);

  // Thousands more, each with a descriptor the daemon must close: refused, counted, and
  // neither its descriptors nor its mappings grow.
  constexpr int kAttempts = 3000;
  for (int i = 0; i < kAttempts; ++i) {
    ASSERT_EQ(hostile.attach(static_cast<std::uint32_t>(100 + i), fifth), RingStatus::kRefusedLimit)
        << "attempt " << i;
  }
  // And as many connections, each mapping its 4 and refused the 5th, then closing.
  for (int i = 0; i < 200; ++i) {
    RawClient c(socket());
    ASSERT_TRUE(c.handshake());
    for (std::uint32_t k = 0; k < 4; ++k) ASSERT_EQ(c.attach(k, *made[k]), RingStatus::kMapped);
    ASSERT_EQ(c.attach(4, fifth), RingStatus::kRefusedLimit);
  }
  expect_fds(fds_before + 4);  // one per ring still mapped (the first connection's 4)
  EXPECT_TRUE(eventually([&] { return rings()["mapped"] == 4; })) << rings().dump();
  r = rings();
  EXPECT_EQ(r["bytes_mapped"], 4 * kSlotBytes) << r.dump();
  EXPECT_EQ(r["attached"], 4 + 200 * 4) << r.dump();
  EXPECT_EQ(r["refused"], 1 + kAttempts + 200) << r.dump();
  EXPECT_EQ(hostile_mappings(daemon_pid()), 4u);
  EXPECT_EQ(limits_hit("max_rings_per_process"), 1u + kAttempts + 200);
  EXPECT_EQ(protocol_errors("bad_ring"), 0u);
  expect_pong();
  // The trainer has 4 threads, each with a ring: as many as the limit allows.
  run_trainer_exactly();
  // One with more threads than the limit: the rings past it stay on the socket path.
  expect_exact(start_trainer(8, 1000));
  hostile.close();
  expect_nothing_mapped();
}

TEST_F(HostileShmRingTest, MaxRingBytesPerProcessRefusesTheRingThatWouldPassIt) {
  ASSERT_NO_FATAL_FAILURE(
      start("\"max_ring_bytes_per_process\": " + std::to_string(2 * kSlotBytes + 4095)));
  RawClient hostile(socket());
  ASSERT_TRUE(hostile.handshake());
  CraftedRing a(1), b(2), c(3);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(hostile.attach(1, a), RingStatus::kMapped);
  EXPECT_EQ(hostile.attach(2, b), RingStatus::kMapped);
  EXPECT_EQ(hostile.attach(3, c), RingStatus::kRefusedLimit);
  EXPECT_EQ(limits_hit("max_ring_bytes_per_process"), 1u);
  // A bigger ring than the whole budget is refused before its descriptor is looked at.
  CraftedRing big(4, kCapacity * 2);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(hostile.attach(4, big), RingStatus::kRefusedLimit);
  // So is one over the budget whatever its descriptor: the budget is looked at first.
  int ends[2];
  ASSERT_EQ(::pipe2(ends, O_CLOEXEC), 0);
  const UniqueFd read_end(ends[0]), write_end(ends[1]);
  EXPECT_EQ(hostile.attach(5, 7, proto::kMaxShmRingRecords, read_end.get()),
            RingStatus::kRefusedLimit);
  const json r = rings();
  EXPECT_EQ(r["mapped"], 2) << r.dump();
  EXPECT_EQ(r["bytes_mapped"], 2 * kSlotBytes) << r.dump();
  EXPECT_EQ(r["refused"], 3) << r.dump();
  EXPECT_EQ(limits_hit("max_ring_bytes_per_process"), 3u);
  expect_pong();
  // The trainer's rings (4 MiB each) are all past this budget: all on the socket path.
  run_trainer_exactly();
}

TEST_F(HostileShmRingTest, MaxRingBytesPerUidRefusesASecondConnectionOfTheUidUntilTheFirstCloses) {
  ASSERT_NO_FATAL_FAILURE(start("\"max_ring_bytes_per_uid\": " + std::to_string(3 * kSlotBytes)));
  RawClient first(socket());
  RawClient second(socket());
  ASSERT_TRUE(first.handshake());
  ASSERT_TRUE(second.handshake());
  const auto made = crafted_rings(4, 70);
  ASSERT_TRUE(all_made(made));
  for (std::uint32_t i = 0; i < 3; ++i) EXPECT_EQ(first.attach(i, *made[i]), RingStatus::kMapped);
  EXPECT_EQ(second.attach(3, *made[3]), RingStatus::kRefusedLimit);
  EXPECT_EQ(limits_hit("max_ring_bytes_per_uid"), 1u);
  json r = rings();
  EXPECT_EQ(r["mapped"], 3) << r.dump();
  EXPECT_EQ(r["bytes_mapped"], 3 * kSlotBytes) << r.dump();
  EXPECT_TRUE(second.flush()) << "a refusal costs nothing but the ring";

  // The first connection closes: its bytes go back to the uid.
  first.close();
  expect_nothing_mapped();
  EXPECT_EQ(second.attach(4, *made[3]), RingStatus::kMapped);
  r = rings();
  EXPECT_EQ(r["mapped"], 1) << r.dump();
  EXPECT_EQ(r["attached"], 4) << r.dump();
  EXPECT_EQ(r["refused"], 1) << r.dump();
  expect_pong();
  // The trainer runs as the same uid: its rings do not fit, its events come on the socket.
  run_trainer_exactly();
  second.close();
  expect_nothing_mapped();
}

TEST_F(HostileShmRingTest, MaxRingsPerUidRefusesTheRingPastItOverAllConnectionsOfTheUid) {
  ASSERT_NO_FATAL_FAILURE(start("\"max_rings_per_uid\": 3"));
  RawClient first(socket());
  RawClient second(socket());
  ASSERT_TRUE(first.handshake());
  ASSERT_TRUE(second.handshake());
  const auto made = crafted_rings(4, 80);
  ASSERT_TRUE(all_made(made));
  EXPECT_EQ(first.attach(0, *made[0]), RingStatus::kMapped);
  EXPECT_EQ(first.attach(1, *made[1]), RingStatus::kMapped);
  EXPECT_EQ(second.attach(2, *made[2]), RingStatus::kMapped);
  EXPECT_EQ(second.attach(3, *made[3]), RingStatus::kRefusedLimit);
  EXPECT_EQ(limits_hit("max_rings_per_uid"), 1u);
  json r = rings();
  EXPECT_EQ(r["mapped"], 3) << r.dump();
  EXPECT_EQ(r["refused"], 1) << r.dump();
  first.close();
  EXPECT_TRUE(eventually([&] { return rings()["mapped"] == 1; })) << rings().dump();
  EXPECT_EQ(second.attach(4, *made[3]), RingStatus::kMapped);
  EXPECT_TRUE(second.flush());
  expect_pong();
  // The trainer runs as the same uid: one more ring fits, the rest go on the socket.
  run_trainer_exactly();
  second.close();
  expect_nothing_mapped();
}

// limits.max_rings bounds the rings of all connections together: each keeps a
// descriptor open in the daemon, counted in its open-file limit.
TEST_F(HostileShmRingTest, MaxRingsRefusesTheRingPastItOverAllConnectionsEachHoldingOneDescriptor) {
  ASSERT_NO_FATAL_FAILURE(start("\"max_rings\": 2"));
  RawClient first(socket());
  RawClient second(socket());
  ASSERT_TRUE(first.handshake());
  ASSERT_TRUE(second.handshake());
  CraftedRing a(60), b(61), c(62);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(first.attach(0, a), RingStatus::kMapped);
  EXPECT_EQ(second.attach(1, b), RingStatus::kMapped);
  EXPECT_EQ(hostile_descriptors(daemon_pid()), 2u);
  EXPECT_EQ(second.attach(2, c), RingStatus::kRefusedLimit);
  EXPECT_EQ(limits_hit("max_rings"), 1u);
  EXPECT_EQ(hostile_descriptors(daemon_pid()), 2u) << "the refused ring's descriptor is closed";
  first.close();
  EXPECT_TRUE(eventually([&] { return rings()["mapped"] == 1; })) << rings().dump();
  EXPECT_TRUE(eventually([&] { return hostile_descriptors(daemon_pid()) == 1; }));
  EXPECT_EQ(second.attach(3, c), RingStatus::kMapped);
  expect_pong();
  second.close();
  expect_nothing_mapped();
  EXPECT_EQ(hostile_descriptors(daemon_pid()), 0u);
  // No ring left for the trainer past this daemon's budget of 2: what does not fit goes
  // on the socket, exactly.
  run_trainer_exactly();
}

// The budget per uid is the one that stands between tenants: a uid that fills its own
// leaves every other uid's rings mapped.
TEST_F(HostileShmRingTest, OneUidsFullRingBudgetLeavesAnotherUidsRingsMapped) {
  if (::geteuid() != 0) GTEST_SKIP() << "running the hostile producer as another uid needs root";
  constexpr uid_t kHostileUid = 4242;
  constexpr std::uint64_t kBigCapacity = std::uint64_t{1} << 20;  // 16 MiB of slots
  constexpr std::uint64_t kBigBytes = proto::shm_ring_slot_bytes(kBigCapacity);
  ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
  ASSERT_NO_FATAL_FAILURE(
      start("\"max_ring_bytes_per_uid\": " + std::to_string(std::uint64_t{64} << 20),
            "\"socket_mode\": \"0666\", "));

  int report_pipe[2], hold_pipe[2];
  ASSERT_EQ(::pipe(report_pipe), 0);
  ASSERT_EQ(::pipe(hold_pipe), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The hostile tenant: as uid 4242, rings of 16 MiB until its budget refuses one,
    // then it holds them until the parent is done.
    ::close(report_pipe[0]);
    ::close(hold_pipe[1]);
    if (::setgroups(0, nullptr) != 0 || ::setresgid(kHostileUid, kHostileUid, kHostileUid) != 0 ||
        ::setresuid(kHostileUid, kHostileUid, kHostileUid) != 0) {
      ::_exit(10);
    }
    RawClient c(socket());
    if (!c.handshake()) ::_exit(11);
    std::vector<std::unique_ptr<CraftedRing>> held;
    int mapped = 0;
    for (std::uint32_t i = 0; i < 8; ++i) {
      auto ring = std::make_unique<CraftedRing>(500 + i, kBigCapacity);
      if (!ring->ok()) ::_exit(12);
      const auto status = c.attach(i, *ring);
      if (!status) ::_exit(13);
      if (*status == RingStatus::kRefusedLimit) break;
      if (*status != RingStatus::kMapped) ::_exit(14);
      ++mapped;
      held.push_back(std::move(ring));
    }
    if (::write(report_pipe[1], &mapped, sizeof mapped) != sizeof mapped) ::_exit(15);
    char done = 0;
    if (::read(hold_pipe[0], &done, 1) < 0) ::_exit(16);
    ::_exit(c.flush() ? 0 : 17);
  }
  ::close(report_pipe[1]);
  ::close(hold_pipe[0]);
  int hostile_mapped = -1;
  pollfd p{report_pipe[0], POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 30000), 1) << "the hostile child never reported";
  ASSERT_EQ(::read(report_pipe[0], &hostile_mapped, sizeof hostile_mapped),
            static_cast<ssize_t>(sizeof hostile_mapped));
  EXPECT_EQ(hostile_mapped, 4);  // 4 x 16 MiB of slots fill 64 MiB, a 5th does not fit
  json r = rings();
  EXPECT_EQ(r["mapped"], 4) << r.dump();
  EXPECT_EQ(r["bytes_mapped"], 4 * kBigBytes) << r.dump();
  EXPECT_EQ(limits_hit("max_ring_bytes_per_uid"), 1u);

  // Root, another uid: a ring of the same size maps...
  RawClient other(socket());
  ASSERT_TRUE(other.handshake());
  CraftedRing mine(600, kBigCapacity);
  ASSERT_TRUE(mine.ok());
  EXPECT_EQ(other.attach(1, mine), RingStatus::kMapped);
  // ...and so do the trainer's (4 rings of 4 MiB): none is refused.
  run_trainer_exactly();
  r = rings();
  EXPECT_GT(r["attached"].get<std::uint64_t>(), 4u + 1) << "none of the trainer's" << r.dump();
  EXPECT_EQ(r["refused"], 1) << r.dump();
  EXPECT_EQ(limits_hit("max_ring_bytes_per_uid"), 1u);

  ::close(hold_pipe[1]);  // the child may go
  EXPECT_EQ(wait_or_kill(child, 30000), 0);
  ::close(report_pipe[0]);
  other.close();
  expect_nothing_mapped();
}

// ---- 6. shrinking -------------------------------------------------------------------------

// The daemon maps a ring only when it is sealed F_SEAL_SHRINK: the producer cannot take
// the pages from under the mapping (the SIGBUS a truncated shared file gives its readers).
// What it can do, punch holes, leaves pages that read as zeros: refused records, or a
// head out of range, never a fault.
TEST_F(HostileShmRingTest, ASealedRingCannotShrinkAndPunchedHolesOnlyReadAsZeros) {
  ASSERT_NO_FATAL_FAILURE(start());
  RawClient hostile(socket());
  ASSERT_TRUE(hostile.handshake());
  CraftedRing ring(401, kCapacity, F_SEAL_SHRINK);  // may grow: that hurts no one either
  ASSERT_TRUE(ring.ok());
  ASSERT_EQ(hostile.attach(1, ring), RingStatus::kMapped);
  std::uint64_t ts = 1'000'000;
  ring.publish(pairs(401, kForward, 10, ts));
  ASSERT_TRUE(hostile.flush());
  EXPECT_EQ(rings()["events"], 20);

  errno = 0;
  EXPECT_EQ(::ftruncate(ring.fd(), static_cast<off_t>(kRingBytes - 4096)), -1);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_EQ(::ftruncate(ring.fd(), 0), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(::ftruncate(ring.fd(), static_cast<off_t>(2 * kRingBytes)), 0);
  ring.publish(pairs(401, kForward, 5, ts));
  ASSERT_TRUE(hostile.flush());
  EXPECT_EQ(rings()["events"], 30);
  // The same through a second descriptor of the file (a reopen shares the seals).
  {
    const std::string self = "/proc/self/fd/" + std::to_string(ring.fd());
    const UniqueFd again(::open(self.c_str(), O_RDWR));
    ASSERT_GE(again.get(), 0);
    errno = 0;
    EXPECT_EQ(::ftruncate(again.get(), 4096), -1);
    EXPECT_EQ(errno, EPERM);
  }

  // Holes in the slots: 8 records of zeros (thread 0, kind 0) are refused.
  ASSERT_EQ(::fallocate(ring.fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                        proto::kRingHeaderBytes, static_cast<off_t>(kCapacity * 16)),
            0);
  ring.set_head(ring.head() + 8);
  ASSERT_TRUE(hostile.flush());
  json r = rings();
  EXPECT_EQ(r["events"], 30) << r.dump();
  EXPECT_EQ(r["records_refused"], 8) << r.dump();
  // A hole over the header: the head reads 0, below the daemon's tail: the ring is dropped.
  ASSERT_EQ(::fallocate(ring.fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                        static_cast<off_t>(kRingBytes)),
            0);
  ASSERT_TRUE(hostile.flush());
  r = rings();
  EXPECT_EQ(r["bad_rings"], 1) << r.dump();
  EXPECT_EQ(r["mapped"], 0) << r.dump();
  EXPECT_EQ(process(::getpid())["dropped_by_cause"]["refused"], 8);
  EXPECT_TRUE(daemon_->running());
  expect_pong();
  run_trainer_exactly();
}

}  // namespace
}  // namespace steptrace::testing
