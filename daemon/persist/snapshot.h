// Snapshot files: where the Collector's state lives on disk across daemon restarts: a
// "steptrace.snapshot/v2" file of checksummed records, one per line (written and read by
// the snapshot codec, daemon/persist/snapshot_codec.h); files of older builds (one
// "steptrace.snapshot/v1" JSON document) are still read.
//
// Data flow: the server calls save_snapshot(state_dir, view.image(), max_snapshot_bytes) on
// a timer (on the render thread) and on SIGTERM; at start it calls load_snapshot(state_dir,
// limits) and, when an image came back, adopt_snapshot(collector, image). Writes are
// atomic: the records go to `steptraced.snapshot.json.tmp`, which is fsynced, renamed over
// `steptraced.snapshot.json` (the name older builds used), and the directory is fsynced,
// so a crash leaves the old or the new file, never half of one. Reading is streamed, a
// line at a time: a damaged, torn or oversized record is skipped and counted, the rest
// restored. A file that is not ours at all (no good record, or another format) is moved
// aside to `steptraced.snapshot.json.corrupt-<unix time>` (never deleted, never fatal)
// and the caller is told so it can log it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>

#include <nlohmann/json.hpp>

#include "daemon/persist/snapshot_codec.h"
#include "daemon/state/state_image.h"
#include "daemon/state/types.h"

namespace steptrace::daemon {

inline constexpr const char* kSnapshotFileName = "steptraced.snapshot.json";
// The schema of a version-1 file: one JSON document (the codec's document form).
inline constexpr const char* kSnapshotSchema = "steptrace.snapshot/v1";

// Writes `image` atomically into `dir` (which must exist and pass check_state_dir; else
// permission_denied), a version-2 file of at most `max_bytes` (limits.max_snapshot_bytes:
// the records past it are left out, counted in `encoded`). The temporary file is created
// with O_EXCL | O_NOFOLLOW relative to the directory's descriptor, so no link planted
// there is followed. Errors are the OS's (std::system_category) and leave any previous
// snapshot in place.
struct SavedSnapshot {
  std::error_code ec;
  EncodedSnapshot encoded;
};
SavedSnapshot save_snapshot(const std::filesystem::path& dir, const StateImage& image,
                            std::size_t max_bytes);
// The same for a version-1 document (what older builds wrote; tests make such files).
std::error_code save_snapshot(const std::filesystem::path& dir, const nlohmann::json& doc);

struct LoadedSnapshot {
  enum class Status {
    kNone,     // no snapshot file: a fresh start
    kLoaded,   // `image` holds what the file held (less the records it skipped, named)
    kCorrupt,  // not ours or unreadable: moved to `moved_to` (empty if it was not moved)
  };
  Status status = Status::kNone;
  StateImage image;
  int version = 0;    // of the file read: 1 or 2
  std::string error;  // kCorrupt (or a read error): what was wrong, for the log
  std::filesystem::path moved_to;
  // kLoaded with records skipped: the file as it was, linked aside
  // (`steptraced.snapshot.json.partial-<unix time>`) before the next snapshot replaces it;
  // empty if the link failed.
  std::filesystem::path partial_copy;
};

// Whether `doc` is an object whose "schema" is kSnapshotSchema.
bool has_snapshot_schema(const nlohmann::json& doc);

// `dir` may hold snapshots: a directory owned by the daemon's user and writable by no
// one else (else another user could plant links or files in it). The reason otherwise.
std::optional<std::string> check_state_dir(const std::filesystem::path& dir);

// Reads `dir`/steptraced.snapshot.json, never through a link, under `limits`. Never
// throws. A version-2 file is read a line at a time: a line longer than
// limits.max_snapshot_bytes, or past that many bytes of the file, is skipped unread and
// counted; a read error (EIO) ends the file there (the rest counted as one skipped
// record). A version-1 file is read whole, as older builds did: longer than
// max_snapshot_bytes, or with an array longer than live state could hold
// (snapshot_max_array_elements), or rejected by the codec, it is moved aside.
LoadedSnapshot load_snapshot(const std::filesystem::path& dir, const Limits& limits);

// Moves the snapshot file aside as `steptraced.snapshot.json.corrupt-<unix time>` and
// returns the new path (empty with `ec` set on failure). load_snapshot() does this for
// files it cannot use; the server calls it too when Collector::adopt() refuses an image.
std::filesystem::path move_snapshot_aside(const std::filesystem::path& dir, std::error_code& ec);

}  // namespace steptrace::daemon
