// Which job and rank this process belongs to, read once from its environment at load
// and sent to the daemon in an Identity frame (PROTOCOL.md 4.7b) after each hello of a
// version-4 connection:
//   job id:      STEPTRACE_JOB, else TORCHELASTIC_RUN_ID (torchrun), else SLURM_JOB_ID
//   rank:        RANK, else SLURM_PROCID
//   local rank:  LOCAL_RANK, else SLURM_LOCALID
//   world size:  WORLD_SIZE, else SLURM_NTASKS
// A job id is cut to 63 characters and unprintable bytes become '?' (the wire's string
// rule). A rank or size that is not a decimal number in range is not sent, and said once
// on stderr (unless STEPTRACE_QUIET=1): a silently missing rank would look like a bug of
// the report.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "proto/wire_format.h"

namespace steptrace::client {

struct ProcessIdentity {
  std::string job;
  std::uint32_t rank = proto::kNoRank;
  std::uint32_t local_rank = proto::kNoRank;
  std::uint32_t world_size = 0;

  // Whether there is anything to send.
  bool any() const {
    return !job.empty() || rank != proto::kNoRank || local_rank != proto::kNoRank ||
           world_size != 0;
  }
};

// `getenv` is the lookup (std::getenv in the library, a map in tests). `problems` gets
// one line per variable that was set but not usable, naming it and what was wrong.
ProcessIdentity identity_from_env(const std::function<const char*(const char*)>& getenv,
                                  std::vector<std::string>& problems);

}  // namespace steptrace::client
