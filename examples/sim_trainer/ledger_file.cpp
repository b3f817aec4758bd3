#include "ledger_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <sstream>

namespace sim {

std::uint64_t LedgerContents::reserved_bytes(const std::string& gpu) const {
  std::uint64_t sum = 0;
  for (const auto& e : entries) {
    if (e.gpu == gpu) sum += e.bytes;
  }
  return sum;
}

std::error_code parse_ledger(const std::string& text, LedgerContents& out, std::string& error) {
  out = LedgerContents{};
  std::istringstream in(text);
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::string first;
    fields >> first;
    std::string rest;
    if (first == "next") {
      if (!(fields >> out.next_id) || out.next_id == 0 || (fields >> rest)) {
        error = "line " + std::to_string(number) + ": expected `next ID`, got `" + line + "`";
        return std::make_error_code(std::errc::invalid_argument);
      }
      continue;
    }
    LedgerEntry e;
    std::istringstream entry(line);
    long long pid = 0;
    if (!(entry >> e.id >> pid >> e.bytes >> e.gpu >> e.task) || (entry >> rest) || e.id == 0 ||
        pid <= 0 || e.bytes == 0) {
      error = "line " + std::to_string(number) + ": expected `id pid bytes gpu task`, got `" +
              line + "`";
      return std::make_error_code(std::errc::invalid_argument);
    }
    e.pid = static_cast<pid_t>(pid);
    if (e.id >= out.next_id) out.next_id = e.id + 1;
    out.entries.push_back(std::move(e));
  }
  return {};
}

std::string format_ledger(const LedgerContents& contents) {
  std::ostringstream out;
  out << "# sim_trainer VRAM ledger: one reservation per line: id pid bytes gpu task\n";
  out << "next " << contents.next_id << "\n";
  for (const auto& e : contents.entries) {
    out << e.id << ' ' << e.pid << ' ' << e.bytes << ' ' << e.gpu << ' ' << e.task << "\n";
  }
  return out.str();
}

LockedLedger::~LockedLedger() { unlock(); }

std::error_code LockedLedger::lock(const std::string& path, std::string& error) {
  unlock();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    const std::error_code ec(errno, std::system_category());
    error = "cannot open ledger file " + path + ": " + ec.message();
    return ec;
  }
  while (::flock(fd_, LOCK_EX) != 0) {
    if (errno == EINTR) continue;
    const std::error_code ec(errno, std::system_category());
    error = "cannot lock ledger file " + path + ": " + ec.message();
    unlock();
    return ec;
  }
  std::string text;
  char buf[4096];
  for (off_t offset = 0;;) {
    const ssize_t n = ::pread(fd_, buf, sizeof buf, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::error_code ec(errno, std::system_category());
      error = "cannot read ledger file " + path + ": " + ec.message();
      unlock();
      return ec;
    }
    if (n == 0) break;
    text.append(buf, static_cast<std::size_t>(n));
    offset += n;
  }
  if (auto ec = parse_ledger(text, contents_, error)) {
    error = "ledger file " + path + ": " + error;
    unlock();
    return ec;
  }
  return {};
}

std::error_code LockedLedger::write() {
  const std::string text = format_ledger(contents_);
  if (::ftruncate(fd_, 0) != 0) return {errno, std::system_category()};
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n =
        ::pwrite(fd_, text.data() + done, text.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return {errno, std::system_category()};
    if (n == 0) return std::make_error_code(std::errc::io_error);
    done += static_cast<std::size_t>(n);
  }
  return {};
}

void LockedLedger::unlock() {
  if (fd_ >= 0) ::close(fd_);  // closing the only descriptor drops the flock
  fd_ = -1;
}

bool pid_is_dead(pid_t pid) { return ::kill(pid, 0) != 0 && errno == ESRCH; }

}  // namespace sim
