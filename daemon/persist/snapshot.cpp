#include "daemon/persist/snapshot.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "proto/unique_fd.h"

namespace steptrace::daemon {
namespace {

std::error_code last_error() { return {errno, std::system_category()}; }

// Writes all of `data` to `fd`, retrying short writes and EINTR.
std::error_code write_all(int fd, const std::string& data) {
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return last_error();
    }
    done += static_cast<std::size_t>(n);
  }
  return {};
}

std::string octal_mode(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

// The directory open as `dir_fd` is one only this process's user can write to.
std::optional<std::string> check_private(int dir_fd, const std::filesystem::path& dir) {
  struct stat st {};
  if (::fstat(dir_fd, &st) != 0)
    return "cannot stat " + dir.string() + ": " + last_error().message();
  if (!S_ISDIR(st.st_mode)) return dir.string() + " is not a directory";
  if (st.st_uid != ::geteuid()) {
    return dir.string() + " is owned by uid " + std::to_string(st.st_uid) + ", not by uid " +
           std::to_string(::geteuid()) + " that steptraced runs as";
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return dir.string() + " is writable by its group or others (mode " + octal_mode(st.st_mode) +
           "); chmod go-w it";
  }
  return std::nullopt;
}

std::error_code fsync_dir(const std::filesystem::path& dir) {
  const proto::UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) return last_error();
  if (::fsync(fd.get()) != 0) return last_error();  // errno read before fd closes
  return {};
}

}  // namespace

std::error_code save_snapshot(const std::filesystem::path& dir, const nlohmann::json& doc) {
  std::string text;
  try {
    // Replace invalid UTF-8 rather than throw: comm and names are validated ASCII, but
    // a snapshot must never take the daemon down.
    text = doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  } catch (const std::exception&) {
    return std::make_error_code(std::errc::invalid_argument);
  }
  text.push_back('\n');
  const std::string tmp = std::string(kSnapshotFileName) + ".tmp";
  // Everything below goes through the directory's descriptor: no path is looked up twice.
  const proto::UniqueFd dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir_fd) return last_error();
  if (check_private(dir_fd.get(), dir)) return std::make_error_code(std::errc::permission_denied);
  // O_EXCL | O_NOFOLLOW: never write through a link or into a file someone else made. A
  // leftover (a crash between create and rename, or a planted link) is removed first:
  // unlinkat removes the link itself, never what it points to.
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
  int raw = ::openat(dir_fd.get(), tmp.c_str(), flags, 0600);
  if (raw < 0 && errno == EEXIST && ::unlinkat(dir_fd.get(), tmp.c_str(), 0) == 0) {
    raw = ::openat(dir_fd.get(), tmp.c_str(), flags, 0600);
  }
  if (raw < 0) return last_error();
  proto::UniqueFd fd(raw);
  std::error_code ec = write_all(fd.get(), text);
  if (!ec && ::fsync(fd.get()) != 0) ec = last_error();
  if (const auto close_ec = fd.close(); close_ec && !ec) ec = close_ec;
  if (!ec && ::renameat(dir_fd.get(), tmp.c_str(), dir_fd.get(), kSnapshotFileName) != 0) {
    ec = last_error();
  }
  if (ec) {
    ::unlinkat(dir_fd.get(), tmp.c_str(), 0);
    return ec;
  }
  if (::fsync(dir_fd.get()) != 0) return last_error();
  return {};
}

std::optional<std::string> check_state_dir(const std::filesystem::path& dir) {
  const proto::UniqueFd dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir_fd) return "cannot open " + dir.string() + ": " + last_error().message();
  return check_private(dir_fd.get(), dir);
}

std::filesystem::path move_snapshot_aside(const std::filesystem::path& dir, std::error_code& ec) {
  const auto unix_time = std::chrono::duration_cast<std::chrono::seconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  const std::filesystem::path from = dir / kSnapshotFileName;
  std::filesystem::path to =
      dir / (std::string(kSnapshotFileName) + ".corrupt-" + std::to_string(unix_time));
  // Two corrupt files within one second must not overwrite each other.
  for (int i = 1; std::filesystem::exists(to, ec) && i < 100; ++i) {
    to = dir / (std::string(kSnapshotFileName) + ".corrupt-" + std::to_string(unix_time) + "." +
                std::to_string(i));
  }
  ec.clear();
  std::filesystem::rename(from, to, ec);
  if (ec) return {};
  fsync_dir(dir);
  return to;
}

bool has_snapshot_schema(const nlohmann::json& doc) {
  if (!doc.is_object()) return false;
  const auto schema = doc.find("schema");
  return schema != doc.end() && schema->is_string() &&
         schema->get_ref<const std::string&>() == kSnapshotSchema;
}

namespace {

// Thrown by the parse callback to stop at an over-long array.
struct ArrayTooLong {
  std::size_t depth;
};

// Parses `content`, stopping at the first array with more than `max_elements` elements:
// each open container is on a stack, an array counting the values and containers that
// end inside it.
nlohmann::json parse_bounded(const std::string& content, std::size_t max_elements,
                             std::string& error) {
  using Event = nlohmann::json::parse_event_t;
  std::vector<std::pair<bool, std::size_t>> open;  // (is an array, elements so far)
  const auto element_done = [&](int depth) {
    if (open.empty() || !open.back().first) return;
    if (++open.back().second > max_elements) throw ArrayTooLong{static_cast<std::size_t>(depth)};
  };
  const nlohmann::json::parser_callback_t callback = [&](int depth, Event event, nlohmann::json&) {
    switch (event) {
      case Event::object_start:
        open.emplace_back(false, 0);
        break;
      case Event::array_start:
        open.emplace_back(true, 0);
        break;
      case Event::object_end:
      case Event::array_end:
        if (!open.empty()) open.pop_back();
        element_done(depth);
        break;
      case Event::value:
        element_done(depth);
        break;
      case Event::key:
        break;
    }
    return true;
  };
  try {
    return nlohmann::json::parse(content, callback, /*allow_exceptions=*/false);
  } catch (const ArrayTooLong& e) {
    error = "an array (at depth " + std::to_string(e.depth) + ") holds more than " +
            std::to_string(max_elements) +
            " elements, more than the configured limits allow live state to hold (raise the "
            "limits to restore it)";
    return nlohmann::json(nlohmann::json::value_t::discarded);
  }
}

}  // namespace

LoadedSnapshot load_snapshot(const std::filesystem::path& dir, std::size_t max_array_elements,
                             std::size_t max_bytes) {
  LoadedSnapshot result;
  const std::filesystem::path path = dir / kSnapshotFileName;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    if (ec) {
      result.status = LoadedSnapshot::Status::kCorrupt;
      result.error = "cannot stat " + path.string() + ": " + ec.message();
    }
    return result;
  }
  // Not through a link: a planted one could make the daemon read any file it may read.
  const proto::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) {
    // Unreadable (permissions, a link): do not move it, just report; a fresh start follows.
    result.status = LoadedSnapshot::Status::kCorrupt;
    result.error = "cannot open " + path.string() + ": " + last_error().message();
    return result;
  }
  const std::string too_big = path.string() + " is larger than limits.max_snapshot_bytes (" +
                              std::to_string(max_bytes) + " bytes; raise it to restore the file)";
  struct stat st {};
  bool over = ::fstat(fd.get(), &st) == 0 && static_cast<std::uint64_t>(st.st_size) > max_bytes;
  std::string content;
  std::array<char, 64 * 1024> buf{};
  while (!over) {
    const ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      result.status = LoadedSnapshot::Status::kCorrupt;
      result.error = "cannot read " + path.string() + ": " + last_error().message();
      return result;
    }
    if (n == 0) break;
    content.append(buf.data(), static_cast<std::size_t>(n));
    over = content.size() > max_bytes;  // it grew since fstat
  }
  std::string too_long;
  nlohmann::json doc = over ? nlohmann::json(nlohmann::json::value_t::discarded)
                            : parse_bounded(content, max_array_elements, too_long);
  content.clear();
  content.shrink_to_fit();
  if (over) {
    result.error = too_big;
  } else if (!too_long.empty()) {
    result.error = path.string() + ": " + too_long;
  } else if (doc.is_discarded()) {
    result.error = path.string() + " is not valid JSON";
  } else if (!has_snapshot_schema(doc)) {
    result.error = path.string() + " is not a " + kSnapshotSchema + " document";
  } else {
    result.status = LoadedSnapshot::Status::kLoaded;
    result.doc = std::move(doc);
    return result;
  }
  result.status = LoadedSnapshot::Status::kCorrupt;
  result.moved_to = move_snapshot_aside(dir, ec);
  if (ec) result.error += "; moving it aside failed: " + ec.message();
  return result;
}

}  // namespace steptrace::daemon
