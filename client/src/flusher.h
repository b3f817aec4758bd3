// The flusher: libsteptrace's one background thread, which moves events from the
// per-thread rings and the ledger queue to steptraced.
//
// Each round (every 1-2 ms, or every 20 ms while the daemon reads every ring itself and
// nothing waits here; at once when a flush is requested, a ring is made, a custom step is
// registered or a ledger record queued, when a ring reaches its
// high-water mark (the producer writes the wake eventfd once per such episode, see
// event_ring.h), or when the last round left work behind: a busy flusher does not
// sleep): read a clock cutoff, then every ring's published head (acquire), then the
// custom steps registered since the last round, then take the ledger records stamped
// before the cutoff; encode RegisterStep frames, then the events up to the heads read
// with each ledger record placed among its own thread's events in recording order (so
// an annotation always reaches the daemon before the end event recorded after it, and
// after the events recorded before it), timestamps converted to CLOCK_MONOTONIC ns
// here; then the drop counts (DroppedByCause, or Dropped on a version-1 connection) when
// they changed and, when a flush is pending and everything was taken, Flush(seq); and
// ship the batch (up to kBatchBytes) with one non-blocking send (MSG_NOSIGNAL). When the
// batch is full the rest waits for the next round, which starts with the ring after the
// one that did not fit (round robin, so no thread starves); a ledger record whose
// earlier events did not fit waits with them. A partial write is finished in later
// rounds before anything new is drained, so while the daemon is slow, stopped or absent
// the rings simply fill and trainers drop and count.
//
// Connection: a non-blocking SOCK_STREAM Unix socket; on failure or loss it reconnects
// with exponential backoff (10 ms .. 1 s). The flusher ends the hello, and every batch
// that carries events or ledger records, with a Flush of its own (sequence with
// kOwnFlushBit set; steptrace_flush callers never see those acks). A new connection
// carries nothing else until the hello's FlushAck proves the daemon accepted it, so
// nothing is written to a connection the daemon refuses. A batch's events count as
// delivered once its FlushAck arrives: when the daemon ends a connection (or it
// fails), the events of every batch not yet acknowledged (written or not) are counted
// as dropped (in_flight); when the flusher closes it (stop), only those in frames not
// completely written, since the daemon reads the rest before it sees the end. A
// hello refused with ErrorCode::kUnsupportedVersion makes every later connection of the
// process speak version 1 (hello version 1, Dropped instead of DroppedByCause). A
// steptrace_flush while disconnected gets one immediate connection attempt; when it
// fails the call returns -ENOTCONN at once. FlushAck/Error frames are read with
// proto::Decoder(Side::kClient). Nothing here ever blocks a trainer thread.
//
// Resend (protocol version 7): each batch that carries events or ledger records starts
// with a Batch frame numbering it for the process (1, 2, ... across connections) and
// counting its frames up to its own Flush; the flusher keeps a copy of it until its
// FlushAck. When the daemon ends the connection without an Error (a restart, a crash, a
// reset), the batches not acknowledged are not counted as dropped: the next connection
// re-registers the custom steps and sends them again, oldest first, before anything new;
// the daemon skips the frames it applied before (PROTOCOL.md 4.7d). What waits for
// resending is bounded (kMaxRetainedBytes: no new batch is built past it, the rings fill
// and count drops as with a slow daemon); it is counted as dropped (in_flight) when the
// daemon refuses the connection with an Error, when the next connection speaks an
// earlier version, or when the process stops before a daemon took it.
//
// First contact: the first failed connection attempt of the process (whoever started
// the flusher: steptrace_connect or the auto-connect) prints one line on stderr naming
// the path and the likely fix (first_contact_notice), never again in the process, and
// not with STEPTRACE_QUIET=1 (ClientState::quiet).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "client/src/client_state.h"
#include "client/src/thread_owner.h"
#include "proto/codec.h"
#include "proto/unique_fd.h"

namespace steptrace::client {

inline constexpr std::size_t kBatchBytes = 1024 * 1024;
// Batches kept for resending (protocol version 7), acknowledged or not yet written.
inline constexpr std::size_t kMaxRetainedBytes = 8 * kBatchBytes;
// Set in the sequence of the flusher's own Flush frames (after the hello, after batches).
inline constexpr std::uint64_t kOwnFlushBit = std::uint64_t{1} << 63;

// Opens a non-blocking, close-on-exec stream socket connected to `path`. 0 and the socket
// in `fd`, or -errno (`fd` unchanged).
int connect_unix_socket(const std::string& path, proto::UniqueFd& fd);

// The one-line stderr notice (with its newline) the flusher prints, once per process
// and unless STEPTRACE_QUIET=1, when its first connection attempt fails with `error`.
std::string first_contact_notice(const std::string& path, int error);

class Flusher {
 public:
  // `fd` is an already connected socket, or none to connect in the background.
  Flusher(ClientState& state, std::string socket_path, proto::UniqueFd fd);
  ~Flusher();  // stops and joins
  Flusher(const Flusher&) = delete;
  Flusher& operator=(const Flusher&) = delete;

  void start();
  void stop();
  const std::string& socket_path() const { return path_; }
  // Fork child: the thread does not exist here; close the inherited socket and never
  // touch this object again (it is leaked on purpose, its state may be mid-update).
  void abandon_after_fork() noexcept;
  Flusher* next_abandoned = nullptr;

 private:
  using Clock = std::chrono::steady_clock;

  void run();
  void try_connect();
  void on_connected(proto::UniqueFd fd);
  enum class Close : std::uint8_t {
    kLost,     // the daemon ended the connection (or it failed): resend what it did not ack
    kRefused,  // the daemon sent an Error: what it did not ack is dropped
    kHere,     // this side closes it (stop): the daemon still reads everything written
  };
  void close_connection(Close how = Close::kLost);
  void read_socket();
  void send_pending();
  // Protocol version 5: offers the rings nobody consumes yet to the daemon (a RingAttach
  // with the memfd, after a ClockSync). False when the socket is full.
  void offer_rings();
  // Version 8: keeps kSpareRings unclaimed rings (thread 0) for offer_rings to offer, so
  // that a new thread takes one the daemon already maps (Client::create_ring). Called
  // every round, it takes the registry's lock only when something it depends on may have
  // changed since its last pass (spares_due_, spares_taken_seen_, budget_seen_).
  void keep_spares();
  // No spares for spares_backoff_ (a memfd failed, or the daemon refused one); a pass
  // comes once the pause is over.
  void pause_spares();
  // The RingAck of an offer: the daemon consumes the ring from now on, or refused it.
  void ring_answered(const proto::RingAck& ack);
  // Every ring back to the flusher (a new connection, or the daemon is gone).
  void unshare_rings();
  bool shm_connection() const { return version_ >= proto::kShmProtocolVersion && s_.shm_rings; }
  // Builds the next batch into buf_; true when more is waiting right away.
  bool build_batch();
  // Version 7, a new connection: the custom steps, then the oldest batch to resend, into
  // buf_ (one per call).
  void build_resend();
  // Turns the Batch frame reserved at batch_begin_ into the batch's (numbered, its frames
  // counted up to batch_end_) and keeps a copy for resending; or removes it when the
  // batch carries no record.
  void seal_batch();
  // Counts what waits for resending as dropped (in_flight) and forgets it.
  void drop_resend();
  // build_batch's steps, over one round (flusher.cpp). The _locked ones require
  // RingRegistry::mu and use heads_, the rings' published heads read under it.
  struct Round;
  // The handshake: hello, identity, and the Flush nothing else goes before the ack of.
  void encode_hello(proto::Encoder& enc);
  // ledger_: the records carried over from the last round first (they are older), then
  // the queue's stamped before `cutoff`; while many are carried the queue waits (it
  // stays bounded and drops when full).
  void take_ledger(Round& round, std::uint64_t cutoff);
  // Each annotation goes between its own thread's events, in recording order: ledger_ring_
  // says whose ring; those of threads without a ring (or one the daemon maps) go first.
  void place_ledger_locked(Round& round);
  void send_ledger(Round& round, proto::LedgerRecord record);
  // Round robin over the rings, from the one after the ring the last round could not
  // finish: notes the shared ones, drains this side's.
  void drain_rings_locked(Round& round);
  // Ring `i` (this side consumes it): its events up to its head, each of its ledger
  // records among them, as far as they fit; frees what was taken.
  void drain_ring_locked(Round& round, std::size_t i);
  // Encodes ring events [pos, end) while they fit beside the reserved ledger frames.
  void send_events(Round& round, EventRing& ring, std::uint64_t& pos, std::uint64_t end);
  // After the events: the drop counts when they changed, the own Flush that acknowledges
  // the batch (or nudges the daemon), a caller's Flush when everything was taken.
  void encode_tail_locked(Round& round, std::uint64_t flush_seq);
  // Requires RingRegistry::mu. Frees the rings of exited threads that hold nothing and
  // that no daemon reads any more. While connected the others wait to be drained (and a
  // ring offered on this connection for its RingAck); while not, only the newest
  // kMaxOrphanRings keep their events: older ones are freed, their events counted as
  // dropped (not_connected), so memory stays bounded while nobody drains.
  void free_orphans_locked();
  std::uint64_t next_own_flush() { return kOwnFlushBit | ++own_flushes_; }
  int poll_timeout_ms(bool busy) const;

  ClientState& s_;
  const std::string path_;
  proto::UniqueFd fd_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  // The thread running run(): while it runs, the connection state below and
  // ClientState::converter are its alone (asserted in debug builds).
  ThreadOwner thread_owner_;

  // Connection state (flusher thread only; the constructor and destructor, which run
  // while no flusher thread does, set it up and close it).
  std::optional<proto::Decoder> decoder_;
  std::uint16_t version_ = proto::kProtocolVersion;  // of this connection's hello
  bool need_hello_ = false;
  bool accepted_ = false;  // the Flush after the hello was acknowledged
  // No spare ring is made before spares_resume_ (a memfd failed, or one was refused);
  // the next pause lasts spares_backoff_.
  Clock::time_point spares_resume_{};
  std::chrono::milliseconds spares_backoff_{1000};
  // What keep_spares's last pass saw. Another pass is due on a new connection and after a
  // pause (spares_due_), when a thread took a spare (RingRegistry::spares_taken), or when
  // ring bytes came back to the budget or its sizes changed (RingRegistry::budget_epoch):
  // nothing else changes how many spares it can or should make.
  bool spares_due_ = true;
  std::uint64_t spares_taken_seen_ = 0;
  std::uint64_t budget_seen_ = 0;
  std::uint64_t own_flushes_ = 0;  // own Flush frames sent so far (all connections)
  std::uint64_t hello_flush_ = 0;  // the sequence of this connection's first one
  std::uint32_t steps_sent_ = 0;
  proto::DroppedByCause dropped_sent_{};
  bool resend_dropped_ = false;  // once per connection, when anything was ever dropped
  std::uint64_t flush_sent_ = 0;
  Clock::time_point connected_at_{};
  Clock::time_point next_attempt_{};
  std::chrono::milliseconds backoff_{10};
  std::uint64_t flush_attempted_ = 0;  // last flush sequence a connection attempt was made for
  bool last_round_sent_events_ = false;
  std::size_t next_ring_ = 0;  // the ring the next round starts with
  bool clock_dirty_ = true;    // re-anchored since the last ClockSync sent
  // The last round found every ring read by the daemon and nothing waiting: the flusher
  // sleeps kQuietPollMs unless woken (a flush, a new ring or step, a ledger record, a
  // shared ring at its high-water mark all wake it).
  bool quiet_ = false;
  // The own Flush sent to make the daemon drain a shared ring at its high-water mark,
  // until acknowledged (0: none out): no other nudge goes before.
  std::uint64_t nudge_flush_ = 0;
  Clock::time_point last_anchor_{};

  // The batch being sent: buf_[off_, len_) is still unsent; it carries batch_records_
  // events and ledger records, acknowledged by the own Flush batch_flush_ at its end;
  // marks_ says which records each of its frames carries.
  std::vector<std::byte> buf_;
  std::size_t len_ = 0;
  std::size_t off_ = 0;
  std::uint64_t batch_records_ = 0;
  std::uint64_t batch_events_ = 0;  // of batch_records_, the events (not ledger records)
  struct FrameMark {
    std::size_t end;
    std::uint32_t records;
  };
  std::vector<FrameMark> marks_;
  std::uint64_t batch_flush_ = 0;
  // Batches written completely but not yet acknowledged, oldest first; on a version-7
  // connection with their bytes (Batch frame .. own Flush) and the marks_ of their frames
  // (offsets from the Batch frame), to resend.
  struct Unacked {
    std::uint64_t flush;
    std::uint64_t records;
    std::uint64_t events;  // delivered once acknowledged (RingRegistry::delivered)
    std::vector<std::byte> bytes{};
    std::vector<FrameMark> marks{};
  };
  std::deque<Unacked> unacked_;
  // Version 7: the batch in buf_ (its copy), those to resend on the next connection, the
  // bytes both and unacked_ hold, and the last batch number given.
  bool numbered_ = false;        // this connection numbers its batches
  std::size_t batch_begin_ = 0;  // the Batch frame's offset in buf_ (SIZE_MAX: none)
  std::size_t batch_end_ = 0;    // the end of the batch's own Flush
  Unacked current_{};
  std::deque<Unacked> resend_;
  std::size_t retained_bytes_ = 0;
  std::vector<std::vector<std::byte>> spare_;  // buffers of acknowledged batches, reused
  std::vector<std::uint64_t> heads_;
  std::vector<proto::LedgerRecord> ledger_;
  std::vector<proto::LedgerRecord> taken_;    // this round's from the queue
  std::vector<proto::LedgerRecord> carried_;  // left for the next round, in order
  std::vector<std::size_t> ledger_ring_;      // ring index per ledger_ record, SIZE_MAX: none
};

}  // namespace steptrace::client
