#include "daemon/serve/command_syntax.h"

#include "proto/printable.h"

namespace steptrace::daemon::syntax {

std::string option_usage(std::string_view name, std::string_view value) {
  std::string usage(name);
  if (!value.empty()) usage += " " + std::string(value);
  return usage;
}

std::string and_list(const std::vector<std::string_view>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += i + 1 == names.size() ? " and " : ", ";
    out += names[i];
  }
  return out;
}

bool is_option(std::string_view word, std::string_view name) {
  return word == name ||
         (word.starts_with(name) && word.size() > name.size() && word[name.size()] == '=');
}

std::optional<std::string_view> option_value(std::string_view name, Args args, std::size_t& i) {
  const std::string_view word = args[i];
  if (word.size() > name.size()) return word.substr(name.size() + 1);  // "--name=V"
  if (i + 1 >= args.size()) return std::nullopt;
  return args[++i];
}

std::string unexpected(std::string_view word) {
  return "unexpected argument '" + proto::printable(word, 64) + "'";
}

CommandError command_error(std::string_view command, const std::string& what,
                           const std::string& usage) {
  std::string message = std::string(command) + ": " + what;
  if (!usage.empty()) message += " (usage: " + usage + ")";
  return CommandError{std::move(message)};
}

}  // namespace steptrace::daemon::syntax
