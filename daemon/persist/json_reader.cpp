#include "daemon/persist/json_reader.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "proto/codec.h"

namespace steptrace::daemon {
namespace {

using nlohmann::json;

constexpr std::uint64_t kU64Max = std::numeric_limits<std::uint64_t>::max();
// A key longer than this is cut in paths: a path is for a log line.
constexpr std::size_t kMaxKeyInPath = 64;

bool plain_key(std::string_view key) {
  return !key.empty() && std::all_of(key.begin(), key.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '-';
  });
}

std::string key_path(const std::string& parent, std::string_view key) {
  if (plain_key(key) && key.size() <= kMaxKeyInPath) {
    return parent.empty() ? std::string(key) : parent + "." + std::string(key);
  }
  // Quoted and escaped, so that no key can put a newline or a quote into a log line.
  std::string shown(key.substr(0, kMaxKeyInPath));
  for (char& c : shown) {
    if (!proto::is_printable(c)) c = '?';
  }
  std::string quoted = json(shown).dump();
  if (key.size() > kMaxKeyInPath) quoted.insert(quoted.size() - 1, "...");
  return parent + "[" + quoted + "]";
}

std::string index_path(const std::string& parent, std::size_t index) {
  return parent + "[" + std::to_string(index) + "]";
}

std::string unsigned_reason(std::uint64_t min, std::uint64_t max) {
  if (min == 0 && max == kU64Max) return "must be an unsigned integer";
  return "must be an integer in " + std::to_string(min) + ".." + std::to_string(max);
}

std::string array_reason(std::size_t min_size, std::size_t max_size) {
  if (min_size == max_size) return "must be an array of " + std::to_string(max_size) + " elements";
  if (min_size == 0) return "must be an array of at most " + std::to_string(max_size) + " elements";
  return "must be an array of " + std::to_string(min_size) + ".." + std::to_string(max_size) +
         " elements";
}

std::string string_reason(const StringRule& rule) {
  const char* unit = rule.printable ? " printable characters" : " bytes";
  if (rule.min_length == 0) {
    return "must be a string of at most " + std::to_string(rule.max_length) + unit;
  }
  return "must be a string of " + std::to_string(rule.min_length) + ".." +
         std::to_string(rule.max_length) + unit;
}

// The value as an unsigned integer: nlohmann keeps integers built in memory signed and
// makes parsed non-negative ones unsigned; floats are never integers here.
std::optional<std::uint64_t> as_unsigned(const json& v) {
  if (v.is_number_unsigned()) return v.get<std::uint64_t>();
  if (v.is_number_integer() && v.get<std::int64_t>() >= 0) {
    return static_cast<std::uint64_t>(v.get<std::int64_t>());
  }
  return std::nullopt;
}

bool read_unsigned_value(const json& v, const json_reader_detail::Cursor& at, std::uint64_t min,
                         std::uint64_t max, std::uint64_t& out) {
  const auto n = as_unsigned(v);
  if (!n || *n < min || *n > max) return at.fail(unsigned_reason(min, max));
  out = *n;
  return true;
}

bool read_string_value(const json& v, const json_reader_detail::Cursor& at, const StringRule& rule,
                       std::string& out) {
  if (!v.is_string()) return at.fail("must be a string");
  const auto& text = v.get_ref<const std::string&>();
  if (text.size() < rule.min_length || text.size() > rule.max_length ||
      (rule.printable && !std::all_of(text.begin(), text.end(), proto::is_printable))) {
    return at.fail(string_reason(rule));
  }
  out = text;
  return true;
}

// A cursor on one value, to report an error at its path.
class At : public json_reader_detail::Cursor {
 public:
  At(JsonReader& reader, const json* value, std::string path)
      : Cursor(reader, value, std::move(path)) {}
};

}  // namespace

// ---- JsonError / JsonReader --------------------------------------------------------------

std::string JsonError::message() const { return path.empty() ? reason : path + ": " + reason; }

bool JsonReader::fail(std::string path, std::string reason) {
  if (!error_) error_ = JsonError{std::move(path), std::move(reason)};
  return false;
}

JsonObject JsonReader::object(const json& doc) { return JsonObject(*this, &doc, ""); }
JsonObject JsonReader::object(const json& value, std::string path) {
  return JsonObject(*this, &value, std::move(path));
}

JsonArray JsonReader::array(const json& doc, std::size_t max_size) {
  return JsonArray(*this, &doc, "", 0, max_size);
}

// ---- JsonObject ------------------------------------------------------------------------

JsonObject::JsonObject(JsonReader& reader, const json* value, std::string path)
    : Cursor(reader, value, std::move(path)) {
  if (value_ == nullptr || !reader_->ok()) {
    value_ = nullptr;
    return;
  }
  if (!value_->is_object()) {
    fail("must be an object");
    value_ = nullptr;
  }
}

bool JsonObject::has(std::string_view key) const { return ok() && value_->contains(key); }

std::size_t JsonObject::size() const { return ok() ? value_->size() : 0; }

std::vector<std::string_view> JsonObject::keys() const {
  std::vector<std::string_view> out;
  if (!ok()) return out;
  out.reserve(value_->size());
  for (auto it = value_->begin(); it != value_->end(); ++it) out.emplace_back(it.key());
  return out;
}

const json* JsonObject::field(std::string_view key, bool required) {
  if (!ok()) return nullptr;
  const auto it = value_->find(key);
  if (it == value_->end()) {
    if (required) fail_at(key, "missing");
    return nullptr;
  }
  const std::string* name = &it.key();
  if (std::find(read_.begin(), read_.end(), name) == read_.end()) read_.push_back(name);
  return &*it;
}

bool JsonObject::read_unsigned(std::string_view key, std::uint64_t min, std::uint64_t max,
                               bool required, std::uint64_t& out) {
  const json* v = field(key, required);
  if (v == nullptr) return !required && ok();
  return read_unsigned_value(*v, At(*reader_, v, key_path(path_, key)), min, max, out);
}

bool JsonObject::read_bool(std::string_view key, bool required, bool& out) {
  const json* v = field(key, required);
  if (v == nullptr) return !required && ok();
  if (!v->is_boolean()) return fail_at(key, "must be a boolean");
  out = v->get<bool>();
  return true;
}

bool JsonObject::read_string(std::string_view key, const StringRule& rule, bool required,
                             std::string& out) {
  const json* v = field(key, required);
  if (v == nullptr) return !required && ok();
  return read_string_value(*v, At(*reader_, v, key_path(path_, key)), rule, out);
}

bool JsonObject::get_bool(std::string_view key, bool& out) { return read_bool(key, true, out); }

bool JsonObject::get_string(std::string_view key, std::string& out, const StringRule& rule) {
  return read_string(key, rule, true, out);
}

JsonObject JsonObject::object(std::string_view key) {
  return JsonObject(*reader_, field(key, true), key_path(path_, key));
}

JsonArray JsonObject::array(std::string_view key, std::size_t max_size) {
  return array(key, 0, max_size);
}

JsonArray JsonObject::array(std::string_view key, std::size_t min_size, std::size_t max_size) {
  return JsonArray(*reader_, field(key, true), key_path(path_, key), min_size, max_size);
}

bool JsonObject::optional_bool(std::string_view key, bool& out) {
  return read_bool(key, false, out);
}

bool JsonObject::optional_string(std::string_view key, std::string& out, const StringRule& rule) {
  return read_string(key, rule, false, out);
}

std::optional<JsonObject> JsonObject::optional_object(std::string_view key) {
  const json* v = field(key, false);
  if (v == nullptr) return std::nullopt;
  JsonObject o(*reader_, v, key_path(path_, key));
  if (!o.ok()) return std::nullopt;
  return o;
}

bool JsonObject::is_null(std::string_view key) {
  if (!ok()) return false;
  const auto it = value_->find(key);
  if (it == value_->end() || !it->is_null()) return false;
  field(key, false);  // marks it read
  return true;
}

void JsonObject::ignore(std::string_view key) { field(key, false); }

bool JsonObject::fail_at(std::string_view key, std::string reason) const {
  return reader_->fail(key_path(path_, key), std::move(reason));
}

bool JsonObject::finish() {
  if (!ok()) return false;
  if (read_.size() == value_->size()) return true;  // every key read (each counted once)
  for (auto it = value_->begin(); it != value_->end(); ++it) {
    if (std::find(read_.begin(), read_.end(), &it.key()) == read_.end()) {
      return fail_at(it.key(), "unknown key");
    }
  }
  return true;
}

// ---- JsonArray -------------------------------------------------------------------------

JsonArray::JsonArray(JsonReader& reader, const json* value, std::string path, std::size_t min_size,
                     std::size_t max_size)
    : Cursor(reader, value, std::move(path)) {
  if (value_ == nullptr || !reader_->ok()) {
    value_ = nullptr;
    return;
  }
  if (!value_->is_array() || value_->size() < min_size || value_->size() > max_size) {
    fail(array_reason(min_size, max_size));
    value_ = nullptr;
  }
}

std::size_t JsonArray::size() const { return ok() ? value_->size() : 0; }

const json* JsonArray::element(std::size_t index) const {
  if (!ok()) return nullptr;
  if (index >= value_->size()) {
    fail_at(index, "missing");
    return nullptr;
  }
  return &(*value_)[index];
}

bool JsonArray::read_unsigned(std::size_t index, std::uint64_t min, std::uint64_t max,
                              std::uint64_t& out) {
  const json* v = element(index);
  if (v == nullptr) return false;
  return read_unsigned_value(*v, At(*reader_, v, index_path(path_, index)), min, max, out);
}

bool JsonArray::get_string(std::size_t index, std::string& out, const StringRule& rule) {
  const json* v = element(index);
  if (v == nullptr) return false;
  return read_string_value(*v, At(*reader_, v, index_path(path_, index)), rule, out);
}

JsonObject JsonArray::object(std::size_t index) {
  return JsonObject(*reader_, element(index), index_path(path_, index));
}

JsonArray JsonArray::array(std::size_t index, std::size_t max_size) {
  return array(index, 0, max_size);
}

JsonArray JsonArray::array(std::size_t index, std::size_t min_size, std::size_t max_size) {
  return JsonArray(*reader_, element(index), index_path(path_, index), min_size, max_size);
}

bool JsonArray::fail_at(std::size_t index, std::string reason) const {
  return reader_->fail(index_path(path_, index), std::move(reason));
}

}  // namespace steptrace::daemon
