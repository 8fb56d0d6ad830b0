// The bounded JSON parse (core/bounded_json.hpp) and printable() (core/printable.hpp): limits are
// checked before the JSON library sees the text, every refusal names the position, and no input
// byte a terminal acts on survives printable().
#include <gtest/gtest.h>

#include <string>

#include "core/bounded_json.hpp"
#include "core/printable.hpp"
#include "strata/error.hpp"

namespace strata {
namespace {

// The ConfigError parse_bounded_json throws for `text`, or an empty one (line -1) if it parses.
ConfigError refusal(const std::string& text, const JsonLimits& limits = {}) {
  try {
    parse_bounded_json(text, "t.json", limits);
  } catch (const ConfigError& e) {
    return e;
  }
  return ConfigError("", -1, -1, "", "parsed");
}

TEST(BoundedJson, ParsesWhatIsWithinTheLimits) {
  const auto j = parse_bounded_json(
      R"({"a": [1, 2.5e3, -0.0, true, null, "x\u001b"], "b": {"c": {}}})", "t.json");
  EXPECT_EQ(j["a"][1].get<double>(), 2500.0);
  EXPECT_EQ(j["a"][5].get<std::string>(), "x\x1b");
  EXPECT_TRUE(j["b"]["c"].is_object());
}

TEST(BoundedJson, DepthIsCheckedBeforeParsing) {
  const int d = 100000;
  const ConfigError e = refusal("{\"format\": " + std::string(d, '[') + std::string(d, ']') + "}");
  EXPECT_EQ(e.line(), 1);
  EXPECT_EQ(e.column(), 11 + 64);  // the 65th opening bracket
  EXPECT_NE(e.detail().find("nested deeper than 64 levels"), std::string::npos) << e.what();
  // Brackets inside strings do not count; 64 levels are fine.
  EXPECT_EQ(refusal("[\"" + std::string(1000, '[') + "\"]").line(), -1);
  EXPECT_EQ(refusal(std::string(64, '[') + std::string(64, ']')).line(), -1);
  EXPECT_EQ(refusal(std::string(65, '[') + std::string(65, ']')).column(), 65);
}

TEST(BoundedJson, SizeValuesAndNumbers) {
  JsonLimits small;
  small.max_bytes = 10;
  EXPECT_NE(refusal("[1, 2, 3, 4, 5]", small).detail().find("15 bytes; at most 10"),
            std::string::npos);
  small = {};
  small.max_values = 4;
  const ConfigError v = refusal("[1, 2, 3, 4]", small);  // the array and four numbers
  EXPECT_EQ(v.column(), 11);
  EXPECT_NE(v.detail().find("more than 4 values"), std::string::npos) << v.what();
  const ConfigError big = refusal("{\n  \"lr\": 1e400}");
  EXPECT_EQ(big.line(), 2);
  EXPECT_EQ(big.column(), 9);
  EXPECT_NE(big.detail().find("the number 1e400 is out of the range of a double"),
            std::string::npos)
      << big.what();
  EXPECT_NE(refusal("[-1e400]").detail().find("-1e400"), std::string::npos);
  EXPECT_NE(refusal("[" + std::string(65, '1') + "]").detail().find("a number of 65 characters"),
            std::string::npos);
  EXPECT_EQ(refusal("[1e308, 123456789012345678901234567890]").line(), -1);
}

TEST(BoundedJson, SyntaxErrorsAndDuplicateKeysNameWhere) {
  const ConfigError s = refusal("{\"a\": tru}");
  EXPECT_EQ(s.line(), 1);
  EXPECT_NE(std::string(s.what()).find("t.json:1:"), std::string::npos) << s.what();
  EXPECT_NE(s.detail().find("malformed JSON"), std::string::npos);
  const ConfigError d = refusal(R"({"a": {"b\u001b": 1, "b\u001b": 2}})");
  EXPECT_EQ(d.key_path(), "a.b\\x1b");
  EXPECT_NE(d.detail().find("duplicate key"), std::string::npos);
  JsonLimits any;
  any.reject_duplicate_keys = false;
  EXPECT_EQ(refusal(R"({"a": 1, "a": 2})", any).line(), -1);
}

TEST(Printable, EscapesWhatATerminalActsOn) {
  EXPECT_EQ(printable("w1.weight"), "w1.weight");
  EXPECT_EQ(printable("a\x1b[31mb\r\n\t\x7f"), "a\\x1b[31mb\\x0d\\x0a\\x09\\x7f");
  EXPECT_EQ(printable("back\\slash"), "back\\\\slash");
  EXPECT_EQ(printable("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"),
            "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  EXPECT_EQ(printable("\xc2\x9b"
                      "31m"),
            "\\xc2\\x9b31m");  // C1 CSI
  EXPECT_EQ(printable("\xff\xc3\x28\xed\xa0\x80"),
            "\\xff\\xc3(\\xed\\xa0\\x80");         // invalid, surrogate
  EXPECT_EQ(printable("\xe2\x82"), "\\xe2\\x82");  // truncated sequence
  EXPECT_EQ(printable(std::string(100, 'x'), 10), "xxxxxxxxxx... (90 more bytes)");
  EXPECT_EQ(printable_lines("line 1\n\tline \x1b"
                            "2 a\\b"),
            "line 1\n\tline \\x1b2 a\\b");
}

}  // namespace
}  // namespace strata
