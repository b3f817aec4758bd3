// libsteptrace.so exports the C ABI and nothing else (version script + hidden
// visibility): every defined dynamic text symbol is steptrace_* or a standard one.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <set>
#include <sstream>
#include <string>

namespace {

std::string run(const std::string& command) {
  std::string out;
  FILE* p = ::popen(command.c_str(), "r");
  if (p == nullptr) return out;
  std::array<char, 4096> buf;
  std::size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  ::pclose(p);
  return out;
}

TEST(ExportedSymbols, OnlySteptraceFunctions) {
  const std::string out = run(std::string("nm -D --defined-only ") + STEPTRACE_CLIENT_SO);
  ASSERT_FALSE(out.empty());
  const std::set<std::string> standard = {"_init", "_fini", "_edata", "_end", "__bss_start"};
  std::set<std::string> exported;
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    std::string addr, type, name;
    if (!(fields >> addr >> type >> name)) continue;
    if (type == "A") continue;  // the version node (STEPTRACE_0)
    name = name.substr(0, name.find('@'));
    if (standard.count(name) != 0) continue;
    EXPECT_EQ(name.rfind("steptrace_", 0), 0u) << "unexpected export: " << line;
    exported.insert(name);
  }
  for (const char* fn :
       {"steptrace_connect", "steptrace_register_step", "steptrace_start", "steptrace_end",
        "steptrace_ledger_reserve", "steptrace_ledger_release", "steptrace_ledger_cleanup",
        "steptrace_vram_sample", "steptrace_flush", "steptrace_dropped", "steptrace_set_enabled",
        "steptrace_set_block_when_full", "steptrace_shutdown", "steptrace_dropped_by_cause",
        "steptrace_set_buffer_size", "steptrace_rejected"}) {
    EXPECT_EQ(exported.count(fn), 1u) << fn << " is not exported";
  }
}

}  // namespace
