// kiln's Jinja interpreter (src/pipelines/jinja.h), feature by feature, with the output jinja2 gives
// in Hugging Face's environment (trim_blocks, lstrip_blocks, loop controls, immutable sandbox) written
// out by hand; then its errors: where they point, and the limits that keep outside templates from
// crashing or hanging the server.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "kiln/errors.h"
#include "pipelines/jinja.h"
#include "test_util.h"

using namespace kiln;
using kiln::pipelines::jinja::Limits;
using kiln::pipelines::jinja::Template;
using kiln::testing::expect_error;

namespace {

std::string render(std::string_view source, std::string_view context = "{}", const Limits& limits = {}) {
  return Template::parse(source, "t.jinja", limits).render(nlohmann::ordered_json::parse(context));
}

struct Case {
  const char* source;
  const char* context;
  const char* expected;
};

void check(const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    SCOPED_TRACE(c.source);
    try {
      EXPECT_EQ(render(c.source, c.context), c.expected);
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
  }
}

}  // namespace

TEST(Jinja, WhitespaceControlAndHfBlockTrimming) {
  check({
      {R"({% if true %}
yes
{% endif %}
done)",
       R"({})", R"(yes
done)"},
      {R"(  {% if true %}
    indented
  {% endif %}
end)",
       R"({})", R"(    indented
end)"},
      {R"(a   {{- 'b' -}}   c)", R"({})", R"(abc)"},
      {R"(a
  {%- if true %} b {% endif -%}
  c)",
       R"({})", R"(a b c)"},
      {R"(x {%+ if true %}y{% endif %})", R"({})", R"(x y)"},
      {R"(  {{ 'var tags keep their indentation' }}
{# a comment #}
after)",
       R"({})", R"(  var tags keep their indentation
after)"},
      {R"(line
)",
       R"({})", R"(line)"},
      {R"({% raw %}{{ not evaluated }}{% endraw %})", R"({})", R"({{ not evaluated }})"},
      {R"(a {{ "}}" }} {{ {'k': {'n': 1}}['k']['n'] }})", R"({})", R"(a }} 1)"},
      {R"({% for i in [1, 2] %}
  {{ i }}
{% endfor %})",
       R"({})", R"(  1
  2
)"},
      {"a\r\nb\rc", R"({})", "a\nb\nc"},
  });
}

TEST(Jinja, LoopsAndLoopVariables) {
  check({
      {R"({% for x in xs %}{{ loop.index }}/{{ loop.length }}:{{ x }}{{ ',' if not loop.last }}{% endfor %})",
       R"({"xs": ["a", "b", "c"]})", R"(1/3:a,2/3:b,3/3:c)"},
      {R"({% for x in 'abc' %}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }} {% endfor %})",
       R"({})", R"(032True 121False 210False )"},
      {R"({% for x in [1, 2, 3] %}{{ loop.previtem }}<{{ x }}>{{ loop.nextitem }};{% endfor %})", R"({})",
       R"(<1>2;1<2>3;2<3>;)"},
      {R"({% for x in range(5) %}{{ loop.cycle('a', 'b') }}{% endfor %})", R"({})", R"(ababa)"},
      {R"({% for k, v in d.items() %}{{ k }}={{ v }} {% endfor %})", R"({"d": {"z": 1, "a": [2]}})",
       R"(z=1 a=[2] )"},
      {R"({% for k in d %}{{ k }}{% endfor %})", R"({"d": {"z": 1, "a": 2}})", R"(za)"},
      {R"({% for x in xs if x is odd %}{{ loop.index }}:{{ x }} {% endfor %})", R"({"xs": [1, 2, 3, 4, 5]})",
       R"(1:1 2:3 3:5 )"},
      {R"({% for x in [] %}never{% else %}empty{% endfor %})", R"({})", R"(empty)"},
      {R"({% for x in missing %}never{% else %}undefined iterates as empty{% endfor %})", R"({})",
       R"(undefined iterates as empty)"},
      {R"({% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}{% endfor %})",
       R"({})", R"(0134)"},
      {R"({% for a, b in [(1, 2), [3, 4]] %}{{ a + b }} {% endfor %})", R"({})", R"(3 7 )"},
      {R"({% for row in [[1, 2], [3]] %}{% for x in row %}{{ loop.index }}{% endfor %}|{{ loop.index }} {% endfor %})",
       R"({})", R"(12|1 1|2 )"},
      {R"({{ range(3)|list }} {{ range(1, 10, 4)|list }} {{ range(5, 0, -2)|list }})", R"({})",
       R"([0, 1, 2] [1, 5, 9] [5, 3, 1])"},
  });
}

// Dicts are searched in place while small and through an index once they grow: keys found, values
// replaced in place and the insertion order kept on both sides of the switch.
TEST(Jinja, DictsOfAnySizeFindTheirKeysInOrder) {
  for (int n : {1, 12, 15, 16, 17, 40}) {
    nlohmann::ordered_json d = nlohmann::ordered_json::object();
    std::string keys, values;
    for (int i = n - 1; i >= 0; --i) {  // descending, so order is not sorted order
      d["k" + std::to_string(i)] = i * i;
      keys += "k" + std::to_string(i) + ",";
      values += std::to_string(i * i) + ",";
    }
    const nlohmann::ordered_json context = {{"d", d}};
    SCOPED_TRACE(n);
    EXPECT_EQ(render("{% for k in d %}{{ k }},{% endfor %}", context.dump()), keys);
    EXPECT_EQ(render("{% for k in d %}{{ d[k] }},{% endfor %}", context.dump()), values);
    EXPECT_EQ(render("{{ d.k0 }} {{ d['k' ~ (d|length - 1)] }} {{ d.missing is defined }}", context.dump()),
              "0 " + std::to_string((n - 1) * (n - 1)) + " False");
    // A namespace is a dict too; `set ns.x` replaces in place whatever its size.
    EXPECT_EQ(render("{% set ns = namespace(d) %}{% set ns.k0 = 'z' %}{% set ns.extra = 1 %}{{ ns.k0 }}{{ ns.extra }}"
                     "{{ ns['k' ~ (d|length - 1)] }}",
                     context.dump()),
              "z1" + (n == 1 ? std::string("z") : std::to_string((n - 1) * (n - 1))));
  }
}

TEST(Jinja, ScopingSetNamespaceAndBlocks) {
  check({
      // A set inside a loop stays in the loop, and each iteration starts afresh.
      {R"({% set x = 'out' %}{% for i in [1, 2] %}[{{ x }}]{% set x = i %}{% endfor %}{{ x }})", R"({})",
       R"([out][out]out)"},
      {R"({% set ns = namespace(n=0, found=false) %}{% for i in [1, 2, 3] %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }} {{ ns.found }})",
       R"({})", R"(6 False)"},
      {R"({% set a, b = 1, 2 %}{{ a }}{{ b }})", R"({})", R"(12)"},
      {R"({% set block %}  inner {{ 1 + 1 }} {% endset %}[{{ block }}])", R"({})", R"([  inner 2 ])"},
      {R"({% set shout | upper %}hello{% endset %}{{ shout }})", R"({})", R"(HELLO)"},
      {R"({% filter upper %}quiet {{ 'words' }}{% endfilter %})", R"({})", R"(QUIET WORDS)"},
      {R"({% with a = 1, b = 2 %}{{ a + b }}{% endwith %}{{ a is defined }})", R"({})", R"(3False)"},
      {R"({% if x %}a{% elif y %}b{% else %}c{% endif %})", R"({"y": 1})", R"(b)"},
      {R"({% generation %}kept as is{% endgeneration %})", R"({})", R"(kept as is)"},
  });
}

TEST(Jinja, Macros) {
  check({
      {R"({% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Ann') }} {{ greet('Bo', punct='?') }})",
       R"({})", R"(Hi Ann! Hi Bo?)"},
      {R"({% macro f(a) %}{{ a }}|{{ varargs }}|{{ kwargs }}{% endmacro %}{{ f(1, 2, 3, k=4) }})", R"({})",
       R"(1|(2, 3)|{'k': 4})"},
      {R"({% macro fact(n) %}{{ 1 if n <= 1 else n * fact(n - 1)|int }}{% endmacro %}{{ fact(5) }})", R"({})",
       R"(120)"},
      {R"({% macro wrap() %}<{{ caller() }}>{% endmacro %}{% call wrap() %}body{% endcall %})", R"({})",
       R"(<body>)"},
      {R"({% macro row(x) %}{{ x }}{{ caller(x * 2) }}{% endmacro %}{% call(y) row(3) %}={{ y }}{% endcall %})",
       R"({})", R"(3=6)"},
      {R"({% macro m(a) %}[{{ a }}]{% endmacro %}{{ m() }})", R"({})", R"([])"},
  });
}

TEST(Jinja, ExpressionsAndPythonArithmetic) {
  check({
      {R"({{ 7 / 2 }} {{ 8 / 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 2 ** 10 }} {{ 2 ** -1 }})",
       R"({})", R"(3.5 4.0 3 -4 2 -2 1024 0.5)"},
      {R"({{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 1.5 + 1 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }} {{ true + 1 }})",
       R"({})", R"(7 9 2.5 3.0 0.5 2)"},
      {R"({{ 'ab' ~ 1 ~ none ~ true }} {{ 'ab' + 'cd' }} {{ 'ab' * 3 }} {{ [1] + [2] }} {{ [0] * 3 }})",
       R"({})", R"(ab1NoneTrue abcd ababab [1, 2] [0, 0, 0])"},
      {R"({{ 1 < 2 < 3 }} {{ 1 < 3 < 2 }} {{ 1 == 1.0 }} {{ 'a' != 'b' }} {{ [1, 2] == [1, 2] }} {{ {'a': 1} == {'a': 1} }})",
       R"({})", R"(True False True True True True)"},
      {R"({{ 'ell' in 'hello' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [1, 2] }})", R"({})",
       R"(True True True True)"},
      {R"({{ 0 or 'x' }} {{ 1 and 'y' }} {{ not 0 }} {{ [] or {} or 'last' }} {{ none and 1 }})", R"({})",
       R"(x y True last None)"},
      {R"({{ 'a' if x else 'b' }} [{{ 'only if' if x }}] {{ -x|abs if x else 0 }})", R"({"x": 0})",
       R"(b [] 0)"},
      {R"({{ -3|abs }} {{ - 2 ** 2 }} {{ (-2) ** 2 }})", R"({})", R"(3 4 4)"},
      {R"({{ m.a.b }} {{ m['a']['b'] }} {{ m.l[1] }} {{ m.l[-1] }} {{ m.l.0 }} [{{ m.l[9] }}] [{{ m.nope }}])",
       R"({"m": {"a": {"b": "deep"}, "l": [10, 20, 30]}})", R"(deep deep 20 30 10 [] [])"},
      {R"({{ s[1:] }} {{ s[:-1] }} {{ s[::-1] }} {{ s[::2] }} {{ l[1:3] }} {{ l[::-1] }} {{ l[-2:] }} {{ s[10:] }})",
       R"({"s": "h\u00e9llo", "l": [1, 2, 3, 4]})", R"(éllo héll olléh hlo [2, 3] [4, 3, 2, 1] [3, 4] )"},
      {R"({{ "tab\there" }}|{{ 'it\'s' }}|{{ "\u00e9\x41\n" }}|{{ 'a' 'b' }}|{{ 1_000 }}|{{ 1e3 }}|{{ 2.50 }}|{{ 0.5 if false else 7 }})",
       R"({})", "tab\there|it's|\u00e9A\n|ab|1000|1000.0|2.5|7"},
  });
}

TEST(Jinja, PrintsValuesAsPythonStr) {
  check({
      {R"({{ true }} {{ false }} {{ none }} {{ 1.0 }} {{ 0.1 + 0.2 }} {{ 1e16 }} {{ 1e15 }} {{ 0.00001 }} {{ 1/3 }} {{ -0.0 }})",
       R"({})",
       R"(True False None 1.0 0.30000000000000004 1e+16 1000000000000000.0 1e-05 0.3333333333333333 -0.0)"},
      {R"({{ [1, 'a', 1.5, none, true, [], {}] }} {{ ('x',) }} {{ (1, 2) }} {{ {'k': 'v', 'n': [1]} }})",
       R"({})", R"([1, 'a', 1.5, None, True, [], {}] ('x',) (1, 2) {'k': 'v', 'n': [1]})"},
      {R"({{ ["it's", 'say "hi"', 'both \' "', 'new\nline', 'back\\slash'] }})", R"({})",
       R"(["it's", 'say "hi"', 'both \' "', 'new\nline', 'back\\slash'])"},
      {R"({{ x }})", R"({"x": {"a": 1, "b": [true, null, 2.5, "s"]}})",
       R"({'a': 1, 'b': [True, None, 2.5, 's']})"},
      {R"([{{ undefined_name }}] {{ namespace(a=1) }})", R"({})", R"([] <Namespace {'a': 1}>)"},
  });
}

TEST(Jinja, Filters) {
  check({
      {R"({{ '  x  '|trim }}|{{ 'xxaxx'|trim('x') }}|{{ 'abc'|upper }}|{{ 'ABC'|lower }}|{{ 'hello wORLD-foo(bar'|title }}|{{ 'hELLO'|capitalize }})",
       R"({})", R"(x|a|ABC|abc|Hello World-Foo(Bar|Hello)"},
      {R"({{ 'abc'|length }} {{ [1, 2]|count }} {{ {'a': 1}|length }} {{ missing|length }} {{ 'h\u00e9'|length }})",
       R"({})", R"(3 2 1 0 2)"},
      {R"({{ missing|default('d') }} {{ ''|default('e') }} {{ ''|default('f', true) }} {{ none|d('g') }} {{ 0|d('h', boolean=true) }})",
       R"({})", R"(d  f None h)"},
      {R"({{ [1, 2, 3]|join(', ') }} {{ 'abc'|join('-') }} {{ users|join('/', attribute='name') }} {{ [1, 2]|first }} {{ [1, 2]|last }} {{ 'xyz'|first }})",
       R"({"users": [{"name": "a"}, {"name": "b"}]})", R"(1, 2, 3 a-b-c a/b 1 2 x)"},
      {R"({{ '42'|int + 1 }} {{ '4.7'|int }} {{ 'x'|int }} {{ 'x'|int(7) }} {{ 3.9|int }} {{ '0x1A'|int(0, 16) }} {{ '2.5'|float }} {{ 'x'|float }} {{ 3|float }})",
       R"({})", R"(43 4 0 7 3 26 2.5 0.0 3.0)"},
      {R"({{ 2.5|round }} {{ 3.5|round }} {{ 3.14159|round(2) }} {{ 2.7|round(method='floor') }} {{ 2.1|round(0, 'ceil') }} {{ 3|round }} {{ -4|abs }})",
       R"({})", R"(2.0 4.0 3.14 2.0 3.0 3 4)"},
      {R"({{ 'a-b-c'|replace('-', '+') }} {{ 'aaa'|replace('a', 'b', 2) }} {{ 'abc'|reverse }} {{ [1, 2, 3]|reverse|list }})",
       R"({})", R"(a+b+c bba cba [3, 2, 1])"},
      {R"({{ ['b', 'A', 'c']|sort }} {{ ['b', 'A', 'c']|sort(case_sensitive=true) }} {{ [3, 1, 2]|sort(reverse=true) }} {{ users|sort(attribute='age')|map(attribute='name')|list }})",
       R"({"users": [{"name": "x", "age": 30}, {"name": "y", "age": 20}]})",
       R"(['A', 'b', 'c'] ['A', 'b', 'c'] [3, 2, 1] ['y', 'x'])"},
      {R"({{ ['a', 'A', 'b', 'a']|unique|list }} {{ [1, 2, 1.0, true]|unique|list }} {{ {'b': 1, 'A': 2}|dictsort }} {{ {'b': 1, 'a': 2}|dictsort(by='value') }})",
       R"({})", R"(['a', 'b'] [1, 2] [('A', 2), ('b', 1)] [('b', 1), ('a', 2)])"},
      {R"({{ [1, 2, 3, 4]|select('even')|list }} {{ [1, 2, 3, 4]|reject('even')|list }} {{ [0, 1, '', 'x']|select|list }} {{ ['a', 'b']|map('upper')|join }} {{ [1, 5, 9]|select('gt', 4)|list }})",
       R"({})", R"([2, 4] [1, 3] [1, 'x'] AB [5, 9])"},
      {R"({{ ms|selectattr('role', 'equalto', 'user')|map(attribute='c')|list }} {{ ms|rejectattr('role', 'eq', 'user')|map(attribute='c')|list }} {{ ms|selectattr('tool')|list|length }} {{ ms|selectattr('tool', 'undefined')|list|length }} {{ ms|map(attribute='x', default='-')|join }})",
       R"({"ms": [{"role": "user", "c": 1}, {"role": "bot", "c": 2, "tool": true}, {"role": "user", "c": 3}]})",
       R"([1, 3] [2] 1 2 ---)"},
      {R"({{ d|items|list }} {{ d.items()|list }} {{ d.keys()|list }} {{ d.values()|list }} {{ d.get('a') }} {{ d.get('z', 0) }} {{ d.get('z') }})",
       R"({"d": {"a": 1, "b": 2}})",
       R"([('a', 1), ('b', 2)] [('a', 1), ('b', 2)] ['a', 'b'] [1, 2] 1 0 None)"},
      {"{{ 'a\\nb\\n\\nc'|indent }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent('> ', blank=true) }}",
       R"({})", "a\n    b\n\n    c|  a\n  b|a\n> \n> b"},
      {R"({{ 'one two  three'|wordcount }} {{ 'ab'|center(6) }}| {{ '<a href="x">'|e }} {{ '<b>'|safe }} {{ 5|string ~ 'x' }} {{ [1, [2]]|list }} {{ 'ab'|list }})",
       R"({})", R"(3   ab  | &lt;a href=&#34;x&#34;&gt; <b> 5x [1, [2]] ['a', 'b'])"},
      {R"({{ [3, 1, 2]|max }} {{ [3, 1, 2]|min }} {{ [1, 2, 3]|sum }} {{ users|sum(attribute='n') }} {{ [1, 2, 3, 4, 5]|batch(2)|list }})",
       R"({"users": [{"n": 2}, {"n": 5}]})", R"(3 1 6 7 [[1, 2], [3, 4], [5]])"},
  });
}

TEST(Jinja, TojsonAsTransformersDefinesIt) {
  check({
      {R"({{ x|tojson }})", R"({"x": {"b": [1, 2.0, "\u00e9\n\"<>&'", null, true], "a": {}, "c": []}})",
       R"({"b": [1, 2.0, "é\n\"<>&'", null, true], "a": {}, "c": []})"},
      {R"({{ x|tojson(indent=2) }})", R"({"x": {"a": [1, {"b": null}], "e": []}})",
       "{\n  \"a\": [\n    1,\n    {\n      \"b\": null\n    }\n  ],\n  \"e\": []\n}"},
      {R"({{ x|tojson(separators=(',', ':'), sort_keys=true) }} {{ x|tojson(ensure_ascii=true) }})",
       R"({"x": {"z": "\u00e9\ud83c\udf0d", "a": 1}})",
       R"({"a":1,"z":"é🌍"} {"z": "\u00e9\ud83c\udf0d", "a": 1})"},
      {R"({{ 'str'|tojson }} {{ 1.5e300|tojson }} {{ (1, 2)|tojson }} {{ "\x01\t"|tojson }})", R"({})",
       R"("str" 1.5e+300 [1, 2] "\u0001\t")"},
  });
}

TEST(Jinja, Tests) {
  check({
      {R"({{ x is defined }} {{ y is defined }} {{ y is undefined }} {{ n is none }} {{ x is not none }})",
       R"({"x": 1, "n": null})", R"(True False True True True)"},
      {R"({{ 's' is string }} {{ 1 is number }} {{ 1.5 is number }} {{ true is number }} {{ 1 is integer }} {{ true is integer }} {{ 1.0 is float }} {{ true is boolean }})",
       R"({})", R"(True True True True True False True True)"},
      {R"({{ {} is mapping }} {{ [] is mapping }} {{ [] is iterable }} {{ 's' is iterable }} {{ 1 is iterable }} {{ 's' is sequence }} {{ range is callable }} {{ 's' is callable }})",
       R"({})", R"(True False True True False True True False)"},
      {R"({{ true is true }} {{ 1 is true }} {{ false is false }} {{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 9 is divisibleby(4) }})",
       R"({})", R"(True False True True True True False)"},
      {R"({{ 1 is eq 1 }} {{ 'a' is equalto 'b' }} {{ 1 is ne 2 }} {{ 2 is gt 1 }} {{ 2 is lt 1 }} {{ 2 is ge 2 }} {{ 1 is le 0 }} {{ 2 is in [1, 2] }})",
       R"({})", R"(True False True True False True False True)"},
      {R"({{ 'abc' is lower }} {{ 'aBc' is lower }} {{ 'ABC' is upper }} {{ none is sameas none }} {{ x is sameas x }})",
       R"({"x": [1]})", R"(True False True True True)"},
      {R"({{ (x is defined and x) }} {{ not x is defined }} {{ 'upper' is filter }} {{ 'odd' is test }})",
       R"({})", R"(False True True True)"},
  });
}

TEST(Jinja, StringMethods) {
  check({
      {R"([{{ '  a b  '.strip() }}] [{{ 'xxaxx'.lstrip('x') }}] [{{ 'xxaxx'.rstrip('x') }}] [{{ '\n\ta\n'.strip('\n') }}])",
       R"({})", "[a b] [axx] [xxa] [\ta]"},
      {R"({{ 'a,b,,c'.split(',') }} {{ '  a  b '.split() }} {{ 'a,b,c'.split(',', 1) }} {{ 'a,b,c'.rsplit(',', 1) }} {{ 'a b  c'.split(none, 1) }})",
       R"({})", R"(['a', 'b', '', 'c'] ['a', 'b'] ['a', 'b,c'] ['a,b', 'c'] ['a', 'b  c'])"},
      {R"({{ 'hello'.startswith('he') }} {{ 'hello'.endswith(('x', 'lo')) }} {{ 'hello'.startswith(('x', 'y')) }})",
       R"({})", R"(True True False)"},
      {R"({{ 'ab'.upper() }} {{ 'AB'.lower() }} {{ "they're bill's".title() }} {{ 'aBC'.capitalize() }} {{ 'a-b'.replace('-', '') }})",
       R"({})", R"(AB ab They'Re Bill'S Abc ab)"},
      {R"({{ 'h\u00e9llo'.find('l') }} {{ 'hello'.find('z') }} {{ 'hello'.rfind('l') }} {{ 'hello'.count('l') }} {{ ', '.join(['a', 'b']) }})",
       R"({})", R"(2 -1 3 2 a, b)"},
      {R"({{ '{} and {}'.format(1, 'two') }} {{ '{name}!'.format(name='x') }} {{ 'a=b'.partition('=') }} {{ '42'.isdigit() }} {{ '7'.zfill(3) }})",
       R"({})", R"(1 and two x! ('a', '=', 'b') True 007)"},
      {R"({{ m.content.split('</think>')[-1].lstrip('\n') }}|{{ m.content.split('</think>')[0].split('<think>')[-1].strip() }})",
       R"({"m": {"content": "<think>\nreason\n</think>\n\nanswer"}})", R"(answer|reason)"},
      {R"({{ [1, 2, 1].count(1) }} {{ ['a', 'b'].index('b') }})", R"({})", R"(2 1)"},
  });
}

// ---- errors ----

TEST(JinjaErrors, ParseErrorsNameTheTemplateLineAndColumn) {
  expect_error<ValueError>([] { Template::parse("a\n  {{ 1 + }}", "my.jinja"); }, {"my.jinja:2:10:", "'}}'"});
  expect_error<ValueError>([] { Template::parse("{% for x in y %}\n{{ x }}", "t"); },
                           {"t:2:", "endfor", "1:4"});
  expect_error<ValueError>([] { Template::parse("{% frobnicate %}", "t"); },
                           {"t:1:4:", "unknown tag 'frobnicate'"});
  expect_error<ValueError>([] { Template::parse("{{ x | nosuchfilter }}", "t"); },
                           {"t:1:8:", "no filter named 'nosuchfilter'"});
  expect_error<ValueError>([] { Template::parse("{{ x is nosuchtest }}", "t"); },
                           {"t:1:9:", "no test named"});
  expect_error<ValueError>([] { Template::parse("{{ 'unterminated }}", "t"); },
                           {"t:1:4:", "unterminated string"});
  expect_error<ValueError>([] { Template::parse("{# never closed", "t"); }, {"t:1:1:", "comment"});
  expect_error<ValueError>([] { Template::parse("{% if x %}{% endfor %}", "t"); }, {"t:1:14:", "endfor"});
  expect_error<ValueError>([] { Template::parse("{% break %}", "t"); }, {"t:1:4:", "outside a loop"});
  expect_error<ValueError>([] { Template::parse("{{ x ! y }}", "t"); }, {"t:1:6:", "unexpected character"});
  expect_error<ValueError>([] { Template::parse("{% include 'x' %}", "t"); }, {"t:1:4:", "not supported"});
  expect_error<ValueError>([] { Template::parse("{{ 99999999999999999999 }}", "t"); }, {"t:1:4:", "64 bits"});
  expect_error<ValueError>([] { Template::parse("h\u00e9\u00e9 {{ ) }}", "t"); },
                           {"t:1:8:"});  // columns count code points
}

// jinja's compiler checks filter and test names, except in the branches of an if or a conditional
// expression, where a missing one fails only when it runs; kiln draws the same line.
TEST(JinjaErrors, UnknownFiltersInsideIfFailOnlyWhenRun) {
  EXPECT_EQ(render("{% if false %}{{ x|nosuch }}{{ x is nosuch }}{% endif %}ok"), "ok");
  EXPECT_EQ(render("{{ (x|nosuch) if false else 1 }}"), "1");
  expect_error<ValueError>([] { render("{% if true %}{{ x|nosuch }}{% endif %}"); },
                           {"t.jinja:1:19:", "no filter named 'nosuch'"});
  expect_error<ValueError>(
      [] { Template::parse("{% if false %}{% for i in x %}{{ i|nosuch }}{% endfor %}{% endif %}", "t"); },
      {"t:1:36:", "no filter named"});
  expect_error<ValueError>(
      [] { Template::parse("{% if false %}{% set y %}{{ 1|nosuch }}{% endset %}{% endif %}", "t"); },
      {"no filter named"});
}

TEST(JinjaErrors, SyntaxJinjaRefusesOrTakes) {
  EXPECT_EQ(
      render(
          "{% for x in [1, 2]: %}{{ x }}{% else: %}-{% endfor %}{% if true: %}y{% elif false: %}{% endif %}"),
      "12y");
  EXPECT_EQ(render("[{{ x[] }}] [{{ d['a', 'b'] }}]", R"({"x": [1], "d": {}})"), "[] []");
  expect_error<ValueError>([] { Template::parse("{% if a if b %}{% endif %}", "t"); }, {"t:1:9:"});
  expect_error<ValueError>([] { Template::parse("{% set a, = [1] %}", "t"); }, {"t:1:11:"});
  expect_error<ValueError>([] { Template::parse("{{ 1 +}}", "t"); }, {"t:1:"});
  expect_error<ValueError>([] { Template::parse("{{ 01 }}", "t"); }, {"t:1:4:", "leading zeros"});
  expect_error<ValueError>([] { Template::parse("{% macro m(a, a) %}{% endmacro %}", "t"); },
                           {"t:1:15:", "duplicate argument 'a'"});
  expect_error<ValueError>([] { render("{{ 'a'|replace('a') }}"); }, {"missing required argument 'new'"});
  expect_error<ValueError>([] { render("{{ namespace(nope) }}"); }, {"'nope' is undefined"});
}

TEST(JinjaErrors, RenderErrorsNameTheTemplateLineAndColumn) {
  expect_error<ValueError>([] { render("line\n  {{ raise_exception('Roles must alternate!') }}"); },
                           {"t.jinja:2:6:", "raise_exception: Roles must alternate!"});
  expect_error<ValueError>([] { render("{{ missing.attr }}"); }, {"t.jinja:1:", "'missing' is undefined"});
  expect_error<ValueError>([] { render("{{ missing + 1 }}"); }, {"'missing' is undefined"});
  expect_error<ValueError>([] { render("{{ missing() }}"); }, {"'missing' is undefined"});
  expect_error<ValueError>([] { render("{{ 'a' + 1 }}"); },
                           {"t.jinja:1:8:", "unsupported operand type(s) for +: 'str' and 'int'"});
  expect_error<ValueError>([] { render("{{ 1 / 0 }}"); }, {"division by zero"});
  expect_error<ValueError>([] { render("{{ 1 < 'a' }}"); }, {"'<' not supported"});
  expect_error<ValueError>([] { render("{% for x in 5 %}{% endfor %}"); },
                           {"t.jinja:1:", "'int' object is not iterable"});
  expect_error<ValueError>([] { render("{% set x = 1 %}{% set x.a = 2 %}"); }, {"non-namespace"});
  expect_error<ValueError>([] { render("{{ xs.append(1) }}", R"({"xs": []})"); }, {"unsafe"});
  expect_error<ValueError>([] { render("{{ 'a'.split('') }}"); }, {"empty separator"});
  expect_error<ValueError>([] { render("{{ {'a': 1}|tojson }}{{ missing|tojson }}"); },
                           {"not JSON serializable"});
  expect_error<ValueError>([] { render("{{ 9223372036854775807 + 1 }}"); }, {"integer overflow"});
  expect_error<ValueError>([] { render("{% set a, b = [1] %}"); }, {"not enough values to unpack"});
  expect_error<ValueError>([] { render("{% set ns = namespace() %}{% set ns.me = [ns] %}"); }, {"itself"});
  expect_error<ValueError>([] { render("{{ x }}", "[1]"); }, {"t.jinja", "JSON object"});
}

TEST(JinjaErrors, LimitsStopRunawayTemplates) {
  // Deep nesting in the source: parse error, not a stack overflow.
  expect_error<ValueError>(
      [] { Template::parse("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}", "t"); },
      {"t:1:", "nested deeper"});
  std::string blocks;
  for (int i = 0; i < 3000; ++i) blocks += "{% if true %}";
  expect_error<ValueError>([&] { Template::parse(blocks, "t"); }, {"nested deeper"});
  // Unbounded recursion through a macro.
  expect_error<ValueError>([] { render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"); },
                           {"t.jinja:1:", "nested deeper than"});
  // Loops: jinja's sandbox caps range(), kiln caps the iterations of the whole render.
  expect_error<ValueError>([] { render("{% for i in range(1000000000) %}{% endfor %}"); }, {"Range too big"});
  // The default: nested range() loops of a few hundred each (a fuzzer's input that rendered for 10 s
  // under the sanitizers with the earlier 1,000,000) are refused at 100,000 iterations.
  expect_error<ValueError>(
      [] { render("{% for i in range(470) %}{% for j in range(470) %}{{ i, j }}{% endfor %}{% endfor %}"); },
      {"t.jinja:1:", "loop iterations exceed the limit of 100000"});
  Limits small;
  small.max_loop_iterations = 1000;
  expect_error<ValueError>(
      [&] {
        render("{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}", "{}", small);
      },
      {"t.jinja:1:", "loop iterations exceed the limit of 1000"});
  // Output: the rendered text and every string built on the way.
  small.max_output_bytes = 1 << 16;
  expect_error<ValueError>(
      [&] {
        render(
            "{% for i in range(1000) "
            "%}0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef{% endfor %}",
            "{}", small);
      },
      {"output limit"});
  expect_error<ValueError>([&] { render("{{ 'x' * 100000000000 }}", "{}", small); }, {"output limit"});
  expect_error<ValueError>(
      [&] {
        render(
            "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor "
            "%}",
            "{}", small);
      },
      {"output limit"});
  // Values nested deeper than printing may follow, built in a loop and in the context.
  expect_error<ValueError>(
      [] {
        render(
            "{% set ns = namespace(x=[]) %}{% for i in range(5000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ "
            "ns.x }}");
      },
      {"nested deeper than"});
  std::string deep = std::string(1000, '[') + std::string(1000, ']');
  expect_error<ValueError>([&] { render("{{ x }}", "{\"x\": " + deep + "}"); }, {"nested deeper than"});
}

// Templates mangled at random (characters dropped, duplicated, swapped for syntax) either render or
// fail with a ValueError: never another exception, a crash, or a hang. Under the sanitize preset this
// also checks memory safety on broken input.
TEST(JinjaErrors, MangledTemplatesFailCleanly) {
  const std::vector<std::string> seeds = {
      R"({%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}{%- if ns.multi and message.role == "user" and not(message.content.startswith('<t>') and message.content.endswith('</t>')) %}{%- set ns.multi = false %}{%- endif %}{%- endfor %})",
      R"({% set ns = namespace(a=1, b=[1, 2]) %}{% macro m(x, y='d') %}{{ x ~ y }}{{ caller() if caller is defined }}{% endmacro %}{% for k, v in d.items() if k != 'z' %}{{ m(k) }}{{ v|tojson(indent=2) }}{{ loop.cycle('a', 'b') }}{% else %}none{% endfor %})",
      R"({{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set p = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set p = "" -%}{%- endif -%}{%- for message in loop_messages -%}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}{{ raise_exception("alternate") }}{%- endif -%}{{ '<start>' + message['role'] | trim }}{%- endfor -%})",
      R"({% raw %}{{ x }}{% endraw %}{# c #}{{ [1, 2.5, 'x', none, true]|map('string')|join(',') }}{{ "a\tb"|replace('\t', ' ')|upper }}{% filter lower %}AB{% endfilter %}{{ 10 // 3 ** 2 }}{{ x.y.z }})",
  };
  const std::string alphabet = "{}%#-+()[]'\",.|:=~*/ abxy\n";
  const auto context = nlohmann::ordered_json::parse(
      R"({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "d": {"a": 1, "z": 2}, "bos_token": "<s>"})");
  Limits limits;
  limits.max_loop_iterations = 10000;
  limits.max_output_bytes = 1 << 20;
  uint64_t rng = 0x9E3779B97F4A7C15ull;
  auto next = [&](uint64_t n) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return static_cast<size_t>(rng % n);
  };
  int rendered = 0, refused = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string t = seeds[next(seeds.size())];
    for (size_t edits = 1 + next(4); edits > 0; --edits) {
      const size_t at = next(t.size());
      switch (next(3)) {
        case 0:
          t.erase(at, 1 + next(3));
          break;
        case 1:
          t.insert(at, 1, alphabet[next(alphabet.size())]);
          break;
        default:
          t.insert(at, t.substr(next(t.size()), next(12)));
          break;
      }
    }
    try {
      Template::parse(t, "fuzz", limits).render(context);
      ++rendered;
    } catch (const ValueError& e) {
      ++refused;
      EXPECT_EQ(std::string(e.what()).rfind("fuzz", 0), 0u) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a ValueError: " << e.what() << "\ntemplate: " << t;
    }
  }
  EXPECT_GT(rendered, 100);
  EXPECT_GT(refused, 100);
}
