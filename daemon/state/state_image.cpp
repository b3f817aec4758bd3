// StateImage (state_image.h) out of a view's state and back into the Collector's table:
// CollectorView::image() describes the records as a snapshot keeps them, and
// Collector::adopt(image) builds the records of an image (a RestoredState,
// collector_state.h) and installs them with adopt_restored() (collector.cpp).
#include "daemon/state/state_image.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <set>
#include <system_error>
#include <utility>

#include "daemon/state/collector.h"
#include "daemon/state/collector_state.h"

namespace steptrace::daemon {
namespace {

// ---- out: records -> image ---------------------------------------------------------------

// The threads of `rec` with open spans, in thread id order.
std::vector<OpenThreadImage> open_threads(const ProcessRecord& rec) {
  std::vector<OpenThreadImage> out;
  for (const auto& thread : rec.threads) {
    if (thread->open == 0) continue;
    OpenThreadImage t;
    t.tid = thread->tid;
    t.child_ns.assign(thread->child_ns.begin(), thread->child_ns.begin() + thread->open);
    for (std::size_t slot = 0; slot < thread->stacks.size(); ++slot) {
      if (thread->stacks[slot].empty()) continue;
      t.stacks.push_back({rec.step_id(slot), thread->stacks[slot]});
    }
    out.push_back(std::move(t));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.tid < b.tid; });
  return out;
}

ProcessImage process_image(const ProcessRecord& rec) {
  ProcessImage p;
  p.peer = rec.peer;
  p.client = rec.client_name;
  p.library_version = rec.library_version;
  p.alive = rec.alive;
  p.exited_at_ns = rec.exited_at_ns;
  p.exit_order = rec.exit_order;
  p.dropped = rec.dropped;
  p.dropped_by_cause = rec.dropped_by_cause;
  if (rec.events_known) p.events = rec.events;
  p.ledger_refused = rec.ledger_refused;
  p.batch_sequence = rec.batch_sequence;
  p.batch_next = rec.batch_next;
  p.job = rec.job;
  p.rank = rec.rank;
  p.local_rank = rec.local_rank;
  p.world_size = rec.world_size;
  for (std::size_t i = 0; i < rec.custom_ids.size(); ++i) {
    p.custom_steps.push_back({rec.custom_ids[i], rec.custom_names[i]});
  }
  for (std::size_t slot = 0; slot < rec.steps.size(); ++slot) {
    StepAgg agg = rec.steps[slot];
    if (!agg.has_data()) continue;
    p.steps.push_back({.id = rec.step_id(slot),
                       .name = std::string(rec.step_name(slot)),
                       .hist = std::move(agg.hist),
                       .unmatched_ends = agg.unmatched_ends,
                       .abandoned = agg.abandoned,
                       .depth_dropped = agg.depth_dropped,
                       .self_ns = agg.self_ns});
  }
  p.open = open_threads(rec);
  return p;
}

RetiredJobImage retired_job_image(const JobKey& key, const RetiredJob& job) {
  RetiredJobImage out{.uid = key.uid,
                      .job = key.job,
                      .processes = job.processes,
                      .dropped = job.dropped,
                      .retired_order = job.retired_order,
                      .steps = {},
                      .ranks = {}};
  const auto copy = [](const JobStepMap& from, auto& to) {
    for (const auto& [name, t] : from) {
      to.emplace_hint(to.end(), name,
                      JobStepImage{.count = t.count, .total_ns = t.total_ns, .self_ns = t.self_ns});
    }
  };
  copy(job.steps, out.steps);
  for (const auto& [rank, steps] : job.ranks) copy(steps, out.ranks[rank]);
  return out;
}

// ---- in: image -> records ------------------------------------------------------------------

// Registers the custom steps on `rec` in order; false when an id is not a custom
// step's or comes twice.
bool register_custom_steps(std::vector<CustomStepImage>& steps, ProcessRecord& rec) {
  for (CustomStepImage& step : steps) {
    if (!proto::is_custom_step(step.id)) return false;
    if (!rec.custom_slot) {
      rec.custom_slot = std::make_unique<std::array<std::uint16_t, proto::kMaxCustomSteps>>();
      rec.custom_slot->fill(0);
    }
    auto& slot = (*rec.custom_slot)[step.id - proto::kFirstCustomStep];
    if (slot != 0) return false;
    slot = static_cast<std::uint16_t>(rec.steps.size());
    rec.steps.emplace_back();
    rec.custom_ids.push_back(step.id);
    rec.custom_names.push_back(std::move(step.name));
  }
  return true;
}

// The slot of step `id` on `rec`: a built-in's, or a custom step's it registered.
std::optional<std::size_t> slot_of(const ProcessRecord& rec, std::uint32_t id) {
  if (proto::is_builtin_step(id)) return id;
  if (proto::is_custom_step(id) && rec.custom_slot) {
    const std::uint16_t slot = (*rec.custom_slot)[id - proto::kFirstCustomStep];
    if (slot != 0) return slot;
  }
  return std::nullopt;
}

// The open spans of `image` as a thread of `rec`; null when the image breaks its rules
// (a step id neither built-in nor registered or twice, an empty stack, child_ns not one
// per open span).
std::shared_ptr<ThreadSpans> make_thread(OpenThreadImage& image, const ProcessRecord& rec) {
  auto thread = std::make_shared<ThreadSpans>();
  thread->tid = image.tid;
  std::size_t open = 0;
  for (OpenStackImage& stack : image.stacks) {
    const auto slot = slot_of(rec, stack.id);
    if (!slot || stack.starts.empty()) return nullptr;
    if (thread->stacks.size() <= *slot) thread->stacks.resize(*slot + 1);
    if (!thread->stacks[*slot].empty()) return nullptr;
    open += stack.starts.size();
    thread->stacks[*slot] = std::move(stack.starts);
  }
  if (open == 0 || open != image.child_ns.size()) return nullptr;
  thread->open = static_cast<std::uint32_t>(open);
  thread->child_ns = std::move(image.child_ns);
  return thread;
}

// The table's record of `p`, or null when the image breaks its own rules (a step id
// neither built-in nor registered, an id twice). The snapshot codec refuses such a
// document, naming the field, before it gets here; this keeps the table whole whoever
// the caller is.
std::shared_ptr<ProcessRecord> make_record(ProcessImage p) {
  auto rec = std::make_shared<ProcessRecord>();
  rec->peer = std::move(p.peer);
  rec->client_name = std::move(p.client);
  rec->library_version = std::move(p.library_version);
  rec->alive = p.alive;
  rec->exited_at_ns = p.exited_at_ns;
  rec->exit_order = p.exit_order;
  rec->dropped = p.dropped;
  rec->dropped_by_cause = p.dropped_by_cause;
  rec->events = p.events.value_or(0);
  rec->events_known = p.events.has_value();
  rec->ledger_refused = p.ledger_refused;
  rec->batch_sequence = p.batch_sequence;
  rec->batch_next = p.batch_next;
  rec->job = std::move(p.job);
  rec->rank = p.rank;
  rec->local_rank = p.local_rank;
  rec->world_size = p.world_size;
  if (!register_custom_steps(p.custom_steps, *rec)) return nullptr;
  std::vector<bool> seen(rec->steps.size(), false);
  for (StepImage& step : p.steps) {
    const auto slot = slot_of(*rec, step.id);
    if (!slot || seen[*slot]) return nullptr;
    seen[*slot] = true;
    rec->steps[*slot] = StepAgg{.hist = std::move(step.hist),
                                .unmatched_ends = step.unmatched_ends,
                                .abandoned = step.abandoned,
                                .depth_dropped = step.depth_dropped,
                                .self_ns = step.self_ns};
  }
  for (OpenThreadImage& t : p.open) {
    auto thread = make_thread(t, *rec);
    if (!thread || rec->thread_index.contains(t.tid)) return nullptr;
    rec->thread_index.emplace(t.tid, static_cast<std::uint32_t>(rec->threads.size()));
    rec->threads.push_back(std::move(thread));
  }
  return rec;
}

bool add_retired_job(RetiredJobImage& image, RetiredJobs& out) {
  RetiredJob job;
  job.processes = image.processes;
  job.dropped = image.dropped;
  job.retired_order = image.retired_order;
  const auto copy = [](const auto& from, JobStepMap& to) {
    for (const auto& [name, t] : from) {
      to.emplace_hint(
          to.end(), name,
          JobStepTotals{.count = t.count, .total_ns = t.total_ns, .self_ns = t.self_ns});
    }
  };
  copy(image.steps, job.steps);
  for (const auto& [rank, steps] : image.ranks) {
    copy(steps, job.ranks[rank]);
    job.rank_steps += steps.size();
  }
  return out.try_emplace(JobKey{image.uid, std::move(image.job)}, std::move(job)).second;
}

}  // namespace

StateImage CollectorView::image() const {
  const CollectorState& state = *state_;
  StateImage image;
  image.taken_at_ns = now_ns_;
  for (const auto& [key, handle] : state.by_key) {
    image.processes.push_back(process_image(*state.slots[handle]));
  }
  image.retired = *state.retired;
  for (const auto& [key, job] : *state.retired_jobs) {
    image.retired_jobs.push_back(retired_job_image(key, job));
  }
  image.ledger = state.ledger.state();
  image.counters = counters_;
  return image;
}

std::error_code Collector::adopt(StateImage image) {
  const auto broken = std::make_error_code(std::errc::invalid_argument);
  RestoredState restored;
  std::set<ProcessKey> keys;
  for (ProcessImage& p : image.processes) {
    auto rec = make_record(std::move(p));
    if (!rec || !keys.insert(rec->key()).second) return broken;
    restored.processes.push_back(std::move(rec));
  }
  restored.retired = std::move(image.retired);
  for (RetiredJobImage& job : image.retired_jobs) {
    if (!add_retired_job(job, restored.retired_jobs)) return broken;
  }
  restored.ledger = std::move(image.ledger);
  restored.counters = std::move(image.counters);
  const std::uint64_t skipped = image.skipped.size() + image.skipped_unnamed;
  if (auto ec = adopt_restored(std::move(restored))) return ec;
  counters_.snapshot_records_skipped += skipped;
  return {};
}

ImageBounds image_bounds(const Limits& limits) {
  return {.retired_names = CollectorState::kMaxRetiredNames + 1,
          .retired_jobs = max_retired_jobs(limits),
          .job_steps = RetiredJob::kMaxJobSteps + 1,
          .job_ranks = RetiredJob::kMaxJobRanks,
          // Each rank's "(other)" past kMaxJobRankSteps names (collector_liveness.cpp).
          .job_rank_steps = RetiredJob::kMaxJobRankSteps + RetiredJob::kMaxJobRanks};
}

}  // namespace steptrace::daemon
