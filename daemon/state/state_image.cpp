// StateImage (state_image.h) out of a view's state and back into the Collector's table:
// CollectorView::image() describes the records as a snapshot keeps them, and
// Collector::adopt(image) builds the records of an image (a RestoredState,
// collector_state.h) and installs them with adopt_restored() (collector.cpp).
#include "daemon/state/state_image.h"

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
  p.job = rec.job;
  p.rank = rec.rank;
  p.local_rank = rec.local_rank;
  p.world_size = rec.world_size;
  for (std::size_t i = 0; i < rec.custom_ids.size(); ++i) {
    p.custom_steps.push_back({rec.custom_ids[i], rec.custom_names[i]});
  }
  // Open spans cannot survive: whoever installs the image has no connection to end them.
  const auto open = rec.open_per_slot();
  for (std::size_t slot = 0; slot < rec.steps.size(); ++slot) {
    StepAgg agg = rec.steps[slot];
    agg.abandoned += open[slot];
    if (!agg.has_data()) continue;
    p.steps.push_back({.id = rec.step_id(slot),
                       .name = std::string(rec.step_name(slot)),
                       .hist = std::move(agg.hist),
                       .unmatched_ends = agg.unmatched_ends,
                       .abandoned = agg.abandoned,
                       .depth_dropped = agg.depth_dropped,
                       .self_ns = agg.self_ns});
  }
  return p;
}

RetiredJobImage retired_job_image(const JobKey& key, const RetiredJob& job) {
  RetiredJobImage out{.uid = key.uid,
                      .job = key.job,
                      .processes = job.processes,
                      .dropped = job.dropped,
                      .retired_order = job.retired_order,
                      .steps = {}};
  for (const auto& [name, t] : job.steps) {
    out.steps.emplace_hint(
        out.steps.end(), name,
        JobStepImage{.count = t.count, .total_ns = t.total_ns, .self_ns = t.self_ns});
  }
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
  return rec;
}

bool add_retired_job(RetiredJobImage& image, RetiredJobs& out) {
  RetiredJob job;
  job.processes = image.processes;
  job.dropped = image.dropped;
  job.retired_order = image.retired_order;
  for (auto& [name, t] : image.steps) {
    job.steps.emplace_hint(
        job.steps.end(), name,
        JobStepTotals{.count = t.count, .total_ns = t.total_ns, .self_ns = t.self_ns});
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
  return adopt_restored(std::move(restored));
}

ImageBounds image_bounds(const Limits& limits) {
  return {.retired_names = CollectorState::kMaxRetiredNames + 1,
          .retired_jobs = max_retired_jobs(limits),
          .job_steps = RetiredJob::kMaxJobSteps + 1};
}

}  // namespace steptrace::daemon
