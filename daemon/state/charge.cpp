// The state budget's estimates of what records hold (charge.h), and handing freed heap
// back to the kernel.
#include "daemon/state/charge.h"

#include <malloc.h>

#include "daemon/state/collector_state.h"

namespace steptrace::daemon {

ThreadSpans::ThreadSpans(const ThreadSpans& other)
    : tid(other.tid), open(other.open), charged(other.charged) {
  stacks.reserve(other.stacks.capacity());
  for (const auto& stack : other.stacks) {
    auto& copy = stacks.emplace_back();
    copy.reserve(stack.capacity());
    copy.assign(stack.begin(), stack.end());
  }
  child_ns.reserve(other.child_ns.capacity());
  child_ns.assign(other.child_ns.begin(), other.child_ns.end());
}

namespace heap {

namespace {

using StepTable = std::array<std::uint16_t, proto::kMaxCustomSteps>;

}  // namespace

std::size_t record_base_bytes() {
  // make_shared: the control block (two counts, a vtable pointer) and the record in one.
  return heap_block(2 * sizeof(void*) + sizeof(ProcessRecord)) +
         tree_node_bytes<std::pair<const ProcessKey, ProcessHandle>>() +
         2 * sizeof(std::shared_ptr<ProcessRecord>) +  // its slot, in a vector grown by two
         array_bytes<StepAgg>(grown_capacity(proto::kBuiltinStepCount));
}

std::size_t custom_step_bytes(const ProcessRecord& rec, std::string_view name) {
  // The vectors are charged by size (they only grow; a copy holds no more).
  const std::size_t customs = rec.custom_ids.size();
  return size_growth_bytes<StepAgg>(rec.steps.size()) + size_growth_bytes<std::uint32_t>(customs) +
         size_growth_bytes<std::string>(customs) + string_heap_bytes(name.size()) +
         (rec.custom_slot ? 0 : heap_block(sizeof(StepTable)));
}

void make_room_for_step(ProcessRecord& rec) {
  reserve_grown(rec.steps, rec.steps.size() + 1);
  reserve_grown(rec.custom_ids, rec.custom_ids.size() + 1);
  reserve_grown(rec.custom_names, rec.custom_names.size() + 1);
}

namespace {
// make_shared: the control block (two counts, a vtable pointer) and the thread in one.
constexpr std::size_t kThreadBlock = heap_block(2 * sizeof(void*) + sizeof(ThreadSpans));
}  // namespace

std::size_t new_thread_bytes() {
  return kThreadBlock + hash_node_bytes<std::pair<const std::uint32_t, std::uint32_t>>() +
         2 * sizeof(std::shared_ptr<const ThreadSpans>);  // its pointer, in a vector grown by two
}

std::size_t stack_slots_bytes(const ThreadSpans& thread, std::size_t slot) {
  return capacity_growth_bytes(thread.stacks, slot + 1,
                               slots_capacity(thread.stacks.capacity(), slot + 1));
}

void make_room_for_slot(ThreadSpans& thread, std::size_t slot) {
  if (slot + 1 > thread.stacks.capacity())
    thread.stacks.reserve(slots_capacity(thread.stacks.capacity(), slot + 1));
  thread.stacks.resize(slot + 1);
}

std::size_t thread_heap_bytes(const ThreadSpans& thread) {
  // Charged by capacity (charge.h): what it holds now is what its growth was charged.
  std::size_t bytes =
      kThreadBlock + array_bytes<std::vector<std::uint64_t>>(thread.stacks.capacity());
  for (const auto& stack : thread.stacks) bytes += array_bytes<std::uint64_t>(stack.capacity());
  return bytes + array_bytes<std::uint64_t>(thread.child_ns.capacity());
}

std::size_t thread_bytes(const ThreadSpans& thread) {
  return new_thread_bytes() - kThreadBlock + thread_heap_bytes(thread);
}

std::size_t record_shell_bytes(const ProcessRecord& rec) {
  std::size_t bytes = record_bytes(rec);
  for (const auto& thread : rec.threads) bytes -= thread_heap_bytes(*thread);
  return bytes;
}

std::size_t record_bytes(const ProcessRecord& rec) {
  const std::size_t customs = rec.custom_ids.size();
  std::size_t bytes = record_base_bytes() -
                      array_bytes<StepAgg>(grown_capacity(proto::kBuiltinStepCount)) +
                      array_bytes<StepAgg>(grown_capacity(rec.steps.size())) +
                      array_bytes<std::uint32_t>(grown_capacity(customs)) +
                      array_bytes<std::string>(grown_capacity(customs)) +
                      (rec.custom_slot ? heap_block(sizeof(StepTable)) : 0);
  for (const auto& name : rec.custom_names) bytes += string_heap_bytes(name.size());
  for (const auto& step : rec.steps) bytes += histogram_heap_bytes(step.hist);
  for (const auto& thread : rec.threads) bytes += thread_bytes(*thread);
  return bytes;
}

std::size_t retired_histogram_bytes(std::string_view name, const Histogram& hist) {
  return tree_node_bytes<RetiredHistograms::value_type>() + string_heap_bytes(name.size()) +
         histogram_heap_bytes(hist);
}

std::size_t retired_job_bytes(const JobKey& key, const RetiredJob& job) {
  std::size_t bytes =
      tree_node_bytes<RetiredJobs::value_type>() + string_heap_bytes(key.job.size());
  for (const auto& [name, totals] : job.steps) bytes += retired_job_step_bytes(name);
  for (const auto& [rank, steps] : job.ranks) {
    bytes += retired_job_rank_bytes();
    for (const auto& [name, totals] : steps) bytes += retired_job_step_bytes(name);
  }
  return bytes;
}

std::size_t retired_job_rank_bytes() {
  return tree_node_bytes<std::pair<const std::uint32_t, JobStepMap>>();
}

std::size_t retired_job_step_bytes(std::string_view name) {
  return tree_node_bytes<std::pair<const std::string, JobStepTotals>>() +
         string_heap_bytes(name.size());
}

bool return_big_blocks_when_freed() {
  return ::mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMmapThreshold)) == 1 &&
         ::mallopt(M_TRIM_THRESHOLD, static_cast<int>(kTrimThreshold)) == 1;
}

}  // namespace heap

std::size_t ViewCopies::sweep() const {
  std::erase_if(held_, [this](const Held& h) {
    if (!h.record.expired()) return false;
    bytes_ -= std::min(bytes_, h.bytes);
    if (freed_ != nullptr) freed_->freed(h.bytes);
    return true;
  });
  swept_size_ = held_.size();
  return bytes_;
}

bool FreedMemory::release_if_due(std::uint64_t now_ns) {
  if (pending_ == 0) return false;
  if (!pending_seen_) {
    pending_seen_ = true;
    pending_since_ns_ = now_ns;
  }
  if (trims_ != 0 && now_ns - last_trim_ns_ < kMinIntervalNs) return false;
  if (pending_ < kBatchBytes && now_ns - pending_since_ns_ < kMaxDelayNs) return false;
  ::malloc_trim(0);
  pending_ = 0;
  pending_seen_ = false;
  last_trim_ns_ = now_ns;
  ++trims_;
  return true;
}

}  // namespace steptrace::daemon
