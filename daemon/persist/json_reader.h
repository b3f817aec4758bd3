// A strict reader for JSON documents the daemon did not build itself (snapshot files, the
// config file), over nlohmann::json and without exceptions.
//
// Strict: an object's keys are exactly those the caller reads (an unknown key is an
// error at finish(), unless the caller declared it with ignore() or reads it with an
// optional_* getter), every value has a type and a range, every array and string a
// maximum size. The first error wins and says where and what: "path: reason", e.g.
// `processes[3].steps[1].histogram.prom: must be an array of 23 elements`. Every getter
// after an error fails at once without looking at the document, so a reader can chain
// getters and check the result once; it checks a getter's result where it uses the
// value (an index, a key).
//
// Data flow: the snapshot codec (daemon/persist/snapshot_codec.cpp) and the config
// (daemon/serve/config.cpp) make one JsonReader per document, take its root with
// object(), read fields down the tree, and report error()->message().
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace steptrace::daemon {

// Where a document is wrong and why. `path` is empty for the document itself, else
// keys joined by '.' and array indices in brackets ("gpus[0].reservations[2].bytes");
// a key that is not [A-Za-z0-9_-] is quoted in brackets (`protocol_errors["a b"]`).
struct JsonError {
  std::string path;
  std::string reason;  // "must be an integer in 1..4096", "missing", "unknown key", ...
  // "path: reason", or the reason alone for the document itself.
  std::string message() const;
};

// Bounds of a string value, in bytes.
struct StringRule {
  std::size_t min_length = 0;
  std::size_t max_length = 0;
  bool printable = true;  // every byte printable ASCII (proto::is_printable)
};

class JsonObject;
class JsonArray;

class JsonReader {
 public:
  // The document as an object / an array of at most `max_size` elements; an error at
  // the root when it is not one.
  JsonObject object(const nlohmann::json& doc);
  // The same for a value inside a document read in parts: its errors name `path`.
  JsonObject object(const nlohmann::json& value, std::string path);
  JsonArray array(const nlohmann::json& doc, std::size_t max_size);

  bool ok() const { return !error_; }
  const std::optional<JsonError>& error() const { return error_; }
  // Records an error at `path` unless one is recorded already. Returns false.
  bool fail(std::string path, std::string reason);

 private:
  std::optional<JsonError> error_;
};

namespace json_reader_detail {
// A value being read: its reader, the value (nullptr once reading it failed) and its path.
class Cursor {
 public:
  const std::string& path() const { return path_; }
  // The reader has no error and this value is what it was asked to be.
  bool ok() const { return value_ != nullptr && reader_->ok(); }
  // An error at this value. Returns false.
  bool fail(std::string reason) const { return reader_->fail(path_, std::move(reason)); }

 protected:
  Cursor(JsonReader& reader, const nlohmann::json* value, std::string path)
      : reader_(&reader), value_(value), path_(std::move(path)) {}

  JsonReader* reader_;
  const nlohmann::json* value_;
  std::string path_;
};
}  // namespace json_reader_detail

// An object being read. Move-only: it remembers which keys were read, for finish().
class JsonObject : public json_reader_detail::Cursor {
 public:
  JsonObject(JsonObject&&) noexcept = default;
  JsonObject& operator=(JsonObject&&) noexcept = default;
  JsonObject(const JsonObject&) = delete;
  JsonObject& operator=(const JsonObject&) = delete;

  // Whether `key` is present (with any value, null included). Reads nothing.
  bool has(std::string_view key) const;
  std::size_t size() const;
  // The keys present, in the document's (sorted) order: for objects keyed by data,
  // whose values the caller then reads by key.
  std::vector<std::string_view> keys() const;

  // ---- required fields: "path.key: missing" when absent --------------------------
  // An integer in [min, max] (stored signed or unsigned by nlohmann; never a float).
  template <std::unsigned_integral T>
  bool get_unsigned(std::string_view key, T& out, std::uint64_t min = 0,
                    std::uint64_t max = std::numeric_limits<T>::max()) {
    std::uint64_t v = 0;
    if (!read_unsigned(key, min, max, /*required=*/true, v)) return false;
    out = static_cast<T>(v);
    return true;
  }
  bool get_bool(std::string_view key, bool& out);
  bool get_string(std::string_view key, std::string& out, const StringRule& rule);
  // A nested object / array (not ok() when missing or not one).
  JsonObject object(std::string_view key);
  JsonArray array(std::string_view key, std::size_t max_size);
  JsonArray array(std::string_view key, std::size_t min_size, std::size_t max_size);

  // ---- optional fields: when absent, `out` keeps its value (the default) ----------
  template <std::unsigned_integral T>
  bool optional_unsigned(std::string_view key, T& out, std::uint64_t min = 0,
                         std::uint64_t max = std::numeric_limits<T>::max()) {
    std::uint64_t v = out;
    if (!read_unsigned(key, min, max, /*required=*/false, v)) return false;
    out = static_cast<T>(v);
    return true;
  }
  bool optional_bool(std::string_view key, bool& out);
  bool optional_string(std::string_view key, std::string& out, const StringRule& rule);
  // nullopt when absent (or after an error).
  std::optional<JsonObject> optional_object(std::string_view key);
  // True when `key` is present and null (then it counts as read).
  bool is_null(std::string_view key);
  // Declares `key` allowed and not read: finish() does not call it unknown.
  void ignore(std::string_view key);

  // An error at `key` of this object ("path.key: reason"). Returns false.
  bool fail_at(std::string_view key, std::string reason) const;
  // Checks that every key present was read or ignored ("path.key: unknown key").
  // Returns ok().
  bool finish();

 private:
  friend class JsonReader;
  friend class JsonArray;
  JsonObject(JsonReader& reader, const nlohmann::json* value, std::string path);

  // The value at `key`, marked read; nullptr (and an error if `required`) when absent.
  const nlohmann::json* field(std::string_view key, bool required);
  bool read_unsigned(std::string_view key, std::uint64_t min, std::uint64_t max, bool required,
                     std::uint64_t& out);
  bool read_bool(std::string_view key, bool required, bool& out);
  bool read_string(std::string_view key, const StringRule& rule, bool required, std::string& out);

  std::vector<const std::string*> read_;  // keys read or ignored (the document's strings)
};

// An array being read; element i's path is "path[i]".
class JsonArray : public json_reader_detail::Cursor {
 public:
  // 0 when not ok(), so a loop over a failed array does nothing.
  std::size_t size() const;

  template <std::unsigned_integral T>
  bool get_unsigned(std::size_t index, T& out, std::uint64_t min = 0,
                    std::uint64_t max = std::numeric_limits<T>::max()) {
    std::uint64_t v = 0;
    if (!read_unsigned(index, min, max, v)) return false;
    out = static_cast<T>(v);
    return true;
  }
  bool get_string(std::size_t index, std::string& out, const StringRule& rule);
  JsonObject object(std::size_t index);
  JsonArray array(std::size_t index, std::size_t max_size);
  JsonArray array(std::size_t index, std::size_t min_size, std::size_t max_size);

  // An error at element `index` ("path[index]: reason"). Returns false.
  bool fail_at(std::size_t index, std::string reason) const;

 private:
  friend class JsonReader;
  friend class JsonObject;
  // `value` must be an array of min_size..max_size elements, else an error at `path`.
  JsonArray(JsonReader& reader, const nlohmann::json* value, std::string path, std::size_t min_size,
            std::size_t max_size);

  const nlohmann::json* element(std::size_t index) const;
  bool read_unsigned(std::size_t index, std::uint64_t min, std::uint64_t max, std::uint64_t& out);
};

}  // namespace steptrace::daemon
