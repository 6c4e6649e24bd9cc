"""A deterministic, varied text corpus (> 100 KB) for tokenizer tests and benchmarks.

Everything here is written for pyklei or generated from a fixed seed: short original sentences
in many languages and scripts, code, numbers of every length, whitespace runs, emoji, control
characters and text that looks like special tokens. ``corpus()`` returns the list of texts.
"""
from __future__ import annotations

import random

PROSE = {
    "en": [
        "The river kept its own counsel all winter, and by March it had carried the old bridge halfway to the sea.",
        "She didn't think the numbers would add up, but they'd checked them twice and the ledger was clean.",
        "I'll be there at 7:45 if the train isn't late again; it's been late 3 times this week.",
        "WE'RE CLOSED ON SUNDAYS. You've been warned, they've been warned, and I'M NOT REPEATING IT.",
        "Tokenizers split text into pieces; a model only ever sees the ids of those pieces.",
        "Mr. O'Neil's dog—a scruffy terrier named Biscuit—barked at every passing bicycle (and some cars).",
        "\"Quoted speech,\" he said, 'single quotes too', and «guillemets» and „low quotes“ for good measure.",
    ],
    "fr": [
        "L'été dernier, nous sommes allés à la mer ; l'eau était froide mais claire.",
        "Ça ne fait rien, répondit-elle, on recommencera demain à l'aube.",
        "Où est passée la clé ? Je l'ai posée sur la table, près de la fenêtre.",
    ],
    "de": [
        "Die Straßenbahn fährt heute nicht, weil die Oberleitung beschädigt wurde.",
        "Größere Übungen erfordern mehr Geduld, äußerte der Lehrer ruhig.",
        "Donaudampfschifffahrtsgesellschaftskapitänsmütze ist ein sehr langes Wort.",
    ],
    "es": [
        "¿Dónde está la biblioteca? ¡No lo sé, pregúntale al señor de la esquina!",
        "El niño comió piña y jamón mientras llovía sobre el tejado.",
    ],
    "pt": ["Não há nada como um café quente numa manhã de inverno, disse a avó."],
    "it": ["Perché non vieni con noi? Andiamo al mare dopodomani, se c'è il sole."],
    "pl": ["Zażółć gęślą jaźń — to zdanie zawiera wszystkie polskie litery diakrytyczne."],
    "tr": ["İstanbul'da kış çok soğuk geçti; ılık günler ancak nisanda başladı."],
    "vi": ["Tiếng Việt có nhiều dấu thanh: sắc, huyền, hỏi, ngã, nặng."],
    "ru": [
        "Вчера вечером мы долго гуляли по набережной и говорили о будущем.",
        "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    ],
    "uk": ["Ґанок біля хати був старий, але міцний, і їжак сховався під ним."],
    "el": ["Η θάλασσα ήταν ήρεμη και ο ουρανός καθαρός όλη την ημέρα."],
    "he": ["הספר מונח על השולחן ליד החלון, ליד הכוס הריקה."],
    "ar": ["ذهبت إلى السوق صباحاً واشتريت خبزاً وتمراً وبعض البرتقال."],
    "fa": ["امروز هوا آفتابی است و بچه‌ها در پارک بازی می‌کنند."],
    "hi": ["कल सुबह हम पहाड़ों की ओर निकलेंगे और शाम तक लौट आएंगे।"],
    "bn": ["আমি প্রতিদিন সকালে এক কাপ চা খাই এবং খবরের কাগজ পড়ি।"],
    "ta": ["நாளை காலை நாங்கள் கடற்கரைக்குச் செல்வோம்."],
    "th": ["วันนี้อากาศดีมาก เราจะไปเดินเล่นที่สวนสาธารณะกัน"],
    "zh": [
        "今天天气很好，我们一起去公园散步吧。",
        "这个程序把文本切成小片段，然后把每个片段变成一个数字。",
    ],
    "ja": [
        "昨日は雨が降っていたので、家で本を読んでいました。",
        "カタカナとひらがな、それに漢字が混ざっている文章です。",
    ],
    "ko": ["오늘은 날씨가 맑아서 친구들과 함께 한강에 갔습니다."],
    "ka": ["საქართველოს დედაქალაქი თბილისია."],
    "hy": ["Երեկ մենք գնացինք լեռներ և շատ ուրախ էինք։"],
    "am": ["ዛሬ ጥሩ ቀን ነው።"],
}

CODE = [
    'def fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n'
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "#include <stdio.h>\n\nint main(int argc, char **argv) {\n\tfor (int i = 0; i < argc; ++i) {\n"
    '\t\tprintf("%d: %s\\n", i, argv[i]);\n\t}\n\treturn 0;\n}\n',
    "const sum = (xs) => xs.reduce((acc, x) => acc + x, 0);\nconsole.log(sum([1, 2, 3]) === 6 ? 'ok' : 'bad');\n",
    '{"name": "pyklei", "version": "0.1.0", "tags": ["llm", "cpu"], "nested": {"a": [1, 2.5, -3e10, null, true]}}',
    "<!DOCTYPE html>\n<html lang=\"en\">\n  <body>\n    <p class='x'>Hello &amp; welcome</p>\n  </body>\n</html>\n",
    "SELECT id, name FROM users WHERE age >= 21 AND name LIKE '%son' ORDER BY id DESC LIMIT 10;",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
    "   if x != y:\n        raise ValueError(f\"{x!r} != {y!r}\")  # trailing comment   \n\n\n",
    "$ git commit -m 'fix: off-by-one' && ./run.sh --jobs=2 2>&1 | tee log.txt\n",
    "matrix = [[1, 0, 0],\r\n          [0, 1, 0],\r\n          [0, 0, 1]]\r\n",
]

SPECIAL_LOOKALIKES = [
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>",
    "<s>[INST] What is 2+2? [/INST] 4 </s><s>[INST] And 3+3? [/INST]",
    "<|endoftext|><|endoftext|>text<|endoftext|> <|end_of_text|>",
    "Partial markers: <|im_ <|eot_id| |> <s <\\s> </ s> <|reserved_special_token_12|> <|reserved_special_token_250|>",
    "<unk> <pad> <|fim_prefix|> <repo_name>pyklei<file_sep> <filename>x.py <gh_stars>42 <jupyter_code>",
    "<|im_end|><|im_end|>  <|im_start|>   <s></s>",
]

EMOJI = [
    "😀", "😂", "🥲", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷", "🇯🇵", "❤️", "✨", "🔥", "🧑🏿‍💻", "🐍", "🦀", "🫠",
    "☕", "⌛", "🀄", "🃏", "🎉",
]

EXTRA_CHARS = [
    "\u00a0", "\u2003", "\u3000", "\u200b", "\u200d", "\ufeff", "\u2028", "\u2029", "\u0085", "\u1680",
    "\t", "\v", "\f", "\r", "\x00", "\x04", "\x06", "\x13", "\x14", "\x16", "\x1d", "\x1b", "\x7f",
    "é", "é", "ñ", "Å", "ﬁ", "²", "½", "Ⅻ", "①", "٣", "४", "๓", "〇", "𝟘", "𝐀", "𝔸", "ſ", "K", "İ", "ß",
    "\U000e0041", "\U0001f3fb", "\ue000", "\U0010fffd", "\U00040000", "\U00080000", "\U000f0000",
    "'", "’", "'s", "'S", "'ll", "'LL", "'ſ", "'T", "'Re", "'", "''",
]


def _number(rng: random.Random) -> str:
    k = rng.randint(1, 40)
    digits = "".join(rng.choice("0123456789") for _ in range(k))
    r = rng.random()
    if r < 0.15:
        return "-" + digits
    if r < 0.3:
        return digits + "." + "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 8)))
    if r < 0.4:
        return f"{int(digits):,}"
    if r < 0.45:
        return "0x" + "".join(rng.choice("0123456789abcdef") for _ in range(rng.randint(1, 16)))
    if r < 0.5:
        return f"{rng.random():.3e}"
    return digits


def _space(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.55:
        return " "
    if r < 0.7:
        return " " * rng.randint(2, 9)
    if r < 0.8:
        return rng.choice(["\n", "\n\n", "\n\n\n", "\r\n", "\t", " \n", "\n ", "  \n\t ", "\t\t"])
    if r < 0.9:
        return rng.choice(EXTRA_CHARS[:10])
    return ""


def _mix(rng: random.Random, words: list[str], n: int) -> str:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.55:
            out.append(rng.choice(words))
        elif r < 0.7:
            out.append(_number(rng))
        elif r < 0.78:
            out.append(rng.choice(EMOJI) * rng.randint(1, 3))
        elif r < 0.88:
            out.append(rng.choice(EXTRA_CHARS))
        elif r < 0.93:
            out.append(rng.choice("!?.,;:()[]{}<>\"'`~@#$%^&*-_=+/\\|…—–«»¿¡§¶°±×÷"))
        elif r < 0.97:
            out.append(rng.choice(SPECIAL_LOOKALIKES))
        else:
            out.append("".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(rng.randint(1, 6))))
        out.append(_space(rng))
    return "".join(out)


def corpus(seed: int = 20240607) -> list[str]:
    """The test corpus: a list of texts, > 100 KB of UTF-8 in total, identical on every call."""
    rng = random.Random(seed)
    texts: list[str] = []
    all_sentences = [s for v in PROSE.values() for s in v]
    texts += all_sentences
    texts += CODE
    texts += SPECIAL_LOOKALIKES
    texts += EMOJI
    texts += EXTRA_CHARS
    # Edge cases: empty, whitespace only, lone punctuation, runs of digits of every length.
    texts += ["", " ", "  ", "\n", " \n ", "\t\t", "a", " a", "a ", "   leading", "trailing   ", "\n\nx\n\n"]
    texts += ["7" * k for k in range(1, 41)] + [" " + "1234567890" * k for k in range(1, 6)]
    texts += [" " * k + str(k) for k in range(1, 12)] + ["x" + " " * k + "9" for k in range(1, 6)]
    # Paragraphs of one language, several languages mixed, code mixed with prose.
    words = [w for s in all_sentences for w in s.split()]
    for lang, sents in PROSE.items():
        for _ in range(3):
            texts.append(" ".join(rng.choice(sents) for _ in range(rng.randint(2, 6))))
    for _ in range(260):
        texts.append(_mix(rng, words, rng.randint(5, 120)))
    for _ in range(40):
        parts = [rng.choice(CODE), rng.choice(all_sentences), _number(rng), rng.choice(SPECIAL_LOOKALIKES)]
        rng.shuffle(parts)
        texts.append(_space(rng).join(parts))
    # Numbers of every length in running text.
    texts.append(" ".join(str(rng.randint(0, 10 ** k)) for k in range(1, 60)))
    texts.append(", ".join(f"{rng.uniform(-1e6, 1e6):.{k % 9}f}" for k in range(200)))
    # Random Unicode scalars from the BMP and the astral planes (no surrogates).
    for _ in range(30):
        chars = []
        for _ in range(rng.randint(10, 80)):
            cp = rng.choice([rng.randint(0x20, 0xD7FF), rng.randint(0xE000, 0xFFFD), rng.randint(0x10000, 0x10FFFF)])
            chars.append(chr(cp))
        texts.append("".join(chars))
    # A few long documents.
    for _ in range(6):
        texts.append("\n\n".join(_mix(rng, words, rng.randint(200, 500)) for _ in range(4)))
    return texts


if __name__ == "__main__":
    c = corpus()
    print(len(c), "texts", sum(len(t.encode()) for t in c), "bytes")
