#include "cli/top_view.h"

#include <fmt/format.h>
#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
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

// The rank a process sent, if any (null or absent: none).
std::optional<std::uint64_t> rank_of(const json& process) {
  if (!process.is_object()) return std::nullopt;
  const auto it = process.find("rank");
  if (it == process.end() || !it->is_number_integer() || it->get<std::int64_t>() < 0) {
    return std::nullopt;
  }
  return u64(process, "rank");
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
  if (const std::string job = str(process, "job", ""); !job.empty()) out += "  job " + job;
  if (const auto rank = rank_of(process)) {
    out += fmt::format("  rank {}", *rank);
    if (const auto world = u64(process, "world_size"); world > 0) out += fmt::format("/{}", world);
  }
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

// ---- the interactive screen ---------------------------------------------------------

// Columns a string takes on the terminal: the report's strings are printable ASCII once
// read through str(), our units add UTF-8 ("µs"): one column a code point.
std::size_t columns(std::string_view text) {
  std::size_t n = 0;
  for (const char c : text) {
    if ((static_cast<unsigned char>(c) & 0xC0) != 0x80) ++n;
  }
  return n;
}

// `text` cut to at most `width` columns, on a code point boundary.
std::string cut(std::string_view text, std::size_t width) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xC0) != 0x80) {
      if (n == width) return std::string(text.substr(0, i));
      ++n;
    }
  }
  return std::string(text);
}

// `text` cut or padded to exactly `width` columns (left-aligned), or right-aligned.
std::string cell(std::string_view text, std::size_t width) {
  std::string out = cut(text, width);
  out.append(width - columns(out), ' ');
  return out;
}
std::string cell_right(std::string_view text, std::size_t width) {
  std::string out = cut(text, width);
  return std::string(width - columns(out), ' ') + out;
}

enum class Tone { kPlain, kBold, kDim, kAlert, kHeading };

// One screen line as pieces with their highlighting, so it can be cut to the terminal's
// width before any escape sequence is added.
struct Piece {
  std::string text;
  Tone tone = Tone::kPlain;
};
using Line = std::vector<Piece>;

std::string paint_line(const Line& line, std::size_t width, bool color) {
  std::string out;
  std::size_t left = width == 0 ? std::numeric_limits<std::size_t>::max() : width;
  for (const Piece& piece : line) {
    if (left == 0) break;
    std::string text = cut(piece.text, left);
    left -= columns(text);
    if (color && piece.tone != Tone::kPlain && !text.empty()) {
      const char* code = piece.tone == Tone::kBold    ? "\x1b[1m"
                         : piece.tone == Tone::kDim   ? "\x1b[2m"
                         : piece.tone == Tone::kAlert ? "\x1b[1;97;41m"
                                                      : "\x1b[7m";
      out += code + text + "\x1b[0m";
    } else {
      out += text;
    }
  }
  return out;
}

// The job of a process or of a jobs[] entry, as TopScreen::job spells it.
std::string job_key(const json& object) {
  if (!object.is_object()) return "";
  const auto it = object.find("job");
  if (it == object.end() || !it->is_string()) return "";
  return std::to_string(u64(object, "uid")) + ":" +
         proto::printable(it->get_ref<const std::string&>());
}

// rank -> what it straggles in, for one job: jobs[].stragglers (issue 27), when the
// daemon sends it; entries of another shape are skipped.
struct Straggler {
  std::uint64_t rank = 0;
  std::string step;
  double ratio = 0;
};

std::vector<std::pair<std::string, Straggler>> stragglers_of(const json& report) {
  std::vector<std::pair<std::string, Straggler>> out;
  for (const json& job : array_at(report, "jobs")) {
    const std::string key = job_key(job);
    if (key.empty()) continue;
    for (const json& s : array_at(job, "stragglers")) {
      if (!s.is_object()) continue;
      const auto rank = s.find("rank");
      if (rank == s.end() || !rank->is_number_integer() || rank->get<std::int64_t>() < 0) continue;
      Straggler straggler{u64(s, "rank"), str(s, "step", ""), 0.0};
      if (const auto ratio = s.find("ratio"); ratio != s.end() && ratio->is_number()) {
        straggler.ratio = ratio->get<double>();
      }
      out.emplace_back(key, std::move(straggler));
    }
  }
  return out;
}

// Traced time of a process: the sum of its steps' self time (nested spans counted once),
// or of their total time from a daemon that does not send self_ns.
std::uint64_t busy_ns(const json& process) {
  std::uint64_t self = 0;
  std::uint64_t total = 0;
  bool has_self = false;
  for (const json& step : array_at(process, "steps")) {
    if (step.is_object() && step.contains("self_ns")) has_self = true;
    self += u64(step, "self_ns");
    total += u64(step, "total_ns");
  }
  return has_self ? self : total;
}

// The step with the most time, and its share of the process's steps.
std::string busiest_step(const json& process) {
  const json* best = nullptr;
  std::uint64_t sum = 0;
  for (const json& step : array_at(process, "steps")) {
    sum += u64(step, "total_ns");
    if (best == nullptr || u64(step, "total_ns") > u64(*best, "total_ns")) best = &step;
  }
  if (best == nullptr || sum == 0) return "-";
  const double share =
      100.0 * static_cast<double>(u64(*best, "total_ns")) / static_cast<double>(sum);
  return fmt::format("{} {:.0f}%", str(*best, "step"), share);
}

bool waits_for_vram(const json& process) {
  for (const json& span : array_at(process, "current")) {
    if (str(span, "step") == kWaitPollStep) return true;
  }
  return false;
}

// Widths of the process table's columns (NOW takes the rest of the line). A narrow
// terminal (below kWideColumns) drops UID and BUSIEST STEP, so what the process does now
// still shows at 70 columns.
struct Layout {
  bool wide = true;
  std::size_t job = 12;
  std::size_t comm = 16;
  std::size_t time = 10;
};
constexpr std::size_t kWideColumns = 110;
constexpr std::size_t kPidWidth = 7;  // pid_max is at most 2^22: 7 digits
constexpr std::size_t kUidWidth = 6;
constexpr std::size_t kRankWidth = 6;
constexpr std::size_t kStepWidth = 16;

Layout layout_for(std::size_t width) {
  if (width == 0 || width >= kWideColumns) return {};
  return {false, 8, 12, 9};
}

std::string table_head(const Layout& layout) {
  std::string head = cell("PID", kPidWidth) + " ";
  if (layout.wide) head += cell("UID", kUidWidth) + " ";
  head += cell("JOB", layout.job) + " " + cell_right("RANK", kRankWidth - 1) + " " +
          cell("COMM", layout.comm) + " " + cell_right("TIME", layout.time) + " ";
  if (layout.wide) head += cell("BUSIEST STEP", kStepWidth) + " ";
  return head + "NOW";
}

Line process_row(const json& process, bool straggles, const Layout& layout) {
  std::string rank = "-";
  if (const auto r = rank_of(process)) {
    rank = std::to_string(*r);
    if (const auto world = u64(process, "world_size"); world > 0) {
      rank += "/" + std::to_string(world);
    }
  }
  if (straggles) rank += "!";
  const std::string job = str(process, "job", "-");
  std::string who = cell(std::to_string(u64(process, "pid")), kPidWidth) + " ";
  if (layout.wide) who += cell(std::to_string(u64(process, "uid")), kUidWidth) + " ";
  Line line{{who + cell(job, layout.job) + " "}};
  line.push_back({cell_right(rank, kRankWidth - 1), straggles ? Tone::kAlert : Tone::kPlain});
  std::string what = " " + cell(str(process, "comm"), layout.comm) + " " +
                     cell_right(units::duration(busy_ns(process)), layout.time) + " ";
  if (layout.wide) what += cell(busiest_step(process), kStepWidth) + " ";
  line.push_back({what});
  const json& current = array_at(process, "current");
  if (current.empty()) {
    line.push_back({"-", Tone::kDim});
    return line;
  }
  // The thread in a span longest: what the process waits on, if anything.
  const json* longest = &current.front();
  for (const json& span : current) {
    if (u64(span, "open_for_ns") > u64(*longest, "open_for_ns")) longest = &span;
  }
  std::string more = current.size() > 1 ? fmt::format(" +{} thr", current.size() - 1) : "";
  // A thread polling for VRAM is the news, whatever the others do: said first, so a
  // narrow terminal does not cut it off.
  for (const json& span : current) {
    if (str(span, "step") == kWaitPollStep) {
      line.push_back(
          {"WAITING FOR VRAM " + units::duration(u64(span, "open_for_ns")), Tone::kAlert});
      line.push_back({more});
      return line;
    }
  }
  line.push_back(
      {str(*longest, "step") + " " + units::duration(u64(*longest, "open_for_ns")) + more});
  return line;
}

Line gpu_row(const json& gpu) {
  const auto total = u64(gpu, "total_bytes");
  std::string text = "reserved " + units::bytes(u64(gpu, "reserved_bytes"));
  if (total > 0)
    text += " of " + units::bytes(total) + ", free " + units::bytes(u64(gpu, "free_bytes"));
  std::size_t leaked = 0;
  std::size_t expired = 0;
  const json& reservations = array_at(gpu, "reservations");
  for (const json& r : reservations) {
    const std::string state = str(r, "state", flag(r, "holder_alive", true) ? "alive" : "LEAKED");
    if (state == "LEAKED") ++leaked;
    if (state == "EXPIRED") ++expired;
  }
  text +=
      fmt::format(", {} reservation{}", reservations.size(), reservations.size() == 1 ? "" : "s");
  Line line{{"GPU " + str(gpu, "gpu"), Tone::kBold}, {" " + text}};
  if (leaked > 0) line.push_back({fmt::format(" {} LEAKED", leaked), Tone::kAlert});
  if (expired > 0) line.push_back({fmt::format(" {} EXPIRED", expired), Tone::kAlert});
  if (const auto findings = array_at(gpu, "findings").size(); findings > 0) {
    line.push_back(
        {fmt::format(" {} finding{}", findings, findings == 1 ? "" : "s"), Tone::kAlert});
  }
  return line;
}

const char* sort_name(TopSort sort) {
  switch (sort) {
    case TopSort::kName:
      return "name";
    case TopSort::kPid:
      return "pid";
    case TopSort::kTime:
      break;
  }
  return "time";
}

}  // namespace

std::vector<std::string> top_jobs(const json& report) {
  std::vector<std::string> jobs;
  for (const json& job : array_at(report, "jobs")) {
    std::string key = job_key(job);
    if (!key.empty() && std::find(jobs.begin(), jobs.end(), key) == jobs.end()) {
      jobs.push_back(std::move(key));
    }
  }
  // A daemon without jobs[]: the processes say their jobs too.
  for (const json& process : array_at(report, "processes")) {
    std::string key = job_key(process);
    if (!key.empty() && std::find(jobs.begin(), jobs.end(), key) == jobs.end()) {
      jobs.push_back(std::move(key));
    }
  }
  return jobs;
}

std::vector<std::string> render_top_screen(const json& report, const TopScreen& screen) {
  const std::size_t width = screen.width;
  const auto stragglers = stragglers_of(report);

  std::vector<const json*> shown;
  std::size_t exited = 0;
  std::size_t waiting = 0;
  for (const json& process : array_at(report, "processes")) {
    if (!screen.job.empty() && job_key(process) != screen.job) continue;
    if (!flag(process, "alive", true)) {
      ++exited;
      continue;
    }
    shown.push_back(&process);
    if (waits_for_vram(process)) ++waiting;
  }
  const auto by_pid = [](const json* a, const json* b) { return u64(*a, "pid") < u64(*b, "pid"); };
  std::stable_sort(shown.begin(), shown.end(), by_pid);
  if (screen.sort == TopSort::kTime) {
    std::stable_sort(shown.begin(), shown.end(),
                     [](const json* a, const json* b) { return busy_ns(*a) > busy_ns(*b); });
  } else if (screen.sort == TopSort::kName) {
    std::stable_sort(shown.begin(), shown.end(), [](const json* a, const json* b) {
      return str(*a, "comm") < str(*b, "comm");
    });
  }

  // The header: it stays whatever the height.
  std::vector<Line> head;
  head.push_back({{"steptrace top", Tone::kBold}, {screen.note.empty() ? "" : "  " + screen.note}});
  const json& daemon = object_at(report, "daemon");
  head.push_back(
      {{fmt::format("up {}, {} connections, {} events, {} dropped, {} protocol errors",
                    units::age(u64(daemon, "uptime_s") * 1'000'000'000),
                    u64(daemon, "clients_connected"), u64(daemon, "events_received"),
                    u64(daemon, "events_dropped_by_clients"), u64(daemon, "protocol_errors"))}});
  Line summary{{fmt::format("{} live process{}", shown.size(), shown.size() == 1 ? "" : "es")}};
  if (exited > 0) summary.push_back({fmt::format(" ({} exited)", exited)});
  if (waiting > 0) summary.push_back({fmt::format(", {} WAITING FOR VRAM", waiting), Tone::kAlert});
  summary.push_back({fmt::format("; sort: {}; job: {}", sort_name(screen.sort),
                                 screen.job.empty() ? "all" : screen.job)});
  head.push_back(std::move(summary));
  std::size_t straggler_count = 0;
  Line straggler_line{{"stragglers:", Tone::kAlert}};
  for (const auto& [job, s] : stragglers) {
    if (!screen.job.empty() && job != screen.job) continue;
    ++straggler_count;
    std::string text = fmt::format(" {} rank {}", job, s.rank);
    if (!s.step.empty()) text += " " + s.step;
    if (s.ratio > 0) text += fmt::format(" x{:.2f}", s.ratio);
    straggler_line.push_back({text});
  }
  if (straggler_count > 0) head.push_back(std::move(straggler_line));
  const Layout layout = layout_for(width);
  // The heading's reverse video spans the whole width, like htop's.
  std::string heading = table_head(layout);
  if (width > columns(heading)) heading.append(width - columns(heading), ' ');
  head.push_back({{heading, Tone::kHeading}});

  std::vector<Line> gpus;
  const json& ledger_gpus = array_at(object_at(report, "ledger"), "gpus");
  if (ledger_gpus.empty()) gpus.push_back({{"VRAM ledger: no GPU seen yet", Tone::kDim}});
  for (const json& gpu : ledger_gpus) gpus.push_back(gpu_row(gpu));

  std::vector<Line> foot;
  if (!screen.keys.empty()) foot.push_back({{screen.keys, Tone::kDim}});

  // Rows for processes and GPUs: what the header and the key line leave. The GPUs get a
  // third of it at most (one line at least, when there is room), the processes the rest;
  // what does not fit is summarised in one line each.
  const std::size_t fixed = head.size() + foot.size();
  std::size_t process_rows = shown.size() + (shown.empty() ? 1 : 0);
  std::size_t gpu_rows = gpus.size();
  if (screen.height > 0) {
    const std::size_t room = screen.height > fixed ? screen.height - fixed : 0;
    gpu_rows = std::min(gpus.size(), room >= 3 ? std::max<std::size_t>(1, room / 3) : 0);
    process_rows = room - gpu_rows;
  }

  std::vector<Line> lines = std::move(head);
  if (shown.empty()) {
    if (process_rows > 0) lines.push_back({{"(no live process)", Tone::kDim}});
  } else {
    const bool all = shown.size() <= process_rows;
    const std::size_t listed = all ? shown.size() : (process_rows == 0 ? 0 : process_rows - 1);
    for (std::size_t i = 0; i < listed; ++i) {
      const json& process = *shown[i];
      const auto rank = rank_of(process);
      const std::string key = job_key(process);
      const bool straggles =
          rank && std::any_of(stragglers.begin(), stragglers.end(), [&](const auto& entry) {
            return entry.first == key && entry.second.rank == *rank;
          });
      lines.push_back(process_row(process, straggles, layout));
    }
    if (!all && process_rows > 0) {
      std::uint64_t rest_ns = 0;
      std::size_t rest_waiting = 0;
      for (std::size_t i = listed; i < shown.size(); ++i) {
        rest_ns += busy_ns(*shown[i]);
        if (waits_for_vram(*shown[i])) ++rest_waiting;
      }
      Line more{{fmt::format("+ {} more process{}, {} traced", shown.size() - listed,
                             shown.size() - listed == 1 ? "" : "es", units::duration(rest_ns)),
                 Tone::kDim}};
      if (rest_waiting > 0) {
        more.push_back({fmt::format(", {} WAITING FOR VRAM", rest_waiting), Tone::kAlert});
      }
      lines.push_back(std::move(more));
    }
  }
  if (gpu_rows > 0) {
    const bool all = gpus.size() <= gpu_rows;
    const std::size_t listed = all ? gpus.size() : gpu_rows - 1;
    for (std::size_t i = 0; i < listed; ++i) lines.push_back(std::move(gpus[i]));
    if (!all) {
      lines.push_back(
          {{fmt::format("+ {} more GPUs (steptrace ledger)", gpus.size() - listed), Tone::kDim}});
    }
  }
  for (Line& line : foot) lines.push_back(std::move(line));
  if (screen.height > 0 && lines.size() > screen.height) lines.resize(screen.height);

  std::vector<std::string> out;
  out.reserve(lines.size());
  for (const Line& line : lines) out.push_back(paint_line(line, width, screen.color));
  return out;
}

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
