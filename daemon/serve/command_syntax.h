// The words a text command takes after its name, declared once per command
// (commands.cpp): the parser accepts exactly those words and the usage string, help's
// and every "(usage: ...)" of an error, is written from the same declaration, so the two
// cannot disagree.
//
// A syntax is groups of options (a flag, "--json", or an option with one value word,
// "--pid N" or "--pid=N"; a group of several is options that exclude each other,
// "[--pid N | --ledger]"), and other forms chosen by their first word and followed by
// words in a fixed order ("ledger cleanup GPU ID"). Each option or word stores what it
// read into the command's typed request, or says why the word is bad.
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace steptrace::daemon {

// A rejected command line; the reply is "error: " + message.
struct CommandError {
  std::string message;
};

template <typename Request>
using Parsed = std::variant<Request, CommandError>;

using Args = std::span<const std::string_view>;

namespace syntax {

// Why a word is bad (without the command's name), or nullopt when it was taken.
using Problem = std::optional<std::string>;

template <typename Request>
struct Option {
  std::string_view name;   // "--pid"
  std::string_view value;  // "N" in the usage; empty for a flag
  // Stores the value word (nullopt: the option was last, its value missing; always for a
  // flag) in the request.
  std::function<Problem(Request&, std::optional<std::string_view>)> take;
  bool repeatable = false;  // "[--pid N]...": given again, it adds
};

template <typename Request>
struct Word {
  std::string_view name;  // "GPU" in the usage
  std::function<Problem(Request&, std::string_view)> take;
};

// Another form of a command, chosen by its first word, then words in a fixed order:
// `ledger cleanup GPU ID`.
template <typename Request>
struct Form {
  std::string_view word{};  // "cleanup"
  std::vector<Word<Request>> words{};
  std::string_view wrong_count{};  // the error when there are more or fewer words
};

template <typename Request>
struct Syntax {
  // Each group is one option, or options that exclude each other.
  std::vector<std::vector<Option<Request>>> groups{};
  // `trace` names its usage in every error; the others only for a word they do not know
  // and for options that exclude each other.
  bool usage_in_every_error = false;
  std::vector<Form<Request>> forms{};
};

// "--pid N", "--ledger".
std::string option_usage(std::string_view name, std::string_view value);
// "--a, --b and --c".
std::string and_list(const std::vector<std::string_view>& names);
// `word` is the option `name` ("--name" or "--name=V").
bool is_option(std::string_view word, std::string_view name);
// The value of an option that takes one word ("--name V" or "--name=V"), advancing `i`
// past it; nullopt when the value is missing.
std::optional<std::string_view> option_value(std::string_view name, Args args, std::size_t& i);
// "unexpected argument 'W'", the word printable.
std::string unexpected(std::string_view word);
// "<command>: <what>", then " (usage: <usage>)" unless `usage` is empty.
CommandError command_error(std::string_view command, const std::string& what,
                           const std::string& usage);

// `command` and its options: "reset [--pid N | --ledger | --gpu UUID]".
template <typename Request>
std::string usage_of(const Syntax<Request>& syntax, std::string_view command) {
  std::string usage(command);
  for (const auto& group : syntax.groups) {
    usage += " [";
    for (std::size_t i = 0; i < group.size(); ++i) {
      if (i > 0) usage += " | ";
      usage += option_usage(group[i].name, group[i].value);
    }
    usage += group.size() == 1 && group[0].repeatable ? "]..." : "]";
  }
  return usage;
}

// `command` in another form: "ledger cleanup GPU ID".
template <typename Request>
std::string usage_of(const Form<Request>& form, std::string_view command) {
  std::string usage = std::string(command) + " " + std::string(form.word);
  for (const auto& word : form.words) usage += " " + std::string(word.name);
  return usage;
}

// Every form, as help shows it: "ledger [--json] | ledger cleanup GPU ID".
template <typename Request>
std::string full_usage(const Syntax<Request>& syntax, std::string_view command) {
  std::string usage = usage_of(syntax, command);
  for (const auto& form : syntax.forms) usage += " | " + usage_of(form, command);
  return usage;
}

template <typename Request>
class Parser {
 public:
  Parser(const Syntax<Request>& syntax, std::string_view command)
      : syntax_(syntax), command_(command) {}

  Parsed<Request> parse(Args args) const {
    for (const auto& form : syntax_.forms) {
      if (!args.empty() && args[0] == form.word) return parse_form(form, args.subspan(1));
    }
    return parse_options(args);
  }

 private:
  // An error of the command's own form, with its usage when `with_usage` or when the
  // command always names it.
  CommandError fail(const std::string& what, bool with_usage) const {
    const bool usage = with_usage || syntax_.usage_in_every_error;
    return command_error(command_, what, usage ? usage_of(syntax_, command_) : std::string());
  }

  Parsed<Request> parse_form(const Form<Request>& form, Args args) const {
    const std::string command = command_ + " " + std::string(form.word);
    if (args.size() != form.words.size()) {
      return command_error(command, std::string(form.wrong_count), usage_of(form, command_));
    }
    Request request{};
    for (std::size_t i = 0; i < args.size(); ++i) {
      if (Problem problem = form.words[i].take(request, args[i])) {
        return command_error(command, *problem, std::string());
      }
    }
    return request;
  }

  Parsed<Request> parse_options(Args args) const {
    Request request{};
    // Which options were given, group by group.
    std::vector<std::vector<bool>> given;
    for (const auto& group : syntax_.groups) given.emplace_back(group.size(), false);
    for (std::size_t i = 0; i < args.size(); ++i) {
      const std::string_view word = args[i];
      const auto [g, o] = find(word);
      if (g == syntax_.groups.size()) return fail(unexpected(word), true);
      const Option<Request>& option = syntax_.groups[g][o];
      if (given[g][o] && !option.repeatable) {
        return fail(std::string(option.name) + " given twice", false);
      }
      given[g][o] = true;
      const auto value = option.value.empty() ? std::nullopt : option_value(option.name, args, i);
      if (Problem problem = option.take(request, value)) return fail(*problem, false);
    }
    for (std::size_t g = 0; g < syntax_.groups.size(); ++g) {
      if (std::count(given[g].begin(), given[g].end(), true) < 2) continue;
      std::vector<std::string_view> names;
      for (const auto& option : syntax_.groups[g]) names.push_back(option.name);
      return fail(and_list(names) + " exclude each other", true);
    }
    return request;
  }

  // The group and option `word` names, or {groups.size(), 0}: a flag only as itself, an
  // option with a value also as "--name=V".
  std::pair<std::size_t, std::size_t> find(std::string_view word) const {
    for (std::size_t g = 0; g < syntax_.groups.size(); ++g) {
      for (std::size_t o = 0; o < syntax_.groups[g].size(); ++o) {
        const Option<Request>& option = syntax_.groups[g][o];
        if (option.value.empty() ? word == option.name : is_option(word, option.name)) {
          return {g, o};
        }
      }
    }
    return {syntax_.groups.size(), 0};
  }

  const Syntax<Request>& syntax_;
  std::string command_;
};

}  // namespace syntax
}  // namespace steptrace::daemon
