#include "daemon/persist/snapshot.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <functional>
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

std::int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::error_code fsync_dir(const std::filesystem::path& dir) {
  const proto::UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) return last_error();
  if (::fsync(fd.get()) != 0) return last_error();  // errno read before fd closes
  return {};
}

// Creates `dir`/<name>.tmp, lets `write` fill it, fsyncs it and renames it over the
// snapshot. Everything goes through the directory's descriptor: no path is looked up twice.
std::error_code write_atomically(const std::filesystem::path& dir,
                                 const std::function<std::error_code(int fd)>& write) {
  const std::string tmp = std::string(kSnapshotFileName) + ".tmp";
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
  std::error_code ec = write(fd.get());
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

}  // namespace

SavedSnapshot save_snapshot(const std::filesystem::path& dir, const StateImage& image,
                            std::size_t max_bytes) {
  SavedSnapshot saved;
  saved.ec = write_atomically(dir, [&](int fd) {
    // Lines gather into writes of about kChunk bytes.
    constexpr std::size_t kChunk = 256 * 1024;
    std::string buffer;
    std::error_code ec;
    saved.encoded = encode_snapshot_records(image, max_bytes, [&](std::string_view line) {
      buffer.append(line);
      if (buffer.size() >= kChunk) {
        ec = write_all(fd, buffer);
        buffer.clear();
      }
      return !ec;
    });
    if (!ec) ec = write_all(fd, buffer);
    return ec;
  });
  return saved;
}

std::error_code save_snapshot(const std::filesystem::path& dir, const nlohmann::json& doc) {
  std::string text;
  try {
    text = doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  } catch (const std::exception&) {
    return std::make_error_code(std::errc::invalid_argument);
  }
  text.push_back('\n');
  return write_atomically(dir, [&text](int fd) { return write_all(fd, text); });
}

std::optional<std::string> check_state_dir(const std::filesystem::path& dir) {
  const proto::UniqueFd dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir_fd) return "cannot open " + dir.string() + ": " + last_error().message();
  return check_private(dir_fd.get(), dir);
}

std::filesystem::path move_snapshot_aside(const std::filesystem::path& dir, std::error_code& ec) {
  const std::int64_t unix_time = unix_now();
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

// A version-2 file's bytes, cut into lines for a SnapshotRecordReader: a line longer than
// `max_bytes` is not held (skipped as it ends), nor is any line that starts past
// `max_bytes` bytes of the file.
class LineSplitter {
 public:
  LineSplitter(SnapshotRecordReader& reader, std::size_t max_bytes)
      : reader_(reader), max_bytes_(max_bytes) {}

  void feed(std::string_view chunk) {
    while (!chunk.empty()) {
      const std::size_t nl = chunk.find('\n');
      const std::string_view piece = chunk.substr(0, nl);
      if (!past_ && !overlong_) {
        line_.append(piece);
        if (line_.size() > max_bytes_) {
          overlong_ = true;
          std::string().swap(line_);
        }
      }
      pending_ = true;
      offset_ += piece.size();
      if (nl == std::string_view::npos) return;
      ++offset_;
      chunk.remove_prefix(nl + 1);
      end_line(/*torn=*/false);
    }
  }
  // The file ended: a line without its '\n' is torn.
  void finish() {
    if (pending_) end_line(/*torn=*/true);
  }

 private:
  void end_line(bool torn) {
    if (past_) {
      reader_.skip_line("past limits.max_snapshot_bytes (" + std::to_string(max_bytes_) +
                        " bytes of the file), not read");
    } else if (overlong_) {
      reader_.skip_line("longer than limits.max_snapshot_bytes (" + std::to_string(max_bytes_) +
                        " bytes), not read");
    } else {
      reader_.line(line_, torn);
    }
    line_.clear();
    overlong_ = false;
    pending_ = false;
    past_ = offset_ >= max_bytes_;
  }

  SnapshotRecordReader& reader_;
  const std::size_t max_bytes_;
  std::string line_;
  std::uint64_t offset_ = 0;  // bytes of the file fed
  bool pending_ = false;      // a line has begun
  bool overlong_ = false;     // the current line is too long to hold
  bool past_ = false;         // the current line starts past max_bytes_
};

// Reads from `fd` until the end, handing each chunk to `consume`; "" or the read error.
std::string read_chunks(int fd, const std::function<bool(std::string_view)>& consume) {
  std::array<char, 64 * 1024> buf{};
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return last_error().message();
    if (n == 0) return {};
    if (!consume(std::string_view(buf.data(), static_cast<std::size_t>(n)))) return {};
  }
}

// A version-1 file: one document, read whole as older builds did (`content` holds its
// start). False with result.error set when it cannot be used.
// What became of a file load_snapshot() read.
enum class Outcome { kLoaded, kMoveAside, kLeave };

// A version-1 file: one document, read whole as older builds did (`content` holds its
// start). result.error says why when it is not kLoaded.
Outcome load_document(int fd, std::string content, const std::filesystem::path& path,
                      const Limits& limits, LoadedSnapshot& result) {
  const std::size_t max_bytes = limits.max_snapshot_bytes;
  bool over = content.size() > max_bytes;
  const std::string read_error = over ? std::string() : read_chunks(fd, [&](std::string_view c) {
    content.append(c);
    over = content.size() > max_bytes;
    return !over;
  });
  if (!read_error.empty()) {
    // Perhaps passing (EIO): left in place for the next start.
    result.error = "cannot read " + path.string() + ": " + read_error;
    return Outcome::kLeave;
  }
  if (over) {
    result.error = path.string() +
                   " (a version-1 snapshot, read whole) is larger than "
                   "limits.max_snapshot_bytes (" +
                   std::to_string(max_bytes) + " bytes; raise it to restore the file)";
    return Outcome::kMoveAside;
  }
  std::string too_long;
  const nlohmann::json doc =
      parse_bounded_json(content, snapshot_max_array_elements(limits), too_long);
  std::string().swap(content);
  std::string rejected;
  if (!too_long.empty()) {
    result.error = path.string() + ": " + too_long;
  } else if (doc.is_discarded()) {
    result.error = path.string() + " is not valid JSON";
  } else if (!has_snapshot_schema(doc)) {
    result.error = path.string() + " is not a " + kSnapshotSchema + " document";
  } else if (auto image = decode_snapshot(doc, limits, rejected)) {
    result.image = std::move(*image);
    return Outcome::kLoaded;
  } else {
    result.error = path.string() + " rejected: " + rejected;
  }
  return Outcome::kMoveAside;
}

// A version-2 file, a line at a time (`first` holds its start).
Outcome load_records(int fd, std::string_view first, const std::filesystem::path& path,
                     const Limits& limits, LoadedSnapshot& result) {
  SnapshotRecordReader reader(limits);
  LineSplitter lines(reader, limits.max_snapshot_bytes);
  lines.feed(first);
  const std::string read_error = read_chunks(fd, [&lines](std::string_view chunk) {
    lines.feed(chunk);
    return true;
  });
  if (!read_error.empty()) {
    // What was read is restored; the rest of the file is one record lost, said so.
    reader.read_failed("cannot read the rest of the file: " + read_error);
  } else {
    lines.finish();
  }
  std::string error;
  auto image = reader.finish(error);
  if (!image) {
    result.error = path.string() + ": " + error;
    return Outcome::kMoveAside;
  }
  result.image = std::move(*image);
  return Outcome::kLoaded;
}

// Links the snapshot as `steptraced.snapshot.json.partial-<unix time>` (never through a
// link): what a partial restore skipped stays for a human after the next snapshot
// replaces the file. Empty when it could not.
std::filesystem::path keep_partial_copy(const std::filesystem::path& dir) {
  const proto::UniqueFd dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir_fd) return {};
  const std::string name =
      std::string(kSnapshotFileName) + ".partial-" + std::to_string(unix_now());
  if (::linkat(dir_fd.get(), kSnapshotFileName, dir_fd.get(), name.c_str(), 0) != 0) return {};
  ::fsync(dir_fd.get());
  return dir / name;
}

}  // namespace

LoadedSnapshot load_snapshot(const std::filesystem::path& dir, const Limits& limits) {
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
  std::string first;
  const std::string read_error = read_chunks(fd.get(), [&first](std::string_view chunk) {
    first.assign(chunk);
    return false;
  });
  Outcome outcome = Outcome::kLeave;
  if (!read_error.empty()) {
    // Perhaps passing (EIO): not moved, the file stays for the next start.
    result.error = "cannot read " + path.string() + ": " + read_error;
  } else if (const auto start = first.find_first_not_of(" \t\r\n");
             start != std::string::npos && first[start] == '{') {
    // A version-1 document opens with '{' (after any whitespace), a line of version 2
    // with its checksum's hex digits.
    result.version = 1;
    outcome = load_document(fd.get(), std::move(first), path, limits, result);
  } else {
    result.version = 2;
    outcome = load_records(fd.get(), first, path, limits, result);
  }
  switch (outcome) {
    case Outcome::kLoaded:
      result.status = LoadedSnapshot::Status::kLoaded;
      if (!result.image.skipped.empty() || result.image.skipped_unnamed > 0) {
        result.partial_copy = keep_partial_copy(dir);
      }
      return result;
    case Outcome::kLeave:
      result.status = LoadedSnapshot::Status::kCorrupt;
      return result;
    case Outcome::kMoveAside:
      break;
  }
  result.status = LoadedSnapshot::Status::kCorrupt;
  result.moved_to = move_snapshot_aside(dir, ec);
  if (ec) result.error += "; moving it aside failed: " + ec.message();
  return result;
}

}  // namespace steptrace::daemon
