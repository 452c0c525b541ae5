"""The texts the tokenizer fixtures are made from: a hand-written corpus, seeded fuzz and
code point sweeps. Shared by scripts/make_fixtures.py (which sends them through
llama.cpp) and tests/test_tokenizer.py (which regenerates the sweep texts rather than
storing them).
"""

from __future__ import annotations

import random


def corpus() -> list[str]:
    """Hand-written texts: every script and shape the tokenizers must agree on."""
    prose = [
        "Hello world", "Hello, world!", " Hello", "  Hello", "Hello ", "hello\nworld",
        "The quick brown fox jumps over the lazy dog.",
        "It's a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife.",
        "I'm sure you're right; we've said it, they'll agree, he'd know, she's there, don't.",
        "I'M SURE YOU'RE RIGHT; WE'VE SAID IT, THEY'LL AGREE, HE'D KNOW, SHE'S THERE, DON'T.",
        "rock 'n' roll ' quoted ' words 'tis 'S 'T 'Re",
        "Mr. Smith went to Washington... Did he? Yes! No?! Maybe ,, ..",
        "a ' b ' c", "x 's y 'm z 're w 've v 'll u 'd t 't",
        "The year 1984 and 2001: A Space Odyssey; pi is 3.14159265358979.",
        "Prices: $5, €10.50, £3, ¥1000, 10% off, 1,000,000 units, 1e-9, -42, +7, 0x1F, 0b1010.",
        "Numbers ١٢٣٤٥ ४५६ ௧௨ ²³ ½ ¾ Ⅻ ⅷ 〇 ０１２３ 𝟘𝟙𝟚",
        "E = mc²; ∑ᵢ xᵢ² ≤ ∞; ∀x ∈ ℝ: x ≠ √2 → ∫₀¹ f(x) dx ≈ 0.5",
        "Ünïcödé àccénts: café, naïve, résumé, Ångström, Øresund, Łódź, ß, İstanbul",
        "Ｆｕｌｌｗｉｄｔｈ ｔｅｘｔ　with ideographic space",
        "Call me Ishmael. Some years ago—never mind how long precisely—having little or no "
        "money in my purse, and nothing particular to interest me on shore, I thought I would "
        "sail about a little and see the watery part of the world.",
    ]
    code = [
        "def f(x):\n\treturn x * 2\n",
        "def main():\n    for i in range(10):\n        print(i)  # comment\n    return 0\n",
        "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
        "if (a && b || !c) { x += 1; y -= 2; z *= 3; } else { w /= 4; }",
        "    indented with four spaces\n        and eight\n\t\ttwo tabs\n\t  mixed \t tabs",
        "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;",
        '{"key": "value", "list": [1, 2, 3], "nested": {"a": null, "b": true}}',
        "<html><body><table><tr><td>cell</td></tr></table><div class=\"x\">hi</div></body></html>",
        "<h1>Title</h1><p>Some <strong>bold</strong> and <em>italic</em> and <code>x</code>.</p>",
        "x = [i**2 for i in range(100) if i % 3 == 0]\nprint(sum(x))",
        "#include <stdio.h>\n#define MAX(a, b) ((a) > (b) ? (a) : (b))\n",
        "fn main() { let v: Vec<u8> = vec![0; 16]; println!(\"{:?}\", v); }",
        "const f = async (a, b) => { await g(a); return a ?? b; };",
        "$ ls -la /usr/local/bin | grep -E '^d' && echo \"done\" > /tmp/out.txt 2>&1",
        "```python\nimport numpy as np\narr = np.zeros((3, 4), dtype=np.float32)\n```",
        "| a | b |\n|---|---|\n| 1 | 2 |",
        "    ", "\t", "\t\t\t", " \t \t ", "\n", "\n\n", "\n\n\n\n", " \n \n", "a\n\nb\n\n\nc",
        "trailing spaces   ", "   leading spaces", "a  b   c    d     e",
        "line1\r\nline2\r\n\r\nline3\r", "\r\n", "\r", "a\rb", "mixed\n\r\n\r\n\n",
    ]
    scripts = [
        "你好，世界！这是一个测试。", "我爱北京天安门，天安门上太阳升。",
        "日本語のテキスト：ひらがな、カタカナ、漢字。", "東京は日本の首都です。",
        "한국어 텍스트입니다. 안녕하세요!", "مرحبا بالعالم! هذا نص عربي.", "السلام عليكم ورحمة الله",
        "שלום עולם", "नमस्ते दुनिया! यह एक परीक्षण है।", "हिन्दी में लिखा गया वाक्य क्षत्रिय",
        "Привет, мир! Это тест.", "Γειά σου κόσμε", "สวัสดีชาวโลก", "ሰላም ልዑል", "Xin chào thế giới",
        "ᚠᚢᚦᚨᚱᚲ", "ⴰⵣⵓⵍ", "Բարեւ", "გამარჯობა", "ꦲꦤꦕꦫꦏ", "𐌰𐌱𐌲", "𓀀𓀁𓀂", "𝕳𝖊𝖑𝖑𝖔",
    ]
    emoji = [
        "😀😃😄", "👍🏽 👍🏿", "👩‍👩‍👧‍👦 family", "🏳️‍🌈 flag", "🇺🇸🇯🇵🇩🇪", "❤️ ♥ ❤",
        "🧑‍💻 coding", "👨🏾‍🚀", "1️⃣ #️⃣", "🫠🫨🪿", "I ❤ NY 🗽", "😀" * 20,
    ]
    specials = [
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im_sta", "<<|im_end|>>", "|im_end|",
        "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<start_of_turn>user\nhello<end_of_turn>\n",
        "<start_of_turn>", "<end_of_turn>", "<s>", "</s>", "<s>text</s>", "<unused0>",
        "<unused99>", "[multimodal]", "<start_of_image>", "<end_of_image>", "<0x41>", "<0x0A>",
        "<0xZZ>", "<repo_name>", "<reponame>", "<file_sep>", "<filename>", "<jupyter_code>",
        "<gh_stars>", "<|eot_id|>", "<|end|>", "[INST] hi [/INST]", "<<SYS>>\nsys\n<</SYS>>",
        "<table><tr><td></td></tr></table>", "</s></s><s><s>", "<b><i><u>x</u></i></b>",
        "text<|im_end|>text", " <|im_end|> ", "<|im_end|><|im_end|>", "<|endoftext|>\n\n",
    ]
    runs = [
        "a" * 1000, " " * 100, " " * 33, "=" * 500, "-" * 80, "\n" * 50, "\t" * 40,
        "ab" * 300, "😀" * 100, "中" * 200, "1" * 100, "." * 64, "!" * 17, "_" * 40,
        "a" + " " * 40 + "b", "x" + "\t" * 35 + "y", "▁" * 20, "▁▁hello▁world",
    ]
    misc = [
        "https://www.example.com/path/to/page?query=1&b=two#frag",
        "mailto:someone@example.org", "user@example.com", "C:\\Users\\name\\file.txt",
        "/usr/lib/python3/dist-packages/", "192.168.0.1:8080", "2024-01-15T10:30:00Z",
        "v1.2.3-beta+build.5", "@mention #hashtag $TICKER", "50% of 1/2 is 0.25",
        "\x00\x01\x02\x1f\x7f", "\x04\x06\x13\x14\x16\x1d", "a\x04b\x06c", "!\x04!",
        "\u00a0nbsp\u00a0", "zero\u200bwidth\u200cjoin\u200dx", "\ufeffBOM", "soft\u00adhyphen",
        "line\u2028sep\u2029para", "\u0085next", "\u3000ideographic", "e\u0301 combining",
        "\u0301\u0302\u0303 marks alone", "\ue000\uf8ff private", "\U000f0000\U0010fffd",
        "\ufffe\uffff", "\ufffd replacement", "\U0001fae8\U0001faf8", "\U00010d40\U00011f00",
        "\u2ffc\u2ffd\u31ef", "\U0002ebf0\U0002ee5d", "\U0001f8b2", "\U00010d50x\U00010d69",
        "A\u0300\u0316B\u0489", "\u01c5ungla \u01c8", "\u017f long s \ufb01 ligature",
        "\u212a Kelvin \u212b angstrom",
        "'", "''", "'" * 3, " '", "' ", "'s", "'S", "'ll", "'LL", "'Ve", "x'", "can't won't",
        ".", " .", "a .", "a ,b", "x ?", " !", "?", ",", " ' ' ", "' 're",
        "", " ", "a", "A", "1", "12", "123", "1234", "12345", "123456789012",
        "\u0100", "\u0101", "\u03a9", "\u4e2d", "\U0001f600", "\u0120", "\u010a", "\u0120\u0120",
        "\u00c3\u00a9",
    ]
    # short snippets in the contexts where pre-tokenizers and space prefixes differ
    snippets = ["word", "Word", "WORD", "don't", "123", "3.5", "42nd", "über", "naïve", "中文",
                "日本", "한국", "مرحبا", "नमस्ते", "😀", "👩‍💻", "<|im_end|>", "</s>", "<s>",
                "x_y", "a-b", "(x)", "...", "?!", "'ll", "\u00a0", "\t", "#", "@user", "e\u0301"]
    contexts = ["{}", " {}", "\n{}", "{}\n", "  {}  ", "a{}b", "{} {}", "\t{}\r\n"]
    combos = [c.format(s, s) if c.count("{}") == 2 else c.format(s)
              for s in snippets for c in contexts]
    return prose + code + scripts + emoji + specials + runs + misc + combos


def fuzz(seed: int, count: int) -> list[str]:
    """Random strings mixing ASCII, whitespace, special-token fragments and all of Unicode."""
    rng = random.Random(seed)
    pools = [
        [chr(c) for c in range(0x20, 0x7F)],
        list(" \t\n\r\x0b\x0c\u00a0\u3000\u2028\u0085"),
        list("'sStTmMdDrReEvVlL"),
        ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<bos>", "<eos>",
         "<start_of_turn>", "<end_of_turn>", "<0x41>", "<table>", "[multimodal]", "<unused7>",
         "\n\n", "  ", "\t\t", "\u2581", "\u0120", "<repo_name>", "<mask>"],
        list("0123456789\u0660\u0661\u0662\u0969\u096a\u00bd\u00b2"),
        list("\U0001f600\U0001f44d\U0001f3fd\u200d\u2764\ufe0f\U0001f1fa\U0001f1f8"),
        list("中文日本語한국어العربيةहिन्दी"),
    ]

    def any_code_point() -> str:
        while True:
            plane = rng.choice([0, 0, 0, 1, 1, 2, 3, 14, 15])
            cp = plane * 0x10000 + rng.randrange(0x10000)
            if not 0xD800 <= cp < 0xE000:
                return chr(cp)

    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 40)):
            if rng.random() < 0.15:
                parts.append(any_code_point())
            else:
                parts.append(rng.choice(rng.choice(pools)))
        out.append("".join(parts))
    return out


def sweep_blocks(start: int, stop: int, size: int) -> list[str]:
    """Every code point in [start, stop) in contexts that expose its class, in blocks."""
    blocks = []
    for lo in range(start, stop, size):
        parts = []
        for cp in range(lo, min(stop, lo + size)):
            if 0xD800 <= cp < 0xE000:
                continue
            c = chr(cp)
            parts.append(f"a{c}b {c}1{c}!{c}  {c}'s{c}")
        blocks.append("".join(parts))
    return blocks
