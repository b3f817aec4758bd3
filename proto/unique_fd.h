// A file descriptor with one owner: closed when the owner is destroyed or reset, moved,
// never copied (as std::unique_ptr is to new/delete). Used by the client library (its
// socket, wake eventfd) and the daemon (snapshot files, /proc probes).
//
// close(2) is called once and never retried on EINTR: Linux releases the descriptor
// even then, and a retry could close a number another thread has been given since.
// The destructor and reset() ignore close()'s result; close() reports it.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <utility>

namespace steptrace::proto {

class UniqueFd {
 public:
  UniqueFd() noexcept = default;
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const noexcept { return fd_; }
  bool valid() const noexcept { return fd_ >= 0; }
  explicit operator bool() const noexcept { return valid(); }
  // Gives up ownership: the caller closes the returned descriptor.
  int release() noexcept { return std::exchange(fd_, -1); }
  // Closes the descriptor held, if any, and holds `fd` instead.
  void reset(int fd = -1) noexcept {
    const int old = std::exchange(fd_, fd);
    if (old >= 0) ::close(old);
  }
  // Closes now and reports close()'s error (e.g. a write error NFS reports only here);
  // the owner is empty afterwards either way. An empty owner: EBADF.
  std::error_code close() noexcept {
    const int fd = release();
    if (::close(fd) == 0) return {};
    return {errno, std::system_category()};
  }

 private:
  int fd_ = -1;
};

}  // namespace steptrace::proto
