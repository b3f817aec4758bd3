// The simulated trainers' shared VRAM ledger: a small text file that every worker reads
// and rewrites under an exclusive flock(), the way real trainers sharing one GPU
// coordinate. One file serves every GPU of the machine: one reservation per line,
// `id pid bytes gpu task`, plus a `next ID` line that hands out reservation ids. This is the
// trainers' own bookkeeping; the steptrace daemon only sees it through the ledger annotations the
// workers send while they edit it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <system_error>
#include <vector>

namespace sim {

struct LedgerEntry {
  std::uint64_t id = 0;
  pid_t pid = 0;
  std::uint64_t bytes = 0;
  std::string gpu;   // GPU UUID, one word
  std::string task;  // one word
};

struct LedgerContents {
  std::uint64_t next_id = 1;
  std::vector<LedgerEntry> entries;

  // Bytes reserved on `gpu`.
  std::uint64_t reserved_bytes(const std::string& gpu) const;
};

// Parses the file format; on error returns a message naming the bad line.
std::error_code parse_ledger(const std::string& text, LedgerContents& out, std::string& error);
std::string format_ledger(const LedgerContents& contents);

// The ledger file, locked exclusively (flock) from lock() until unlock() or destruction.
class LockedLedger {
 public:
  LockedLedger() = default;
  ~LockedLedger();
  LockedLedger(const LockedLedger&) = delete;
  LockedLedger& operator=(const LockedLedger&) = delete;

  // Opens (creating it) and locks `path`, then reads it into contents().
  std::error_code lock(const std::string& path, std::string& error);
  // Replaces the file's text with contents().
  std::error_code write();
  void unlock();

  LedgerContents& contents() { return contents_; }

 private:
  int fd_ = -1;
  LedgerContents contents_;
};

// True when `pid` no longer exists (kill(pid, 0) fails with ESRCH). A zombie still
// exists until its parent reaps it.
bool pid_is_dead(pid_t pid);

}  // namespace sim
