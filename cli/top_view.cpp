#include "cli/top_view.h"

#include <algorithm>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string_view>
#include <vector>

namespace steptrace::cli {
namespace {

using nlohmann::json;

constexpr std::string_view kWaitPollStep = "WaitPoll";
constexpr const char* kWaitingMarker = "<<< WAITING FOR VRAM";
constexpr const char* kLeakedMarker = "LEAKED (holder exited)";

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

std::string str(const json& object, const char* key, const char* fallback = "?") {
  if (!object.is_object()) return fallback;
  const auto it = object.find(key);
  if (it == object.end() || !it->is_string()) return fallback;
  return it->get<std::string>();
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

__attribute__((format(printf, 1, 2))) std::string printf_string(const char* format, ...) {
  std::va_list args;
  va_start(args, format);
  std::va_list again;
  va_copy(again, args);
  const int n = std::vsnprintf(nullptr, 0, format, args);
  va_end(args);
  std::string out;
  if (n > 0) {
    out.resize(static_cast<std::size_t>(n) + 1);
    std::vsnprintf(out.data(), out.size(), format, again);
    out.resize(static_cast<std::size_t>(n));
  }
  va_end(again);
  return out;
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
      printf_string("PID %-8" PRIu64 " %-16s", u64(process, "pid"), str(process, "comm").c_str()));
  out += printf_string("  uid %" PRIu64, u64(process, "uid"));
  if (const auto dropped = u64(process, "dropped"); dropped > 0) {
    out += printf_string("  dropped %" PRIu64 " events", dropped);
  }
  out += "\n";

  const json& current = array_at(process, "current");
  if (current.empty()) out += paint.dim("  (no open span)") + "\n";
  for (const json& span : current) {
    const std::string step = str(span, "step");
    const auto depth = u64(span, "depth");
    std::string where = step;
    if (depth > 1) where += printf_string(" (depth %" PRIu64 ")", depth);
    out += printf_string("  thread %-8" PRIu64 " in %-28s for %10s", u64(span, "thread"),
                         where.c_str(), format_duration_ns(u64(span, "open_for_ns")).c_str());
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
  out +=
      paint.dim(printf_string("  %-18s %10s %12s %8s", "Step", "Count", "Total", "Share")) + "\n";
  for (const json* step : rows) {
    const auto total = u64(*step, "total_ns");
    const double share =
        sum == 0 ? 0.0 : 100.0 * static_cast<double>(total) / static_cast<double>(sum);
    out += printf_string("  %-18s %10" PRIu64 " %12s %7.1f%%", str(*step, "step").c_str(),
                         u64(*step, "count"), format_duration_ns(total).c_str(), share);
    if (const auto open = u64(*step, "open"); open > 0)
      out += printf_string("  (%" PRIu64 " open)", open);
    out += "\n";
  }
}

void render_gpu(const json& gpu, const Painter& paint, std::string& out) {
  const auto total = u64(gpu, "total_bytes");
  const auto reserved = u64(gpu, "reserved_bytes");
  out += paint.bold("GPU " + str(gpu, "gpu")) + ": reserved " + format_bytes(reserved);
  if (total > 0) {
    out += " of " + format_bytes(total) + ", free " + format_bytes(u64(gpu, "free_bytes")) +
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
  out += paint.dim(
             printf_string("  %-20s %-8s %12s  %-24s %s", "id", "pid", "bytes", "task", "holder")) +
         "\n";
  for (const json& r : reservations) {
    const bool alive = flag(r, "holder_alive", true);
    out += printf_string("  %-20" PRIu64 " %-8" PRIu64 " %12s  %-24s ", u64(r, "id"), u64(r, "pid"),
                         format_bytes(u64(r, "bytes")).c_str(), str(r, "task", "").c_str());
    out += alive ? std::string("alive") : paint.alert(kLeakedMarker);
    out += "\n";
  }
}

std::string format_uptime(std::uint64_t s) {
  if (s < 60) return printf_string("%" PRIu64 "s", s);
  if (s < 3600) return printf_string("%" PRIu64 "m%02" PRIu64 "s", s / 60, s % 60);
  if (s < 86400) return printf_string("%" PRIu64 "h%02" PRIu64 "m", s / 3600, s / 60 % 60);
  return printf_string("%" PRIu64 "d%02" PRIu64 "h", s / 86400, s / 3600 % 24);
}

}  // namespace

std::string format_duration_ns(std::uint64_t ns) {
  if (ns < 1000) return printf_string("%" PRIu64 " ns", ns);
  const double v = static_cast<double>(ns);
  if (ns < 1000000) return printf_string("%.1f us", v / 1e3);
  if (ns < 1000000000) return printf_string("%.2f ms", v / 1e6);
  if (ns < 60ULL * 1000000000) return printf_string("%.2f s", v / 1e9);
  const std::uint64_t s = ns / 1000000000;
  if (s < 3600) return printf_string("%" PRIu64 "m%02" PRIu64 "s", s / 60, s % 60);
  return printf_string("%" PRIu64 "h%02" PRIu64 "m", s / 3600, (s / 60) % 60);
}

std::string format_bytes(std::uint64_t bytes) {
  constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return printf_string("%" PRIu64 " B", bytes);
  double v = static_cast<double>(bytes);
  std::size_t unit = 0;
  v /= 1024;
  while (v >= 1024 && unit + 1 < std::size(kUnits)) {
    v /= 1024;
    ++unit;
  }
  return printf_string(v < 10 ? "%.2f %s" : "%.1f %s", v, kUnits[unit]);
}

std::string render_top(const json& report, const TopStyle& style) {
  const Painter paint(style.color);
  std::string out;

  const json& daemon = object_at(report, "daemon");
  out += paint.bold("steptrace top");
  if (!style.note.empty()) out += "  " + style.note;
  out += "\n";
  out += printf_string("steptraced up %s, %" PRIu64 " client connections, %" PRIu64
                       " events received, %" PRIu64 " dropped by clients, %" PRIu64
                       " protocol errors\n",
                       format_uptime(u64(daemon, "uptime_s")).c_str(),
                       u64(daemon, "clients_connected"), u64(daemon, "events_received"),
                       u64(daemon, "events_dropped_by_clients"), u64(daemon, "protocol_errors"));

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
  out += printf_string("%zu live process%s", live.size(), live.size() == 1 ? "" : "es");
  if (exited > 0) out += printf_string(" (%zu exited, not shown)", exited);
  if (waiting > 0) {
    out += ", " + paint.alert(printf_string("%zu WAITING FOR VRAM", waiting));
  }
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
