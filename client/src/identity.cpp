#include "client/src/identity.h"

#include <charconv>
#include <cstring>

namespace steptrace::client {
namespace {

// The first of `names` that is set and not empty: its name and value (nullptr: none).
std::pair<const char*, const char*> first_set(const std::function<const char*(const char*)>& getenv,
                                              std::initializer_list<const char*> names) {
  for (const char* name : names) {
    const char* value = getenv(name);
    if (value != nullptr && value[0] != '\0') return {name, value};
  }
  return {nullptr, nullptr};
}

// A decimal number in [least, limit) from the first variable of `names` that is set.
std::uint32_t number(const std::function<const char*(const char*)>& getenv,
                     std::initializer_list<const char*> names, std::uint32_t least,
                     std::uint32_t limit, std::uint32_t absent,
                     std::vector<std::string>& problems) {
  const auto [name, value] = first_set(getenv, names);
  if (name == nullptr) return absent;
  std::uint64_t n = 0;
  const char* end = value + std::strlen(value);
  const auto [ptr, ec] = std::from_chars(value, end, n);
  if (ec != std::errc{} || ptr != end || n < least || n >= limit) {
    std::string shown(value, std::min<std::size_t>(std::strlen(value), 32));
    for (char& c : shown) {
      if (c < 0x20 || c > 0x7e) c = '?';
    }
    problems.push_back(std::string(name) + "='" + shown + "' is not a number in " +
                       std::to_string(least) + ".." + std::to_string(limit - 1) + "; not sent");
    return absent;
  }
  return static_cast<std::uint32_t>(n);
}

}  // namespace

ProcessIdentity identity_from_env(const std::function<const char*(const char*)>& getenv,
                                  std::vector<std::string>& problems) {
  ProcessIdentity id;
  if (const auto [name, value] =
          first_set(getenv, {"STEPTRACE_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"});
      name != nullptr) {
    id.job = value;
  }
  // World sizes start at 1 (0 is "unknown" on the wire); a rank is below proto::kNoRank.
  id.world_size = number(getenv, {"WORLD_SIZE", "SLURM_NTASKS"}, 1, proto::kNoRank, 0, problems);
  id.rank = number(getenv, {"RANK", "SLURM_PROCID"}, 0, proto::kNoRank, proto::kNoRank, problems);
  id.local_rank =
      number(getenv, {"LOCAL_RANK", "SLURM_LOCALID"}, 0, proto::kNoRank, proto::kNoRank, problems);
  // The daemon refuses ranks outside the world (bad_identity): leave them out instead.
  const auto inside = [&](std::uint32_t& rank, const char* what) {
    if (rank == proto::kNoRank || id.world_size == 0 || rank < id.world_size) return;
    problems.push_back(std::string(what) + " " + std::to_string(rank) +
                       " is not below the world size " + std::to_string(id.world_size) +
                       "; not sent");
    rank = proto::kNoRank;
  };
  inside(id.rank, "rank");
  inside(id.local_rank, "local rank");
  return id;
}

}  // namespace steptrace::client
