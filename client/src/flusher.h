// The flusher: libsteptrace's one background thread, which moves events from the
// per-thread rings and the ledger queue to steptraced.
//
// Each round (every 1-2 ms; at once when a flush is requested, or when the last round
// left a ring past its high-water mark: the hot path makes no syscall to wake the
// flusher, so high water is noticed by polling, and a busy flusher does not sleep):
// read a clock cutoff, then every ring's published head (acquire), then the custom
// steps registered since the last round, then take the ledger records stamped before
// the cutoff; encode hello (on a new connection), RegisterStep frames, then the events
// up to the heads read with each ledger record placed among its own thread's events in
// recording order (so an annotation always reaches the daemon before the end event
// recorded after it, and after the events recorded before it), timestamps converted to
// CLOCK_MONOTONIC ns here; then Dropped and, when a flush is pending, Flush(seq); and
// ship the batch with one non-blocking send (MSG_NOSIGNAL). A partial write is finished
// in later rounds before anything new is drained, so while the daemon is slow, stopped
// or absent the rings simply fill and trainers drop and count.
//
// Connection: a non-blocking SOCK_STREAM Unix socket; on failure or loss it reconnects
// with exponential backoff (10 ms .. 1 s). Events in frames not fully written when a
// connection breaks are counted as dropped. FlushAck/Error frames are read with
// proto::Decoder(Side::kClient). Nothing here ever blocks a trainer thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "client/src/client_state.h"
#include "proto/codec.h"

namespace steptrace::client {

inline constexpr std::size_t kBatchBytes = 512 * 1024;

// Opens a non-blocking, close-on-exec stream socket connected to `path`. 0 and the fd
// in `fd`, or -errno.
int connect_unix_socket(const std::string& path, int& fd);

class Flusher {
 public:
  // `fd` is an already connected socket, or -1 to connect in the background.
  Flusher(ClientState& state, std::string socket_path, int fd);
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
  void on_connected(int fd);
  void close_connection();
  void read_socket();
  void send_pending();
  // Builds the next batch into buf_; true when more is waiting right away.
  bool build_batch();
  int poll_timeout_ms(bool busy) const;

  ClientState& s_;
  const std::string path_;
  int fd_ = -1;
  std::thread thread_;
  std::atomic<bool> stop_{false};

  // Connection state (flusher thread only).
  std::optional<proto::Decoder> decoder_;
  bool need_hello_ = false;
  std::uint32_t steps_sent_ = 0;
  std::uint64_t dropped_sent_ = 0;
  bool dropped_ever_sent_ = false;
  std::uint64_t flush_sent_ = 0;
  Clock::time_point connected_at_{};
  Clock::time_point next_attempt_{};
  std::chrono::milliseconds backoff_{10};
  bool retry_now_ = false;
  bool last_round_sent_events_ = false;
  Clock::time_point last_anchor_{};

  // The batch being sent: buf_[off_, len_) is still unsent; marks_ says which events
  // each frame carries so losses can be counted.
  struct FrameMark {
    std::size_t end;
    std::uint32_t events;
  };
  std::vector<std::byte> buf_;
  std::size_t len_ = 0;
  std::size_t off_ = 0;
  std::vector<FrameMark> marks_;
  std::vector<std::uint64_t> heads_;
  std::vector<proto::LedgerRecord> ledger_;
  std::vector<std::size_t> ledger_ring_;  // ring index per ledger_ record, SIZE_MAX: none
};

}  // namespace steptrace::client
