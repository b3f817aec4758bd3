// Snapshot files: where the Collector's state (a "steptrace.snapshot/v1" JSON document,
// made and read by the snapshot codec, daemon/persist/snapshot_codec.h) lives on disk
// across daemon restarts.
//
// Data flow: the server calls save_snapshot(state_dir, encode_snapshot(view)) on a timer
// (on the render thread) and on SIGTERM; at start it calls load_snapshot(state_dir) and,
// when a document came back, restore_from_snapshot(collector, doc), which decodes it and
// hands the state to Collector::adopt(). Writes are atomic: the document goes to
// `steptraced.snapshot.json.tmp`, is fsynced, renamed over `steptraced.snapshot.json`,
// and the directory is fsynced, so a crash leaves the old or the new file, never half of
// one. A file that cannot be parsed or is not ours is moved aside to
// `steptraced.snapshot.json.corrupt-<unix time>` (never deleted, never fatal) and the
// caller is told so it can log it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>

#include <nlohmann/json.hpp>

namespace steptrace::daemon {

inline constexpr const char* kSnapshotFileName = "steptraced.snapshot.json";
inline constexpr const char* kSnapshotSchema = "steptrace.snapshot/v1";

// Writes `doc` atomically into `dir` (which must exist and pass check_state_dir; else
// permission_denied). The temporary file is created with O_EXCL | O_NOFOLLOW relative
// to the directory's descriptor, so no link planted there is followed. Errors are the
// OS's (std::system_category) and leave any previous snapshot in place.
std::error_code save_snapshot(const std::filesystem::path& dir, const nlohmann::json& doc);

struct LoadedSnapshot {
  enum class Status {
    kNone,     // no snapshot file: a fresh start
    kLoaded,   // `doc` holds a parsed document whose "schema" is kSnapshotSchema
    kCorrupt,  // unparseable or not ours: moved to `moved_to` (empty if the move failed)
  };
  Status status = Status::kNone;
  nlohmann::json doc;
  std::string error;  // kCorrupt (or a read error): what was wrong, for the log
  std::filesystem::path moved_to;
};

// Whether `doc` is an object whose "schema" is kSnapshotSchema.
bool has_snapshot_schema(const nlohmann::json& doc);

// `dir` may hold snapshots: a directory owned by the daemon's user and writable by no
// one else (else another user could plant links or files in it). The reason otherwise.
std::optional<std::string> check_state_dir(const std::filesystem::path& dir);

// Reads `dir`/steptraced.snapshot.json, never through a link. Never throws.
// `max_array_elements`: the parse stops (the file is moved aside as corrupt) at the first
// array longer than this, so a huge snapshot costs memory and time only up to the bound
// (snapshot_max_array_elements() derives it from the limits of live state).
// `max_bytes` (limits.max_snapshot_bytes): a longer file is moved aside unread, saying so.
LoadedSnapshot load_snapshot(const std::filesystem::path& dir,
                             std::size_t max_array_elements = SIZE_MAX,
                             std::size_t max_bytes = SIZE_MAX);

// Moves the snapshot file aside as `steptraced.snapshot.json.corrupt-<unix time>` and
// returns the new path (empty with `ec` set on failure). load_snapshot() does this for
// unparseable files; the server calls it too when restore_from_snapshot() rejects a
// document that parsed.
std::filesystem::path move_snapshot_aside(const std::filesystem::path& dir, std::error_code& ec);

}  // namespace steptrace::daemon
