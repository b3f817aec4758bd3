#include "daemon/persist/snapshot.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <fstream>
#include <sstream>

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

std::error_code fsync_dir(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return last_error();
  std::error_code ec;
  if (::fsync(fd) != 0) ec = last_error();
  ::close(fd);
  return ec;
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
  const std::filesystem::path tmp = dir / (std::string(kSnapshotFileName) + ".tmp");
  const std::filesystem::path final_path = dir / kSnapshotFileName;
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return last_error();
  std::error_code ec = write_all(fd, text);
  if (!ec && ::fsync(fd) != 0) ec = last_error();
  if (::close(fd) != 0 && !ec) ec = last_error();
  if (!ec && ::rename(tmp.c_str(), final_path.c_str()) != 0) ec = last_error();
  if (ec) {
    ::unlink(tmp.c_str());
    return ec;
  }
  return fsync_dir(dir);
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

LoadedSnapshot load_snapshot(const std::filesystem::path& dir) {
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
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    // Unreadable (permissions): do not move it, just report; a fresh start follows.
    result.status = LoadedSnapshot::Status::kCorrupt;
    result.error = "cannot open " + path.string();
    return result;
  }
  std::ostringstream content;
  content << in.rdbuf();
  nlohmann::json doc = nlohmann::json::parse(content.str(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
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
