#include "daemon/serve/shared_rings.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "daemon/state/saturating.h"

namespace steptrace::daemon {
namespace {

// Records copied out of a ring per chunk (128 KiB): one or two preads each.
constexpr std::size_t kChunkRecords = 8192;

bool read_exactly(int fd, const iovec& part, off_t offset) {
  auto* at = static_cast<std::byte*>(part.iov_base);
  std::size_t left = part.iov_len;
  while (left > 0) {
    const ssize_t got = ::pread(fd, at, left, offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    at += got;
    left -= static_cast<std::size_t>(got);
    offset += got;
  }
  return true;
}

}  // namespace

SharedRings::SharedRings(const ServerLimits& limits, RingBudget& budget, std::uint32_t uid)
    : limits_(limits), budget_(budget), uid_(uid) {}

SharedRings::~SharedRings() {
  while (!rings_.empty()) unmap(rings_.size() - 1);
}

proto::RingStatus SharedRings::attach(const proto::RingAttach& attach, int fd,
                                      std::optional<LimitKind>& limit) {
  struct Closer {
    int fd;
    ~Closer() {
      if (fd >= 0) ::close(fd);
    }
  } closer{fd};
  if (fd < 0) return proto::RingStatus::kRefusedFd;
  const std::uint64_t size = proto::shm_ring_bytes(attach.capacity);
  const std::uint64_t charge = proto::shm_ring_slot_bytes(attach.capacity);
  // Budgets first: a refusal for size costs no system call.
  const auto uid_bytes = budget_.bytes_by_uid.find(uid_);
  const auto uid_rings = budget_.rings_by_uid.find(uid_);
  const std::uint64_t by_uid = uid_bytes == budget_.bytes_by_uid.end() ? 0 : uid_bytes->second;
  const std::uint64_t rings_of_uid =
      uid_rings == budget_.rings_by_uid.end() ? 0 : uid_rings->second;
  if (budget_.rings >= limits_.max_rings) {
    limit = LimitKind::kMaxRings;
  } else if (rings_.size() >= limits_.max_rings_per_process) {
    limit = LimitKind::kMaxRingsPerProcess;
  } else if (rings_of_uid >= limits_.max_rings_per_uid) {
    limit = LimitKind::kMaxRingsPerUid;
  } else if (bytes_ + charge > limits_.max_ring_bytes_per_process) {
    limit = LimitKind::kMaxRingBytesPerProcess;
  } else if (by_uid + charge > limits_.max_ring_bytes_per_uid) {
    limit = LimitKind::kMaxRingBytesPerUid;
  }
  if (limit) return proto::RingStatus::kRefusedLimit;
  // A memfd sealed against shrinking (so a mapping can never fault), of exactly the
  // stated size; anything else (a socket, a pipe, a file, an unsealed memfd) is refused.
  struct stat st {};
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || seals < 0 || (seals & F_SEAL_SHRINK) == 0 ||
      static_cast<std::uint64_t>(st.st_size) != size) {
    return proto::RingStatus::kRefusedFd;
  }
  // Only the header is mapped (written by the producer when it made the ring, so reading
  // it commits nothing new); the slots are read with pread, which reads a hole the
  // producer never wrote as zeros without allocating it (a mapping's read fault would,
  // charged to the daemon).
  void* p = ::mmap(nullptr, proto::kRingHeaderBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return proto::RingStatus::kRefusedFd;
  // The header must say what the frame says (a later layout is refused, not misread). A
  // spare ring (thread 0, version 8) may already name the thread that claimed it.
  auto* header = static_cast<proto::RingHeader*>(p);
  const std::uint32_t header_thread =
      proto::ring_thread_field(*header).load(std::memory_order_acquire);
  if (header->magic != proto::kRingMagic || header->layout_version != proto::kRingLayoutVersion ||
      header->capacity != attach.capacity ||
      (attach.thread_id != 0 && header_thread != attach.thread_id)) {
    ::munmap(p, proto::kRingHeaderBytes);
    return proto::RingStatus::kRefusedFd;
  }
  ::madvise(p, proto::kRingHeaderBytes, MADV_DONTDUMP);  // no client memory in our core
  Ring ring;
  ring.ring_id = attach.ring_id;
  ring.thread_id = attach.thread_id;
  ring.capacity = attach.capacity;
  ring.header = static_cast<proto::RingHeader*>(p);
  ring.fd = std::exchange(closer.fd, -1);  // kept for the reads; counted in max_rings
  ring.charged = charge;
  proto::ring_field(ring.header->consumer_pid)
      .store(static_cast<std::uint64_t>(::getpid()), std::memory_order_release);
  // Where the previous consumer stopped (the library's flusher, or a daemon before a
  // restart). Checked against head at every pass like everything else read here.
  ring.tail = proto::ring_field(ring.header->tail).load(std::memory_order_acquire);
  read_drops(ring);
  rings_.push_back(ring);
  bytes_ += charge;
  charge_uid(1, static_cast<std::int64_t>(charge));
  return proto::RingStatus::kMapped;
}

void SharedRings::charge_uid(std::int64_t rings, std::int64_t bytes) {
  auto add = [&](std::map<std::uint32_t, std::uint64_t>& by_uid, std::uint64_t& total,
                 std::int64_t n) {
    std::uint64_t& mine = by_uid[uid_];
    mine = static_cast<std::uint64_t>(static_cast<std::int64_t>(mine) + n);
    total = static_cast<std::uint64_t>(static_cast<std::int64_t>(total) + n);
    if (mine == 0) by_uid.erase(uid_);
  };
  add(budget_.rings_by_uid, budget_.rings, rings);
  add(budget_.bytes_by_uid, budget_.bytes, bytes);
}

void SharedRings::learn_thread(Ring& ring) {
  // The claiming thread stores its id before it publishes its first record (release), so
  // after a head load (acquire) that shows a record this load sees the id. Kept once not
  // 0: the producer cannot change a ring's thread afterwards (PROTOCOL.md 11.5).
  [[maybe_unused]] const std::uint64_t head =
      proto::ring_field(ring.header->head).load(std::memory_order_acquire);
  ring.thread_id = proto::ring_thread_field(*ring.header).load(std::memory_order_acquire);
}

void SharedRings::read_drops(Ring& ring) {
  ring.dropped_full =
      std::max(ring.dropped_full,
               proto::ring_field(ring.header->dropped_buffer_full).load(std::memory_order_relaxed));
  ring.dropped_unconnected = std::max(
      ring.dropped_unconnected,
      proto::ring_field(ring.header->dropped_not_connected).load(std::memory_order_relaxed));
}

void SharedRings::unmap(std::size_t index) {
  Ring& ring = rings_[index];
  retired_full_ = saturating_add(retired_full_, ring.dropped_full);
  retired_unconnected_ = saturating_add(retired_unconnected_, ring.dropped_unconnected);
  // Done with it: the library may read it itself or offer it again (unless a newer
  // consumer claimed it meanwhile).
  std::uint64_t mine = static_cast<std::uint64_t>(::getpid());
  proto::ring_field(ring.header->consumer_pid)
      .compare_exchange_strong(mine, 0, std::memory_order_release, std::memory_order_relaxed);
  ::munmap(ring.header, proto::kRingHeaderBytes);
  ::close(ring.fd);
  bytes_ -= ring.charged;
  charge_uid(-1, -static_cast<std::int64_t>(ring.charged));
  rings_.erase(rings_.begin() + static_cast<std::ptrdiff_t>(index));
}

proto::DroppedByCause SharedRings::drops() const {
  proto::DroppedByCause d{};
  std::uint64_t full = retired_full_;
  std::uint64_t unconnected = retired_unconnected_;
  for (const Ring& ring : rings_) {
    full = saturating_add(full, ring.dropped_full);
    unconnected = saturating_add(unconnected, ring.dropped_unconnected);
  }
  d.count[static_cast<std::size_t>(proto::DropCause::kBufferFull)] = full;
  d.count[static_cast<std::size_t>(proto::DropCause::kNotConnected)] = unconnected;
  return d;
}

SharedRings::Drained SharedRings::drain(Collector& collector, ProcessHandle process, Pass pass,
                                        std::optional<std::uint32_t> thread,
                                        std::uint64_t until_ns) {
  Drained out;
  for (std::size_t i = 0; i < rings_.size();) {
    Ring& ring = rings_[i];
    if (thread && ring.thread_id == 0) learn_thread(ring);
    if ((thread && ring.thread_id != *thread) ||
        (pass == Pass::kLive && ring.waiting_since == registrations_)) {
      ++i;
      continue;
    }
    // The orphaned flag is read before the head: a producer sets it after its last push.
    const bool orphaned =
        proto::ring_field(ring.header->orphaned).load(std::memory_order_acquire) != 0;
    if (!drain_ring(ring, collector, process, pass, until_ns, out)) {
      ++out.bad_rings;
      unmap(i);
      continue;
    }
    read_drops(ring);
    const bool empty =
        proto::ring_field(ring.header->head).load(std::memory_order_acquire) == ring.tail;
    // The thread is gone and everything it wrote is folded; at the last pass every ring goes.
    if ((orphaned && empty) || pass != Pass::kLive) {
      unmap(i);
      continue;
    }
    ++i;
  }
  return out;
}

bool SharedRings::drain_ring(Ring& ring, Collector& collector, ProcessHandle process, Pass pass,
                             std::uint64_t until_ns, Drained& out) {
  const std::uint64_t head = proto::ring_field(ring.header->head).load(std::memory_order_acquire);
  if (head - ring.tail > ring.capacity) return false;  // also head < tail (wraps)
  if (ring.thread_id == 0) learn_thread(ring);         // after the head: its records' thread
  ring.waiting_since = UINT64_MAX;
  const std::uint64_t mask = ring.capacity - 1;
  copy_.resize(kChunkRecords);
  while (ring.tail != head) {
    const std::size_t n =
        static_cast<std::size_t>(std::min<std::uint64_t>(head - ring.tail, kChunkRecords));
    // Copy first, then look: the producer may rewrite the slots meanwhile.
    const std::size_t first = static_cast<std::size_t>(ring.tail & mask);
    const std::size_t run =
        std::min<std::size_t>(n, static_cast<std::size_t>(ring.capacity) - first);
    std::array<iovec, 2> parts{{{copy_.data(), run * sizeof(proto::EventRecord)},
                                {copy_.data() + run, (n - run) * sizeof(proto::EventRecord)}}};
    const auto slot_offset = [](std::size_t slot) {
      return static_cast<off_t>(proto::kRingHeaderBytes + slot * sizeof(proto::EventRecord));
    };
    // Sealed against shrinking and of the checked size: a short read cannot happen, and
    // is taken for a bad ring if it does.
    if (!read_exactly(ring.fd, parts[0], slot_offset(first)) ||
        (run < n && !read_exactly(ring.fd, parts[1], slot_offset(0)))) {
      return false;
    }
    // Validate and convert in place, compacting the good records to the front; stop at
    // the first one that must wait (unregistered step, or past until_ns).
    std::size_t good = 0;
    std::size_t taken = 0;
    for (; taken < n; ++taken) {
      proto::EventRecord e = copy_[taken];
      const bool valid = e.reserved == 0 && e.thread_id == ring.thread_id && e.thread_id != 0 &&
                         (e.kind == static_cast<std::uint8_t>(proto::EventKind::kStart) ||
                          e.kind == static_cast<std::uint8_t>(proto::EventKind::kEnd)) &&
                         proto::is_valid_step(e.step);
      if (!valid) {
        ++out.refused;
        continue;
      }
      e.timestamp_ns = proto::ticks_to_ns(clock_, e.timestamp_ns);
      if (e.timestamp_ns > until_ns) break;
      if (!collector.step_known(process, e.step)) {
        if (pass != Pass::kFinal) {  // its RegisterStep is on its way (to us, or the next)
          ring.waiting_since = registrations_;
          break;
        }
        ++out.refused;
        continue;
      }
      copy_[good++] = e;
    }
    if (good > 0) {
      collector.events(process,
                       proto::EventSpan(reinterpret_cast<const std::byte*>(copy_.data()), good));
      out.events += good;
    }
    ring.tail += taken;
    proto::ring_field(ring.header->tail).store(ring.tail, std::memory_order_release);
    if (taken < n) break;  // waits: for a registration, or for its ledger record
  }
  return true;
}

}  // namespace steptrace::daemon
