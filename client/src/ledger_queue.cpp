#include "client/src/ledger_queue.h"

#include <cstring>
#include <string_view>

#include "proto/codec.h"

namespace steptrace::client {
namespace {

// Cuts and cleans `text` into `field`; true when it had to cut.
template <std::size_t N>
bool fill_field(char (&field)[N], const char* text) {
  const std::string_view view = text ? std::string_view(text) : std::string_view();
  proto::set_field_lossy(field, view);
  return view.size() > N - 1;
}

}  // namespace

std::optional<proto::LedgerRecord> make_ledger_record(proto::LedgerOp op, const char* gpu_uuid,
                                                      const char* task, std::uint64_t timestamp_ns,
                                                      std::uint32_t thread_id) {
  if (gpu_uuid == nullptr || gpu_uuid[0] == '\0') return std::nullopt;
  proto::LedgerRecord r{};
  r.timestamp_ns = timestamp_ns;
  r.thread_id = thread_id;
  r.op = static_cast<std::uint8_t>(op);
  if (fill_field(r.gpu_uuid, gpu_uuid)) r.flags |= proto::kLedgerGpuUuidTruncated;
  if (fill_field(r.task, task)) r.flags |= proto::kLedgerTaskTruncated;
  return r;
}

}  // namespace steptrace::client
