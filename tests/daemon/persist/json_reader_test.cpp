// The strict JSON reader (daemon/persist/json_reader.h): every getter and bound, each
// kind of error with the path it names, optional fields, and the first error winning.
#include "daemon/persist/json_reader.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>

namespace steptrace::daemon {
namespace {

using nlohmann::json;

// The message of the reader's error, "" when there is none.
std::string message(const JsonReader& reader) {
  return reader.error() ? reader.error()->message() : "";
}

// Reads `doc`["v"] as an unsigned in [min, max] and returns the error message.
std::string unsigned_error(const json& value, std::uint64_t min, std::uint64_t max) {
  const json doc = {{"v", value}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  std::uint64_t out = 0;
  EXPECT_FALSE(o.get_unsigned("v", out, min, max)) << value.dump();
  return message(reader);
}

TEST(JsonReaderTest, ARootThatIsNotAnObjectIsAnErrorWithoutAPath) {
  const json doc = json::array();
  JsonReader reader;
  JsonObject o = reader.object(doc);
  EXPECT_FALSE(o.ok());
  EXPECT_FALSE(reader.ok());
  ASSERT_TRUE(reader.error());
  EXPECT_EQ(reader.error()->path, "");
  EXPECT_EQ(reader.error()->reason, "must be an object");
  EXPECT_EQ(message(reader), "must be an object");
}

TEST(JsonReaderTest, ErrorMessageIsPathColonReason) {
  EXPECT_EQ((JsonError{"a.b[2]", "missing"}.message()), "a.b[2]: missing");
  EXPECT_EQ((JsonError{"", "not ours"}.message()), "not ours");
}

TEST(JsonReaderTest, AMissingRequiredFieldIsNamed) {
  const json doc = {{"a", {{"b", json::object()}}}};
  JsonReader reader;
  JsonObject top = reader.object(doc);
  JsonObject b = top.object("a").object("b");
  std::uint64_t n = 0;
  EXPECT_FALSE(b.get_unsigned("count", n));
  EXPECT_EQ(message(reader), "a.b.count: missing");
}

TEST(JsonReaderTest, UnknownKeysAreNamedAtFinish) {
  const json doc = {{"known", 1}, {"zzz", 2}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  std::uint64_t n = 0;
  ASSERT_TRUE(o.get_unsigned("known", n));
  EXPECT_TRUE(reader.ok());  // not before finish()
  EXPECT_FALSE(o.finish());
  EXPECT_EQ(message(reader), "zzz: unknown key");
}

TEST(JsonReaderTest, UnknownKeysInsideArraysNameTheElement) {
  const json doc = {{"items", {{{"id", 1}}, {{"id", 2}, {"extra", true}}}}};
  JsonReader reader;
  JsonObject top = reader.object(doc);
  JsonArray items = top.array("items", 10);
  for (std::size_t i = 0; i < items.size(); ++i) {
    JsonObject item = items.object(i);
    std::uint32_t id = 0;
    item.get_unsigned("id", id);
    item.finish();
  }
  EXPECT_EQ(message(reader), "items[1].extra: unknown key");
}

TEST(JsonReaderTest, IgnoredAndOptionalKeysAreNotUnknown) {
  const json doc = {{"note", "for humans"}, {"opt", 3}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  o.ignore("note");
  o.ignore("not_there");  // ignoring an absent key is fine too
  std::uint64_t opt = 0;
  EXPECT_TRUE(o.optional_unsigned("opt", opt));
  EXPECT_EQ(opt, 3u);
  EXPECT_TRUE(o.finish());
  EXPECT_TRUE(reader.ok()) << message(reader);
}

TEST(JsonReaderTest, KeysReadTwiceCountOnce) {
  const json doc = {{"a", 1}, {"b", 2}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  std::uint64_t n = 0;
  o.get_unsigned("a", n);
  o.get_unsigned("a", n);
  EXPECT_FALSE(o.finish());
  EXPECT_EQ(message(reader), "b: unknown key");
}

TEST(JsonReaderTest, UnsignedAcceptsItsRangeAndBothIntegerKinds) {
  const json doc = {{"lo", 1}, {"hi", 10}, {"signed", std::int64_t{7}}, {"parsed", 0}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  std::uint64_t lo = 0, hi = 0, from_signed = 0;
  EXPECT_TRUE(o.get_unsigned("lo", lo, 1, 10));
  EXPECT_TRUE(o.get_unsigned("hi", hi, 1, 10));
  EXPECT_TRUE(o.get_unsigned("signed", from_signed));  // built in memory: number_integer
  EXPECT_EQ(lo, 1u);
  EXPECT_EQ(hi, 10u);
  EXPECT_EQ(from_signed, 7u);
  const json parsed = json::parse(R"({"n": 18446744073709551615})");
  JsonReader r2;
  JsonObject p = r2.object(parsed);
  std::uint64_t max = 0;
  EXPECT_TRUE(p.get_unsigned("n", max));
  EXPECT_EQ(max, std::numeric_limits<std::uint64_t>::max());
}

TEST(JsonReaderTest, UnsignedOutsideItsRangeOrNotAnIntegerIsNamed) {
  const std::string range = "v: must be an integer in 1..10";
  EXPECT_EQ(unsigned_error(0, 1, 10), range);   // below min
  EXPECT_EQ(unsigned_error(11, 1, 10), range);  // above max
  EXPECT_EQ(unsigned_error(-1, 1, 10), range);
  EXPECT_EQ(unsigned_error(1.5, 1, 10), range);
  EXPECT_EQ(unsigned_error(2.0, 1, 10), range);  // a float is never an integer here
  EXPECT_EQ(unsigned_error("5", 1, 10), range);
  EXPECT_EQ(unsigned_error(true, 1, 10), range);
  EXPECT_EQ(unsigned_error(nullptr, 1, 10), range);
  // The full range says so without numbers.
  EXPECT_EQ(unsigned_error(-1, 0, std::numeric_limits<std::uint64_t>::max()),
            "v: must be an unsigned integer");
}

TEST(JsonReaderTest, UnsignedDefaultMaxIsTheTargetTypes) {
  const json doc = {{"small", 255}, {"big", 256}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  std::uint8_t small = 0, big = 0;
  EXPECT_TRUE(o.get_unsigned("small", small));
  EXPECT_EQ(small, 255);
  EXPECT_FALSE(o.get_unsigned("big", big));
  EXPECT_EQ(big, 0);  // untouched on failure
  EXPECT_EQ(message(reader), "big: must be an integer in 0..255");
}

TEST(JsonReaderTest, BoolIsABooleanOnly) {
  const json doc = {{"yes", true}, {"one", 1}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  bool yes = false, one = false;
  EXPECT_TRUE(o.get_bool("yes", yes));
  EXPECT_TRUE(yes);
  EXPECT_FALSE(o.get_bool("one", one));
  EXPECT_EQ(message(reader), "one: must be a boolean");
}

std::string string_error(const json& value, const StringRule& rule) {
  const json doc = {{"s", value}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  std::string out = "untouched";
  EXPECT_FALSE(o.get_string("s", out, rule)) << value.dump();
  EXPECT_EQ(out, "untouched");
  return message(reader);
}

TEST(JsonReaderTest, StringBoundsAndPrintability) {
  const StringRule rule{2, 4};
  const json doc = {{"two", "ab"}, {"four", "abcd"}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  std::string two, four;
  EXPECT_TRUE(o.get_string("two", two, rule));
  EXPECT_TRUE(o.get_string("four", four, rule));
  EXPECT_EQ(two, "ab");
  EXPECT_EQ(four, "abcd");

  EXPECT_EQ(string_error(5, rule), "s: must be a string");
  EXPECT_EQ(string_error("a", rule), "s: must be a string of 2..4 printable characters");
  EXPECT_EQ(string_error("abcde", rule), "s: must be a string of 2..4 printable characters");
  EXPECT_EQ(string_error("a\nb", rule), "s: must be a string of 2..4 printable characters");
  EXPECT_EQ(string_error("\xc3\xa9t\xc3\xa9", StringRule{0, 64}),
            "s: must be a string of at most 64 printable characters");
  EXPECT_EQ(string_error("abc", StringRule{0, 2, false}), "s: must be a string of at most 2 bytes");
}

TEST(JsonReaderTest, StringWithoutPrintableCheckTakesAnyBytes) {
  const json doc = {{"path", "/tmp/a\tb"}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  std::string path;
  EXPECT_TRUE(o.get_string("path", path, StringRule{0, 64, false}));
  EXPECT_EQ(path, "/tmp/a\tb");
}

TEST(JsonReaderTest, NestedObjectMustBeAnObject) {
  const json doc = {{"o", 3}};
  JsonReader reader;
  JsonObject top = reader.object(doc);
  JsonObject o = top.object("o");
  EXPECT_FALSE(o.ok());
  EXPECT_EQ(message(reader), "o: must be an object");
  // Reading on from a failed object fails quietly: the first error stays.
  std::uint64_t n = 0;
  EXPECT_FALSE(o.get_unsigned("x", n));
  EXPECT_FALSE(o.finish());
  EXPECT_EQ(message(reader), "o: must be an object");
}

std::string array_error(const json& value, std::size_t min_size, std::size_t max_size) {
  const json doc = {{"a", value}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  JsonArray a = o.array("a", min_size, max_size);
  EXPECT_FALSE(a.ok()) << value.dump();
  EXPECT_EQ(a.size(), 0u);  // a loop over a failed array does nothing
  return message(reader);
}

TEST(JsonReaderTest, ArraySizeBoundsAreNamed) {
  EXPECT_EQ(array_error({1, 2, 3}, 0, 2), "a: must be an array of at most 2 elements");
  EXPECT_EQ(array_error({1}, 2, 2), "a: must be an array of 2 elements");
  EXPECT_EQ(array_error(json::array(), 1, 3), "a: must be an array of 1..3 elements");
  EXPECT_EQ(array_error(json::object(), 0, 3), "a: must be an array of at most 3 elements");
  const json doc = {{"a", {1, 2}}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  JsonArray a = o.array("a", 2);
  EXPECT_TRUE(a.ok());
  EXPECT_EQ(a.size(), 2u);
}

TEST(JsonReaderTest, ArrayElementsAreReadAndNamedByIndex) {
  const json doc = {{"pairs", {{1, 2}, {3, "x"}}}, {"names", {"ok", ""}}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  JsonArray names = o.array("names", 4);
  std::string first;
  EXPECT_TRUE(names.get_string(0, first, StringRule{1, 8}));
  EXPECT_EQ(first, "ok");
  JsonArray pairs = o.array("pairs", 4);
  JsonArray p0 = pairs.array(0, 2, 2);
  std::uint32_t a = 0, b = 0;
  EXPECT_TRUE(p0.get_unsigned(0, a));
  EXPECT_TRUE(p0.get_unsigned(1, b));
  EXPECT_EQ(a + b, 3u);
  JsonArray p1 = pairs.array(1, 2, 2);
  EXPECT_FALSE(p1.get_unsigned(1, b));
  EXPECT_EQ(message(reader), "pairs[1][1]: must be an integer in 0..4294967295");
}

TEST(JsonReaderTest, ArrayIndexPastTheEndIsMissing) {
  const json doc = json::array({1});
  JsonReader reader;
  JsonArray a = reader.array(doc, 4);
  std::uint64_t n = 0;
  EXPECT_FALSE(a.get_unsigned(3, n));
  EXPECT_EQ(message(reader), "[3]: missing");
}

TEST(JsonReaderTest, ArrayElementObjectAndStringErrorsNameTheElement) {
  const json doc = {{"a", {json::object(), 5}}, {"s", {"ok", "a\x01"}}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  JsonArray a = o.array("a", 4);
  EXPECT_TRUE(a.object(0).ok());
  EXPECT_FALSE(a.object(1).ok());
  EXPECT_EQ(message(reader), "a[1]: must be an object");

  JsonReader r2;
  JsonObject o2 = r2.object(doc);
  JsonArray s = o2.array("s", 4);
  std::string text;
  EXPECT_FALSE(s.get_string(1, text, StringRule{0, 8}));
  EXPECT_EQ(message(r2), "s[1]: must be a string of at most 8 printable characters");
}

TEST(JsonReaderTest, OptionalFieldsKeepTheirDefaultWhenAbsent) {
  const json doc = {{"present", 5}, {"flag", true}, {"name", "x"}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  std::uint32_t present = 1, absent = 42;
  bool flag = false, absent_flag = true;
  std::string name = "default", absent_name = "default";
  EXPECT_TRUE(o.optional_unsigned("present", present));
  EXPECT_TRUE(o.optional_unsigned("absent", absent));
  EXPECT_TRUE(o.optional_bool("flag", flag));
  EXPECT_TRUE(o.optional_bool("absent_flag", absent_flag));
  EXPECT_TRUE(o.optional_string("name", name, StringRule{0, 8}));
  EXPECT_TRUE(o.optional_string("absent_name", absent_name, StringRule{0, 8}));
  EXPECT_TRUE(o.finish());
  EXPECT_EQ(present, 5u);
  EXPECT_EQ(absent, 42u);
  EXPECT_TRUE(flag);
  EXPECT_TRUE(absent_flag);
  EXPECT_EQ(name, "x");
  EXPECT_EQ(absent_name, "default");
}

TEST(JsonReaderTest, OptionalFieldsThatArePresentMustBeValid) {
  const json doc = {{"n", 0}, {"b", "no"}, {"s", 1}, {"o", 1}};
  {
    JsonReader reader;
    JsonObject o = reader.object(doc);
    std::uint32_t n = 7;
    EXPECT_FALSE(o.optional_unsigned("n", n, 1, 9));
    EXPECT_EQ(n, 7u);
    EXPECT_EQ(message(reader), "n: must be an integer in 1..9");
  }
  {
    JsonReader reader;
    JsonObject o = reader.object(doc);
    bool b = false;
    EXPECT_FALSE(o.optional_bool("b", b));
    EXPECT_EQ(message(reader), "b: must be a boolean");
  }
  {
    JsonReader reader;
    JsonObject o = reader.object(doc);
    std::string s;
    EXPECT_FALSE(o.optional_string("s", s, StringRule{0, 8}));
    EXPECT_EQ(message(reader), "s: must be a string");
  }
  {
    JsonReader reader;
    JsonObject o = reader.object(doc);
    EXPECT_FALSE(o.optional_object("o"));
    EXPECT_EQ(message(reader), "o: must be an object");
  }
}

TEST(JsonReaderTest, OptionalObjectIsReadWhenPresent) {
  const json doc = {{"o", {{"x", 1}}}};
  JsonReader reader;
  JsonObject top = reader.object(doc);
  EXPECT_FALSE(top.optional_object("absent"));
  auto o = top.optional_object("o");
  ASSERT_TRUE(o);
  std::uint64_t x = 0;
  EXPECT_TRUE(o->get_unsigned("x", x));
  EXPECT_EQ(x, 1u);
  EXPECT_TRUE(o->finish());
  EXPECT_TRUE(top.finish());
}

TEST(JsonReaderTest, IsNullReadsANullAndNothingElse) {
  const json doc = {{"gone", nullptr}, {"here", 1}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  EXPECT_TRUE(o.is_null("gone"));
  EXPECT_FALSE(o.is_null("here"));
  EXPECT_FALSE(o.is_null("absent"));
  EXPECT_FALSE(o.finish());  // "here" was looked at, not read
  EXPECT_EQ(message(reader), "here: unknown key");
}

TEST(JsonReaderTest, HasSizeAndKeysDescribeTheObject) {
  const json doc = {{"b", 1}, {"a", nullptr}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  EXPECT_TRUE(o.has("a"));  // null counts as present
  EXPECT_FALSE(o.has("c"));
  EXPECT_EQ(o.size(), 2u);
  const auto keys = o.keys();
  ASSERT_EQ(keys.size(), 2u);
  EXPECT_EQ(keys[0], "a");
  EXPECT_EQ(keys[1], "b");
}

TEST(JsonReaderTest, FirstErrorWinsAndLaterGettersFailWithoutLooking) {
  const json doc = {{"a", "x"}, {"b", 2}};
  JsonReader reader;
  JsonObject o = reader.object(doc);
  std::uint64_t a = 0, b = 0;
  EXPECT_FALSE(o.get_unsigned("a", a));
  EXPECT_FALSE(o.get_unsigned("b", b));  // valid, but the read has failed already
  EXPECT_EQ(b, 0u);
  EXPECT_FALSE(o.get_unsigned("missing", b));
  EXPECT_FALSE(o.fail_at("b", "another reason"));
  EXPECT_FALSE(reader.fail("x", "and another"));
  EXPECT_EQ(message(reader), "a: must be an unsigned integer");
}

TEST(JsonReaderTest, CallersReportTheirOwnReasonsAtAPath) {
  const json doc = {{"gpus", {{{"gpu", "A"}}}}};
  JsonReader reader;
  JsonObject top = reader.object(doc);
  JsonArray gpus = top.array("gpus", 4);
  JsonObject g = gpus.object(0);
  EXPECT_FALSE(g.fail_at("gpu", "appears twice"));
  EXPECT_EQ(message(reader), "gpus[0].gpu: appears twice");
  JsonReader r2;
  JsonObject top2 = r2.object(doc);
  JsonArray gpus2 = top2.array("gpus", 4);
  EXPECT_FALSE(gpus2.fail_at(0, "duplicate"));
  EXPECT_EQ(message(r2), "gpus[0]: duplicate");
  JsonReader r3;
  JsonObject top3 = r3.object(doc);
  JsonArray gpus3 = top3.array("gpus", 4);
  EXPECT_FALSE(gpus3.object(0).fail("is not a GPU"));
  EXPECT_EQ(message(r3), "gpus[0]: is not a GPU");
}

TEST(JsonReaderTest, OddKeysAreQuotedInPathsAndCannotBreakALogLine) {
  const json doc = {{"m", {{"a b", "x"}, {"line\nbreak", "x"}, {std::string(100, 'k'), "x"}}}};
  const auto error_for = [&doc](const std::string& key) {
    JsonReader reader;
    JsonObject m = reader.object(doc).object("m");
    std::uint64_t n = 0;
    m.get_unsigned(key, n);
    return message(reader);
  };
  EXPECT_EQ(error_for("a b"), "m[\"a b\"]: must be an unsigned integer");
  EXPECT_EQ(error_for("line\nbreak"), "m[\"line?break\"]: must be an unsigned integer");
  EXPECT_EQ(error_for(std::string(100, 'k')),
            "m[\"" + std::string(64, 'k') + "...\"]: must be an unsigned integer");
}

}  // namespace
}  // namespace steptrace::daemon
