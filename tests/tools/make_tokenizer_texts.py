#!/usr/bin/env python3
"""Writes tests/data/tokenizers/texts.json: the texts the tokenizer oracle test (tests/pipelines/
test_tokenizer_oracle.cpp) encodes with kiln and with Hugging Face's tokenizers. Hand-written texts
for each thing tokenizers get wrong (scripts, whitespace runs, digits, normalization forms, special
tokens written literally), then a few generated mixes of them. Deterministic: rerun after editing
and commit both files.

    python3 tests/tools/make_tokenizer_texts.py
"""
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "data" / "tokenizers" / "texts.json"

prose = [
    "Hello world",
    "Hello, World! It's 2024.",
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness.",
    "In 1969, Neil Armstrong became the first person to walk on the Moon.",
    "Dr. Smith (a well-known surgeon) said: \"Don't worry; it'll be fine.\"",
    "E-mail me at john.doe+test@example.com or visit https://example.org/path?q=1&lang=en#top.",
    "Mr. and Mrs. Dursley, of number four, Privet Drive, were proud to say that they were perfectly normal, thank you very much.",
    "A sentence without a final period",
    "ALL CAPS SHOUTING AND MiXeD cAsE wOrDs",
    "semi;colons:and,commas.everywhere!?",
    "Ellipsis... and an em dash \u2014 and an en dash \u2013 and a hyphen - too.",
    "\u201cCurly quotes\u201d and \u2018single curly\u2019 and \u00abguillemets\u00bb.",
    "The price is $19.99 (or \u20ac17.50, \u00a315, \u00a52,000).",
    "Temperature: 25\u00b0C / 77\u00b0F; 5 \u00d7 3 = 15; 10 \u00f7 2 = 5; \u00b11.",
    "Question? Answer! Interrobang\u203d",
    "#hashtag @mention $VAR %percent ^caret &amp; *star* _under_ ~tilde~ `tick`",
    "Once upon a time\nthere was a line break.",
    "Paragraph one.\n\nParagraph two.\n\n\nParagraph three.",
    "x",
    "a",
    "I",
    "Z",
    "0",
    ".",
    "!",
    "?!",
    "The end.",
]

contractions = [
    "I'm here, you're there, he's gone, we've won, they'd go, I'll stay, don't, can't, won't.",
    "I'M HERE, YOU'RE THERE, HE'S GONE, WE'VE WON, THEY'D GO, I'LL STAY, DON'T.",
    "She'S, he'Ll, we'Ve, they'D, it'S (odd casing)",
    "'s 'S 't 'T 're 'RE 've 'VE 'm 'M 'll 'LL 'd 'D",
    "John's book and James' book and the Joneses' house",
    "rock 'n' roll, 'tis the season, 'twas, o'clock, y'all",
    "It\u2019s a curly apostrophe: don\u2019t, can\u2019t, I\u2019ll.",
    "''double single'' and ```triple``` and \"\"\"docstring\"\"\"",
    "'quoted' \"double\" `back`",
    "'",
    "''",
    "'s",
    "l'homme, aujourd'hui, qu'il, c'est, j'ai",
]

code = [
    "def add(a, b):\n    return a + b\n",
    "def fib(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\nprint([fib(i) for i in range(10)])\n",
    "class Foo(Base):\n    def __init__(self, *args, **kwargs):\n        super().__init__(*args, **kwargs)\n        self._cache = {}\n",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)\nx[..., 0] += 1e-5\n",
    "#include <cstdio>\n\nint main(int argc, char** argv) {\n\tfor (int i = 0; i < argc; ++i) {\n\t\tstd::printf(\"%s\\n\", argv[i]);\n\t}\n\treturn 0;\n}\n",
    "template <typename T>\nstd::vector<T> twice(const std::vector<T>& v) {\n  std::vector<T> out;\n  out.reserve(v.size() * 2);\n  for (const T& x : v) { out.push_back(x); out.push_back(x); }\n  return out;\n}\n",
    "auto it = std::find_if(v.begin(), v.end(), [&](int x) { return x > 0 && x % 2 == 0; });",
    "if (a != b && c <= d || e >= f) { x <<= 2; y >>= 1; z ^= ~w; }",
    "{\"name\": \"kiln\", \"version\": \"0.1.0\", \"tags\": [\"a\", \"b\"], \"nested\": {\"x\": 1.5, \"y\": null, \"z\": true}}",
    "{\n  \"key\": \"value\",\n  \"list\": [\n    1,\n    2,\n    3\n  ]\n}",
    "[{\"id\":1},{\"id\":2},{\"id\":3}]",
    "#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.txt; do\n\techo \"$f\"\n\twc -l \"$f\" | awk '{print $1}'\ndone\n",
    "ls -la /usr/local/bin && cd ~/src && git log --oneline | head -n 5",
    "export PATH=\"$HOME/.local/bin:$PATH\"\nalias ll='ls -alF'\n",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE 'A%' ORDER BY name DESC LIMIT 10;",
    "<html>\n  <body>\n    <div class=\"main\" id='x'>Hello &amp; welcome</div>\n  </body>\n</html>",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
    "const f = async (x) => { await sleep(100); return x?.y ?? 'default'; };",
    "x = [1, 2, 3]\n\ty = {'a': 1}\n\t\tz = (4,)\n",
    "    four leading spaces\n        eight leading spaces\n            twelve",
    "\t\ttwo tabs\n\t\t\tthree tabs\n",
    "a_b_c = snake_case_name; camelCaseName = PascalCaseName; SCREAMING_SNAKE = 1",
    "// comment\n/* block\n   comment */\n# shell comment\n-- sql comment",
    "regex: ^[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\\.[A-Za-z]{2,}$",
    "path\\to\\windows\\file.txt and C:\\Program Files (x86)\\App",
    "0x1F 0xDEADBEEF 0b1010 0o777 1e10 3.14f 2.5e-3 1_000_000",
    "===\n---\n***\n___\n",
    "->>= :: ... <=> !== === ** // %%",
]

numbers = [
    "1",
    "12",
    "123",
    "1234",
    "12345",
    "123456",
    "1234567",
    "12345678901234567890",
    "3.14159265358979323846264338327950288419716939937510",
    "1,234,567",
    "1,234,567.89",
    "1.234.567,89",
    "-42 +42 \u221242",
    "0.5 .5 5. 0.000001 1e-9 6.022e23",
    "Call 555-0123 or +1 (555) 012-3456.",
    "2024-01-15T13:45:30Z and 13:45:30.123",
    "Version 3.10.12 and v1.2.3-beta.4+build.5",
    "100% of 50 is 50; 25% is 12.5",
    "1st 2nd 3rd 4th 21st 22nd 101st",
    "\u0661\u0662\u0663 \u0967\u0968\u0969 \u0e51\u0e52\u0e53 \uff11\uff12\uff13",
    "\u00bd \u00bc \u00be \u2153 \u2154 x\u00b2 y\u00b3 H\u2082O",
    "\u2160 \u2161 \u2162 \u2163 \u216b",
    "007 0042 000000",
    "9" * 100,
    "31415926535897932384626433832795028841971693993751058209749445923078164062862089986280348253421170679",
]

whitespace = [
    "",
    " ",
    "  ",
    "   ",
    "    ",
    " " * 17,
    "\t",
    "\t\t",
    "\n",
    "\n\n",
    "\n\n\n\n\n\n\n\n",
    "\r\n",
    "\r\n\r\n",
    "\r",
    "line one\r\nline two\r\nline three\r\n",
    "trailing spaces   ",
    "   leading spaces",
    "  both sides  ",
    "word\tword\t\tword",
    "word \t \t word",
    "end with newline\n",
    "end with newlines\n\n\n",
    "\nstarts with newline",
    " \n \n \n",
    "a  b   c    d     e",
    "a\n b\n  c\n   d",
    "mixed \u00a0non-breaking\u00a0space and \u2009thin\u2009space and \u3000ideographic\u3000space",
    # No U+FEFF (BOM): JavaScript's \s matches it, Python's and Rust's do not, so the JS oracle
    # splits it off where transformers does not.
    "zero\u200bwidth\u200bspace and \u200cnon-joiner and \u200djoiner",
    "vertical\u000btab and form\u000cfeed",
    "\u2028line separator\u2029paragraph separator",
    "\u0085next line",
    "tab at end\t",
    "\t leading tab and space",
    "    \n    \n",
]

scripts = [
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 fa\u00e7ade \u00fcber Stra\u00dfe \u00e5ngstr\u00f6m \u00f1and\u00fa",
    "\u017b\u00f3\u0142\u0107 g\u0119\u015bl\u0105 ja\u017a\u0144 \u2014 P\u0159\u00edli\u0161 \u017elu\u0165ou\u010dk\u00fd k\u016f\u0148",
    "Gr\u00fc\u00dfe aus K\u00f6ln! \u00c4rger, \u00d6l, \u00dcbel.",
    "\u00c9l \u00e9t\u00e9 \u00e0 l'h\u00f4tel \u00eele No\u00ebl \u0152uvre \u00c6sir",
    "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5! \u03b1\u03b2\u03b3\u03b4\u03b5 \u0391\u0392\u0393\u0394\u0395 \u1f00\u1f01\u1f70",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0421\u044a\u0435\u0448\u044c \u0436\u0435 \u0435\u0449\u0451 \u044d\u0442\u0438\u0445 \u043c\u044f\u0433\u043a\u0438\u0445 \u0444\u0440\u0430\u043d\u0446\u0443\u0437\u0441\u043a\u0438\u0445 \u0431\u0443\u043b\u043e\u043a.",
    "\u0423\u043a\u0440\u0430\u0457\u043d\u0441\u044c\u043a\u0430: \u0457\u0436\u0430\u043a \u0491\u0430\u043d\u043e\u043a \u0454\u0434\u043d\u0456\u0441\u0442\u044c",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645! \u0647\u0630\u0627 \u0646\u0635 \u0639\u0631\u0628\u064a.",
    "\u0627\u0644\u0633\u064e\u0651\u0644\u0627\u0645\u064f \u0639\u064e\u0644\u064e\u064a\u0652\u0643\u064f\u0645\u0652",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd! \u05d6\u05d4 \u05d8\u05e7\u05e1\u05d8 \u05d1\u05e2\u05d1\u05e8\u05d9\u05ea.",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e! \u092f\u0939 \u0939\u093f\u0928\u094d\u0926\u0940 \u092e\u0947\u0902 \u0939\u0948\u0964",
    "\u0b95\u0bae\u0bb8\u0bcd\u0b95\u0bbe\u0bb0\u0bae\u0bcd \u0ba4\u0bae\u0bbf\u0bb4\u0bcd \u2014 \u09ac\u09be\u0982\u09b2\u09be \u09ad\u09be\u09b7\u09be",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a \u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22\u0e44\u0e21\u0e48\u0e21\u0e35\u0e0a\u0e48\u0e2d\u0e07\u0e27\u0e48\u0e32\u0e07\u0e23\u0e30\u0e2b\u0e27\u0e48\u0e32\u0e07\u0e04\u0e33",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u8fd9\u662f\u4e00\u4e2a\u4e2d\u6587\u53e5\u5b50\u3002",
    "\u6211\u7231\u5317\u4eac\u5929\u5b89\u95e8\uff0c\u5929\u5b89\u95e8\u4e0a\u592a\u9633\u5347\u3002",
    "\u7e41\u9ad4\u4e2d\u6587\uff1a\u81fa\u7063\u3001\u9999\u6e2f\u3001\u6fb3\u9580\u3002",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3067\u3059\u3002\u3072\u3089\u304c\u306a\u3001\u30ab\u30bf\u30ab\u30ca\u3001\u6f22\u5b57\u3002",
    "\u3053\u3093\u306b\u3061\u306f\u4e16\u754c \u30b3\u30f3\u30cb\u30c1\u30cf \uff7a\uff9d\uff86\uff81\uff8a",
    "\uc548\ub155\ud558\uc138\uc694, \uc138\uacc4! \ud55c\uad6d\uc5b4 \ubb38\uc7a5\uc785\ub2c8\ub2e4.",
    "\u1100\u1161\u11a8 (conjoining jamo) vs \uac01",
    "\u10d2\u10d0\u10db\u10d0\u10e0\u10ef\u10dd\u10d1\u10d0 \u0532\u0561\u0580\u0587 \u12a0\u121b\u122d\u129b \u1781\u17d2\u1798\u17c2\u179a",
    "Ti\u1ebfng Vi\u1ec7t c\u00f3 d\u1ea5u: \u0111\u01b0\u1eddng ph\u1ed1 H\u00e0 N\u1ed9i",
    "T\u00fcrk\u00e7e: \u0131\u0130 \u015f\u015e \u011f\u011e \u00e7\u00c7",
    "\u0938\u0902\u0938\u094d\u0915\u0943\u0924\u092e\u094d \u0915\u094d\u0937\u0924\u094d\u0930\u093f\u092f",
    "Mixed: Hello \u4e16\u754c \u041c\u0438\u0440 \u0639\u0627\u0644\u0645 \u05e2\u05d5\u05dc\u05dd \u0e42\u0e25\u0e01 \uc138\uacc4",
    "\U00010348 Gothic, \U00013000 hieroglyph, \U0001d400 math bold A, \U0001f100",
]

emoji = [
    "\U0001f600 \U0001f601 \U0001f602 \U0001f923 \U0001f60a",
    "\U0001f44d\U0001f3fb \U0001f44d\U0001f3fc \U0001f44d\U0001f3fd \U0001f44d\U0001f3fe \U0001f44d\U0001f3ff",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 family",
    "\U0001f469\U0001f3fd\u200d\U0001f4bb \U0001f3f3\ufe0f\u200d\U0001f308 \U0001f3f4\u200d\u2620\ufe0f",
    "\U0001f1fa\U0001f1f8 \U0001f1ef\U0001f1f5 \U0001f1e9\U0001f1ea \U0001f1eb\U0001f1f7 flags",
    "\U0001f3f4\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f Scotland",
    "\u2764\ufe0f \u2764 \u2603\ufe0f \u263a\ufe0f \u2600",
    "1\ufe0f\u20e3 #\ufe0f\u20e3 *\ufe0f\u20e3",
    "I love pizza\U0001f355\U0001f355\U0001f355!!!",
    "\U0001f680\U0001f680\U0001f680\U0001f680\U0001f680\U0001f680\U0001f680\U0001f680",
    "\U0001fae8 \U0001fa77 \U0001fabf (Unicode 15 emoji)",
    "\U0001f9d1\u200d\U0001f91d\u200d\U0001f9d1 \U0001f9d4\u200d\u2640\ufe0f",
]

normalization = [
    "e\u0301",
    "cafe\u0301",
    "Cafe\u0301 na\u0131\u0308ve re\u0301sume\u0301",
    "A\u030a vs \u00c5 vs \u212b",
    "n\u0303 vs \u00f1",
    "o\u0308\u0304 stacked marks a\u0300\u0301\u0302\u0303\u0308",
    "\u1e9b\u0323 long s with dots",
    "\u0915\u093c vs \u0958",
    "\uac00 vs \u1100\u1161",
    "\ufb01nd the \ufb02ow \ufb00 \ufb03 \ufb04",
    "\uff28\uff45\uff4c\uff4c\uff4f \uff37\uff4f\uff52\uff4c\uff44 fullwidth",
    "\uff01\uff1f\uff08\uff09\uff3b\uff3d fullwidth punctuation",
    "\u2460 \u2461 \u2462 \u2473 \u24b6 \u24d0",
    "\u2122 \u2120 \u00a9 \u00ae \u2116 \u2103 \u2109",
    "\u33a1 \u338f \u3392 \u32ff \u3300",
    "\u00b5 vs \u03bc and \u2126 vs \u03a9 and \u212a vs K",
    "\u1d2c\u1d2e superscript letters \u1d43\u1d47\u1d9c",
    "\U0001d573\U0001d58a\U0001d591\U0001d591\U0001d594 fraktur",
    "\u01c4 \u01c5 \u01c6 \u01f1 dz digraphs",
    "\u0130stanbul I\u0307 \u0131",
    "\u1e9e \u00df SS",
    "\u0345\u0342 combining greek",
    "\u0301 lone combining acute at start",
    "x\u20d7 y\u0332 z\u0336",
    "\u00c5\u030a double ring",
]

unicode15 = [
    "\U0001e4d0\U0001e4d1\U0001e4d2\U0001e4d3\U0001e4d4 Nag Mundari",
    "\U0001e4f0\U0001e4f1\U0001e4f2 \U0001e4e8\U0001e4e9",
    "\U00031350\U00031351\U00031352 CJK Extension H",
    "\u4e00\U00031360\u4e01",
    "\U00011f04\U00011f05\U00011f06 Kawi",
    "\U0001e030\U0001e031 Cyrillic modifier letters",
    "\U00011b00\U00011b01 Devanagari Extended-A",
    "\U00010efd\U00010efe Arabic Extended-C",
    "\U0002b739 \U0002ebe0 \U00030000 late CJK extensions",
    "\U0010ffff \U000f0000 \ue000 private use",
    "\ufffd replacement char \ufffe\uffff noncharacters",
]

specials = [
    "<|eot_id|>",
    "<|begin_of_text|>Hello<|eot_id|>",
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<s>",
    "</s>",
    "<s>Hello</s>",
    "<unk>",
    "<pad>",
    "<s> [INST] Hello [/INST]",
    "[INST]Hello[/INST]",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "text<|endoftext|>more",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>",
    "<end_of_turn>",
    "<bos>",
    "<eos>",
    "<|eot_id",
    "<|eot",
    "eot_id|>",
    "<|im_start",
    "im_end|>",
    "<start_of_",
    "<s",
    "</s",
    "< s >",
    "<|EOT_ID|>",
    "<<|eot_id|>>",
    "<|eot_id|><|eot_id|><|eot_id|>",
    " <|eot_id|> ",
    "  <s>  ",
    "\n<|im_end|>\n",
    "a<s>b</s>c",
    "<think>\nreasoning\n</think>\n\nanswer",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "<tool_call>{\"name\": \"f\"}</tool_call>",
    "<|reserved_special_token_0|>",
    "<0x0A> <0xFF> \u2581 \u0120 \u010a",
    "[CLS] [SEP] [MASK] <mask>",
]

odd = [
    "\u0000 NUL and \u0001 SOH and \u007f DEL",
    "\u001b[31mred\u001b[0m ANSI escape",
    "\ud7ff\ue000 edges of the BMP",
    "\u00ad soft\u00adhyphen",
    "\u202eright-to-left override\u202c",
    "\u200f\u200e marks",
    "a\u0000b",
    "\u2581\u2581\u2581 metaspace chars literally",
    "\u0120\u0120 byte-level chars literally \u010a",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "ab" * 60,
    "\u4e00" * 40,
    "!" * 50,
    "." * 33,
    "-" * 80,
    "=" * 64,
    "\U0001f600" * 20,
    "https://www.example.com/a/very/long/url/with/many/segments/and_underscores-and-dashes.html?x=1&y=2",
    "\u00e9" * 30,
    "e\u0301" * 15,
]

hand = prose + contractions + code + numbers + whitespace + scripts + emoji + normalization + unicode15 + specials + odd

# Generated mixes: pieces of the hand-written texts glued with separators, so tokens meet at
# boundaries the hand-written texts do not have (a digit after CJK, a special token after a tab).
rng = random.Random(20)
pieces = [t for t in hand if 0 < len(t) <= 80]
seps = ["", " ", "  ", "\n", "\t", "\r\n", "\n\n", " \n", "'s ", "1", ". "]
generated = []
while len(generated) < 120:
    n = rng.randint(2, 4)
    text = rng.choice(seps).join(rng.choice(pieces) for _ in range(n))
    if rng.random() < 0.3:
        text = rng.choice(seps) + text + rng.choice(seps)
    if text not in hand and text not in generated:
        generated.append(text)

texts = hand + generated
assert len(set(texts)) == len(texts), [t for t in texts if texts.count(t) > 1]
data = json.dumps(texts, ensure_ascii=False, indent=0) + "\n"
OUT.write_text(data, encoding="utf-8")
print(f"{OUT}: {len(texts)} texts ({len(hand)} hand-written), {len(data.encode())} bytes")
