// The one classification of what a client-chosen string (a process's comm, which may hold
// any bytes; step names, job ids, tasks, GPU UUIDs, the hello's names; a word of a text
// command) may never carry raw into an output, shared by the daemon and the CLI (which
// may include proto/ only). Each output kind treats what this calls unsafe in one
// sanitiser of its own, all built on is_unsafe() and decode_utf8() below:
//
//   terminal text   proto::printable() (printable.h): printable ASCII only, every other
//                   byte '?' (stricter than is_unsafe(): a table counts bytes as columns)
//   JSON replies    escape_unsafe_in_json() below, over the whole dumped document: an
//                   unsafe code point becomes its \uXXXX escape (the same string to a
//                   JSON reader, never raw bytes), invalid UTF-8 U+FFFD
//   Chrome trace    daemon/report/trace_export_json.cpp, append_json_string(): likewise
//                   \uXXXX, invalid bytes '?'
//   Prometheus      daemon/report/report_format.cpp: unsafe code points and invalid
//                   UTF-8 become U+FFFD (label values must be valid UTF-8, and a scrape
//                   read on a terminal must not be reordered or hide characters)
//
// Why invisible characters too: a bidi control (U+202E RIGHT-TO-LEFT OVERRIDE) makes a
// terminal or a browser show the text after it reversed, so a comm can make a line of
// `metrics` say what it does not; zero-width and other invisible format characters make
// two different names look the same (a forged job or comm label next to the real one).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace steptrace::proto {

// One code point read from UTF-8: its value and how many bytes it took, or length 0
// when the text does not start with a valid sequence (RFC 3629: a stray continuation
// byte, an overlong form, a surrogate, past U+10FFFF, or a sequence cut short).
struct Utf8Char {
  char32_t code_point = 0;
  std::size_t length = 0;
};

// The code point at the start of `text` (not empty).
constexpr Utf8Char decode_utf8(std::string_view text) noexcept {
  const auto b = [&text](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char c = b(0);
  if (c < 0x80) return {c, 1};
  std::size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // bounds of the second byte
  char32_t value = 0;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
    value = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    value = c & 0x0F;
    if (c == 0xE0) lo = 0xA0;  // no overlong form
    if (c == 0xED) hi = 0x9F;  // no surrogate
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    value = c & 0x07;
    if (c == 0xF0) lo = 0x90;  // no overlong form
    if (c == 0xF4) hi = 0x8F;  // nothing past U+10FFFF
  } else {
    return {};
  }
  if (text.size() < n || b(1) < lo || b(1) > hi) return {};
  for (std::size_t i = 1; i < n; ++i) {
    if (i > 1 && (b(i) < 0x80 || b(i) > 0xBF)) return {};
    value = (value << 6) | (b(i) & 0x3F);
  }
  return {value, n};
}

// C0 controls (U+0000..U+001F), DEL (U+007F) and the C1 controls (U+0080..U+009F):
// General_Category Cc. ESC and CSI start terminal escape sequences; CR and LF forge lines.
constexpr bool is_control(char32_t cp) noexcept { return cp < 0x20 || (cp >= 0x7F && cp <= 0x9F); }

// Invisible format characters that change how the text around them is shown or that
// show as nothing. The exact set, from the Unicode Character Database:
//   Bidi_Control (PropList.txt), all of it:
//     U+061C ARABIC LETTER MARK, U+200E..U+200F (LRM, RLM),
//     U+202A..U+202E (LRE, RLE, PDF, LRO, RLO), U+2066..U+2069 (LRI, RLI, FSI, PDI);
//   and invisible characters of General_Category Cf (format), all Default_Ignorable:
//     U+200B..U+200D (zero width space, non-joiner, joiner),
//     U+2060..U+2064 (word joiner, invisible function application, times, separator,
//                     plus),
//     U+206A..U+206F (deprecated format characters: symmetric swapping, shaping, digit
//                     shapes),
//     U+FEFF (zero width no-break space, the byte order mark),
//     U+FFF9..U+FFFB (interlinear annotation anchor, separator, terminator).
// Left out on purpose: U+2065 (unassigned, and never shown as anything), U+00AD (soft
// hyphen: terminals show it as a hyphen), the variation selectors U+FE00..U+FE0F and the
// tags U+E0020..U+E007F (parts of emoji), spaces such as U+200A (visible as a gap).
// U+200D joins emoji too (a family emoji): JSON still gives it back (as \u200d), a
// Prometheus label shows U+FFFD in its place.
constexpr bool is_invisible_format(char32_t cp) noexcept {
  return cp == 0x061C || (cp >= 0x200B && cp <= 0x200F) || (cp >= 0x202A && cp <= 0x202E) ||
         (cp >= 0x2060 && cp <= 0x2064) || (cp >= 0x2066 && cp <= 0x206F) || cp == 0xFEFF ||
         (cp >= 0xFFF9 && cp <= 0xFFFB);
}

// A code point no output may carry raw: a control character or an invisible format
// character. (Invalid UTF-8 is unsafe as well: decode_utf8() gives it length 0.)
constexpr bool is_unsafe(char32_t cp) noexcept { return is_control(cp) || is_invisible_format(cp); }

// True when every byte of `text` is valid UTF-8 and no code point is unsafe.
constexpr bool is_safe_text(std::string_view text) noexcept {
  while (!text.empty()) {
    const Utf8Char ch = decode_utf8(text);
    if (ch.length == 0 || is_unsafe(ch.code_point)) return false;
    text.remove_prefix(ch.length);
  }
  return true;
}

// Appends the JSON escape of a code point in the Basic Multilingual Plane (every unsafe
// one is): "\u202e" (lower-case hex, as nlohmann::json writes control characters).
inline void append_json_escape(std::string& out, char32_t cp) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += "\\u";
  for (int shift = 12; shift >= 0; shift -= 4) out += kHex[(cp >> shift) & 0xF];
}

// The JSON sanitiser for a whole document as a JSON library wrote it (UTF-8 kept, control
// characters in strings already escaped): every raw DEL, C1 or invisible format character
// becomes its \uXXXX escape and each byte of invalid UTF-8 U+FFFD. Such characters can
// only stand inside a string (outside strings a JSON text is ASCII punctuation, literals
// and numbers), where the escape reads as the same character: the data is kept for a JSON
// reader, but never reaches a terminal or a log viewer raw. Other text (日本語, emoji)
// stays as it is. A document with no byte >= 0x7F comes back unchanged.
inline std::string escape_unsafe_in_json(std::string json_text) {
  std::size_t i = 0;
  while (i < json_text.size() && static_cast<unsigned char>(json_text[i]) < 0x7F) ++i;
  if (i == json_text.size()) return json_text;
  std::string out(json_text, 0, i);
  out.reserve(json_text.size() + 16);
  const std::string_view text(json_text);
  while (i < text.size()) {
    const Utf8Char ch = decode_utf8(text.substr(i));
    if (ch.length == 0) {
      out += "\xEF\xBF\xBD";  // U+FFFD
      ++i;
    } else if (ch.code_point >= 0x7F && is_unsafe(ch.code_point)) {
      append_json_escape(out, ch.code_point);
      i += ch.length;
    } else {
      out.append(text, i, ch.length);
      i += ch.length;
    }
  }
  return out;
}

}  // namespace steptrace::proto
