#include "cli/top_view.h"

#include <fmt/format.h>
#include <algorithm>
#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>
#include <vector>

#include "proto/printable.h"
#include "proto/units.h"

namespace steptrace::cli {
namespace {

using nlohmann::json;

constexpr std::string_view kWaitPollStep = "WaitPoll";
constexpr const char* kWaitingMarker = "<<< WAITING FOR VRAM";
constexpr const char* kLeakedMarker = "LEAKED (holder exited)";
constexpr const char* kExpiredMarker = "EXPIRED (lease not renewed)";

// Non-throwing field readers: a report from a newer or broken daemon must not crash top.
std::uint64_t u64(const json& object, const char* key) {
  if (!object.is_object()) return 0;
  const auto it = object.find(key);
  if (it == object.end()) return 0;
  if (it->is_number_unsigned()) return it->get<std::uint64_t>();
  if (it->is_number_integer()) {
    const auto v = it->get<std::int64_t>();
    return v < 0 ? 0 : static_cast<std::uint64_t>(v);
  }
  if (it->is_number_float()) {
    const auto v = it->get<double>();
    return v < 0 ? 0 : static_cast<std::uint64_t>(v);
  }
  return 0;
}

// Every string of the report is client-chosen (comm, step names, task, GPU UUID) and
// goes on a terminal: each is read through proto::printable(), so no escape code, line
// break or other control byte gets through.
std::string str(const json& object, const char* key, const char* fallback = "?") {
  if (!object.is_object()) return fallback;
  const auto it = object.find(key);
  if (it == object.end() || !it->is_string()) return fallback;
  return proto::printable(it->get_ref<const std::string&>());
}

bool flag(const json& object, const char* key, bool fallback) {
  if (!object.is_object()) return fallback;
  const auto it = object.find(key);
  if (it == object.end() || !it->is_boolean()) return fallback;
  return it->get<bool>();
}

const json& array_at(const json& object, const char* key) {
  static const json kEmpty = json::array();
  if (!object.is_object()) return kEmpty;
  const auto it = object.find(key);
  if (it == object.end() || !it->is_array()) return kEmpty;
  return *it;
}

const json& object_at(const json& object, const char* key) {
  static const json kEmpty = json::object();
  if (!object.is_object()) return kEmpty;
  const auto it = object.find(key);
  if (it == object.end() || !it->is_object()) return kEmpty;
  return *it;
}

// `text` padded with spaces to `width` bytes, like printf's "%-*s" (the report's strings
// are printable ASCII once read through str(), so bytes are columns).
std::string pad_right(std::string text, std::size_t width) {
  if (text.size() < width) text.append(width - text.size(), ' ');
  return text;
}

class Painter {
 public:
  explicit Painter(bool color) : color_(color) {}
  std::string alert(const std::string& text) const { return wrap("\x1b[1;97;41m", text); }
  std::string bold(const std::string& text) const { return wrap("\x1b[1m", text); }
  std::string dim(const std::string& text) const { return wrap("\x1b[2m", text); }

 private:
  std::string wrap(const char* code, const std::string& text) const {
    return color_ ? code + text + "\x1b[0m" : text;
  }
  bool color_;
};

void render_process(const json& process, const Painter& paint, std::string& out) {
  out += paint.bold(
      fmt::format("PID {:<8} {}", u64(process, "pid"), pad_right(str(process, "comm"), 16)));
  out += fmt::format("  uid {}", u64(process, "uid"));
  if (const auto dropped = u64(process, "dropped"); dropped > 0) {
    out += fmt::format("  dropped {} events", dropped);
  }
  out += "\n";

  const json& current = array_at(process, "current");
  if (current.empty()) out += paint.dim("  (no open span)") + "\n";
  for (const json& span : current) {
    const std::string step = str(span, "step");
    const auto depth = u64(span, "depth");
    std::string where = step;
    if (depth > 1) where += fmt::format(" (depth {})", depth);
    out += fmt::format("  thread {:<8} in {} for {:>10}", u64(span, "thread"),
                       pad_right(std::move(where), 28), units::duration(u64(span, "open_for_ns")));
    if (step == kWaitPollStep) out += "  " + paint.alert(kWaitingMarker);
    out += "\n";
  }

  const json& steps = array_at(process, "steps");
  if (steps.empty()) return;
  std::vector<const json*> rows;
  std::uint64_t sum = 0;
  for (const json& step : steps) {
    rows.push_back(&step);
    sum += u64(step, "total_ns");
  }
  std::stable_sort(rows.begin(), rows.end(), [](const json* a, const json* b) {
    return u64(*a, "total_ns") > u64(*b, "total_ns");
  });
  out += paint.dim(fmt::format("  {:<18} {:>10} {:>12} {:>8}", "Step", "Count", "Total", "Share")) +
         "\n";
  for (const json* step : rows) {
    const auto total = u64(*step, "total_ns");
    const double share =
        sum == 0 ? 0.0 : 100.0 * static_cast<double>(total) / static_cast<double>(sum);
    out += fmt::format("  {} {:>10} {:>12} {}", pad_right(str(*step, "step"), 18),
                       u64(*step, "count"), units::duration(total), units::percent(share));
    if (const auto open = u64(*step, "open"); open > 0) out += fmt::format("  ({} open)", open);
    out += "\n";
  }
}

void render_gpu(const json& gpu, const Painter& paint, std::string& out) {
  const auto total = u64(gpu, "total_bytes");
  const auto reserved = u64(gpu, "reserved_bytes");
  out += paint.bold("GPU " + str(gpu, "gpu")) + ": reserved " + units::bytes(reserved);
  if (total > 0) {
    out += " of " + units::bytes(total) + ", free " + units::bytes(u64(gpu, "free_bytes")) +
           " (last VRAM sample)";
  } else {
    out += " (no VRAM sample yet)";
  }
  out += "\n";
  const json& reservations = array_at(gpu, "reservations");
  if (reservations.empty()) {
    out += paint.dim("  (no reservations)") + "\n";
    return;
  }
  out += paint.dim(fmt::format("  {:<20} {:<8} {:>12}  {:<24} {}", "id", "pid", "bytes", "task",
                               "holder")) +
         "\n";
  for (const json& r : reservations) {
    // "state" (daemons with leases), else holder_alive.
    const std::string state = str(r, "state", flag(r, "holder_alive", true) ? "alive" : "LEAKED");
    out += fmt::format("  {:<20} {:<8} {:>12}  {} ", u64(r, "id"), u64(r, "pid"),
                       units::bytes(u64(r, "bytes")), pad_right(str(r, "task", ""), 24));
    if (state == "LEAKED") {
      out += paint.alert(kLeakedMarker);
    } else if (state == "EXPIRED") {
      out += paint.alert(kExpiredMarker);
    } else {
      out += "alive";
    }
    out += "\n";
  }
  // Declared versus actual (NVML): one line a finding.
  const json& findings = array_at(gpu, "findings");
  for (const json& f : findings) {
    const std::string kind = str(f, "kind", "?");
    std::string line = "  " + kind + " pid " + std::to_string(u64(f, "pid")) + ": ";
    if (kind == "IDLE") {
      line += "holds " + units::bytes(u64(f, "reserved_bytes")) + " and uses none";
    } else {
      line += "uses " + units::bytes(u64(f, "used_bytes")) + ", reserved " +
              units::bytes(u64(f, "reserved_bytes"));
    }
    out += paint.alert(line) + "\n";
  }
}

}  // namespace

std::string render_top(const json& report, const TopStyle& style) {
  const Painter paint(style.color);
  std::string out;

  const json& daemon = object_at(report, "daemon");
  out += paint.bold("steptrace top");
  if (!style.note.empty()) out += "  " + style.note;
  out += "\n";
  out += fmt::format(
      "steptraced up {}, {} client connections, {} events received, {} dropped by clients, {} "
      "protocol errors\n",
      units::age(u64(daemon, "uptime_s") * 1'000'000'000), u64(daemon, "clients_connected"),
      u64(daemon, "events_received"), u64(daemon, "events_dropped_by_clients"),
      u64(daemon, "protocol_errors"));

  std::vector<const json*> live;
  std::size_t exited = 0;
  std::size_t waiting = 0;
  for (const json& process : array_at(report, "processes")) {
    if (!flag(process, "alive", true)) {
      ++exited;
      continue;
    }
    live.push_back(&process);
    for (const json& span : array_at(process, "current")) {
      if (str(span, "step") == kWaitPollStep) {
        ++waiting;
        break;
      }
    }
  }
  std::stable_sort(live.begin(), live.end(),
                   [](const json* a, const json* b) { return u64(*a, "pid") < u64(*b, "pid"); });
  out += fmt::format("{} live process{}", live.size(), live.size() == 1 ? "" : "es");
  if (exited > 0) out += fmt::format(" ({} exited, not shown)", exited);
  if (waiting > 0) out += ", " + paint.alert(fmt::format("{} WAITING FOR VRAM", waiting));
  out += "\n";

  for (const json* process : live) {
    out += "\n";
    render_process(*process, paint, out);
  }

  const json& gpus = array_at(object_at(report, "ledger"), "gpus");
  out += "\n";
  if (gpus.empty()) out += paint.dim("VRAM ledger: no GPU seen yet") + "\n";
  for (const json& gpu : gpus) render_gpu(gpu, paint, out);
  return out;
}

}  // namespace steptrace::cli
