// proto/text_safety.h: which code points are unsafe (every one of the listed set, and
// the neighbours and ordinary text that are not), UTF-8 decoding, and the JSON
// sanitiser over a whole document. Each output's own sanitiser is tested beside it
// (tests/daemon/report), the whole path in tests/hostile/bidi_test.cpp.
#include "proto/text_safety.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "proto/printable.h"

namespace steptrace::proto {
namespace {

// `cp` as UTF-8.
std::string utf8(char32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

std::string hex(char32_t cp) { return testing::PrintToString(static_cast<unsigned>(cp)); }

// The invisible format characters, written out once more from the Unicode data (not from
// the code under test): Bidi_Control, then the invisible Cf characters.
const std::vector<char32_t>& invisible_format() {
  static const std::vector<char32_t> kAll = {
      0x061C, 0x200E, 0x200F, 0x202A, 0x202B, 0x202C, 0x202D, 0x202E,
      0x2066, 0x2067, 0x2068, 0x2069,                                  // Bidi_Control
      0x200B, 0x200C, 0x200D, 0x2060, 0x2061, 0x2062, 0x2063, 0x2064,  // zero width, invisible
      0x206A, 0x206B, 0x206C, 0x206D, 0x206E, 0x206F,                  // deprecated format
      0xFEFF, 0xFFF9, 0xFFFA, 0xFFFB};                                 // BOM, annotation
  return kAll;
}

TEST(TextSafety, EveryListedInvisibleFormatCharacterIsUnsafe) {
  for (const char32_t cp : invisible_format()) {
    EXPECT_TRUE(is_invisible_format(cp)) << hex(cp);
    EXPECT_TRUE(is_unsafe(cp)) << hex(cp);
    EXPECT_FALSE(is_control(cp));
    EXPECT_FALSE(is_safe_text("job" + utf8(cp) + "1")) << hex(cp);
  }
  // And nothing else in the planes they sit in: a scan of U+0000..U+FFFF finds exactly
  // the listed ones plus the controls.
  std::size_t found = 0;
  for (char32_t cp = 0; cp <= 0xFFFF; ++cp) {
    if (is_invisible_format(cp)) ++found;
    EXPECT_EQ(is_control(cp), cp < 0x20 || (cp >= 0x7F && cp <= 0x9F)) << hex(cp);
  }
  EXPECT_EQ(found, invisible_format().size());
}

TEST(TextSafety, ControlCharactersAreC0DelAndC1) {
  for (char32_t cp = 0; cp < 0x20; ++cp) EXPECT_TRUE(is_unsafe(cp)) << hex(cp);
  EXPECT_TRUE(is_unsafe(0x7F));
  for (char32_t cp = 0x80; cp <= 0x9F; ++cp) EXPECT_TRUE(is_unsafe(cp)) << hex(cp);
  for (char32_t cp = 0x20; cp < 0x7F; ++cp) EXPECT_FALSE(is_unsafe(cp)) << hex(cp);
  EXPECT_FALSE(is_unsafe(0xA0));  // no-break space
}

TEST(TextSafety, NeighboursOfTheListedRangesAreFine) {
  for (const char32_t cp :
       {0x061B, 0x061D,                                      // Arabic punctuation around ALM
        0x200A,                                              // hair space (a visible gap)
        0x2010,                                              // hyphen
        0x2029, 0x202F,                                      // paragraph separator, narrow nbsp
        0x205F,                                              // medium mathematical space
        0x2065,                                              // unassigned: shown as nothing
        0x2070,                                              // superscript zero
        0x00AD,                                              // soft hyphen: a terminal shows it
        0xFE0F,                                              // variation selector (emoji)
        0xFEFE, 0xFF00, 0xFFF8, 0xFFFC, 0xFFFD, 0xE0061}) {  // tag latin small a (flag emoji)
    EXPECT_FALSE(is_unsafe(cp)) << hex(cp);
  }
}

TEST(TextSafety, MultilingualTextAndEmojiAreSafe) {
  for (const std::string text : {"日本語", "Ünïcödé", "عربى", "עברית", "🔥 trainer",
                                 "🏳️‍🌈" /* holds a ZWJ */, "µs"}) {
    EXPECT_EQ(is_safe_text(text), text.find("\u200d") == std::string::npos) << text;
  }
}

TEST(TextSafety, DecodesUtf8AndRejectsWhatRfc3629Forbids) {
  EXPECT_EQ(decode_utf8("a").code_point, U'a');
  EXPECT_EQ(decode_utf8("\xE2\x80\xAE").code_point, 0x202Eu);
  EXPECT_EQ(decode_utf8("\xE2\x80\xAE").length, 3u);
  EXPECT_EQ(decode_utf8("\xF0\x9F\x94\xA5").code_point, 0x1F525u);
  EXPECT_EQ(decode_utf8("\xF0\x9F\x94\xA5").length, 4u);
  EXPECT_EQ(decode_utf8("\xC3\xA9").code_point, 0xE9u);
  for (const char32_t cp : {0x80u, 0x7FFu, 0x800u, 0xFFFFu, 0x10000u, 0x10FFFFu}) {
    const Utf8Char ch = decode_utf8(utf8(cp));
    EXPECT_EQ(ch.code_point, cp);
    EXPECT_EQ(ch.length, utf8(cp).size());
  }
  for (const std::string bad :
       {"\x80", "\xBF", "\xC0\xAF", "\xC1\xBF", "\xE0\x80\xAF", "\xED\xA0\x80" /* surrogate */,
        "\xF4\x90\x80\x80", "\xF5\x80", "\xFF", "\xE2\x80" /* cut */, "\xE2\x28\xAE"}) {
    EXPECT_EQ(decode_utf8(bad).length, 0u) << testing::PrintToString(bad);
  }
  EXPECT_FALSE(is_safe_text("ok\xFF"));
  EXPECT_TRUE(is_safe_text(""));
}

TEST(TextSafety, JsonSanitiserEscapesUnsafeAndKeepsTheString) {
  const std::string comm = "ev\u202eil \u200b日本語 \x7f\xC2\x85 🔥";
  const nlohmann::json doc = {{"comm", comm}, {"n", 1}};
  const std::string text = escape_unsafe_in_json(doc.dump());
  EXPECT_EQ(text, "{\"comm\":\"ev\\u202eil \\u200b日本語 \\u007f\\u0085 🔥\",\"n\":1}");
  EXPECT_EQ(text.find("\xE2\x80\xAE"), std::string::npos);
  EXPECT_EQ(nlohmann::json::parse(text)["comm"], comm);  // the same string to a reader
  // Every listed code point comes out as its escape, and reads back as itself.
  for (const char32_t cp : invisible_format()) {
    const std::string raw = nlohmann::json(utf8(cp)).dump();
    const std::string safe = escape_unsafe_in_json(raw);
    EXPECT_EQ(safe.find(utf8(cp)), std::string::npos) << safe;
    EXPECT_EQ(nlohmann::json::parse(safe).get<std::string>(), utf8(cp));
  }
  // Plain ASCII is returned as it is; invalid bytes become U+FFFD.
  EXPECT_EQ(escape_unsafe_in_json(R"({"a":"b"})"), R"({"a":"b"})");
  EXPECT_EQ(escape_unsafe_in_json("\"a\xFF\""), "\"a\xEF\xBF\xBD\"");
}

TEST(TextSafety, TerminalSanitiserLeavesNoByteOfAnUnsafeCodePoint) {
  for (const char32_t cp : invisible_format()) {
    const std::string out = printable("a" + utf8(cp) + "b");
    EXPECT_EQ(out, "a" + std::string(utf8(cp).size(), '?') + "b");
  }
  EXPECT_EQ(printable("\x1b[2J\x7f"), "?[2J?");
}

}  // namespace
}  // namespace steptrace::proto
