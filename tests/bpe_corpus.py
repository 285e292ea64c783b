#!/usr/bin/env python3
"""Writes varied text for the BPE tests (tests/t_bpe.sh): letters of many
scripts with combining marks, emoji (ZWJ sequences, flags, skin tones),
digits of several scripts, fractions and numerals, runs of every kind of
space, tabs, newlines, contractions, punctuation (comma runs, quotes) and
long runs of one class. Only characters assigned in this Python's Unicode
version are used (the reference's may be newer).

Usage: bpe_corpus.py SEED BYTES OUT [--invalid | --prose]
  --invalid: also splice in bytes that are not UTF-8 (for the round trip)
  --prose:   mostly English-like words, sentences and paragraphs instead
"""
import random
import sys
import unicodedata

WORDS = ("the of and to in is was for on that with as by at from his it an were are which this be "
         "have or has had not but first one their its new after who they two her she been other when "
         "there all time during into school more may years over only year most would world city some "
         "where between later three state such then national used made known under many university "
         "United while part around these both high film well including de game season team").split()
CONTRACTIONS = ["don't", "I'm", "we've", "they'll", "she'd", "it's", "you're", "can't", "IT'S",
                "DON'T", "I'M", "Y'ALL", "rock'n'roll", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d",
                "''s", "'''", "o'clock", "'S", "'T", "'RE", "'LL", "'D", "x's", "'sre", "'ll've"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\v", "\f", "\u00a0", "\u2003", "\u3000",
          "\u2028", "\u2029", "\u0085", "\ufeff", "\u200b", "\u1680", "\u202f", " \t ", "\t\t\n  "]
PUNCT = list(",.;:!?-()[]{}<>\"'/\\@#$%^&*_+=~`|") + [",,,", ",,,,", ",,,,,,", "...", "!!", "?!",
        "--", "—", "–", "«»", "“”", "‘’", "。", "、", "「」", "€", "£", "¥", "©", "®", "°", "±",
        "×", "÷", "§", "¶", "•", "…", "‰", "†", "‡", "\u0301", "\u200d", "\ufe0f"]
DIGITS = ["0123456789", "٠١٢٣٤٥٦٧٨٩", "०१२३४५६७८९", "０１２３４５６７８９", "২৩৪", "๑๒๓"]
NUMS = ["½", "¼", "¾", "²", "³", "¹", "①", "②", "⑩", "Ⅻ", "Ⅳ", "ⅷ", "〇", "𝟘𝟙𝟚", "𐄇", "፩፪"]
EMOJI = ["😀", "😂", "🤖", "👍🏽", "👨\u200d👩\u200d👧\u200d👦", "🏳️\u200d🌈", "🇫🇷", "🇯🇵", "❤️",
         "✨", "🔥", "🎉", "🧑🏿\u200d💻", "☕", "⚡"]
SCRIPTS = [(0x41, 0x7A), (0xC0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x531, 0x587),
           (0x5D0, 0x5EA), (0x620, 0x64A), (0x900, 0x97F), (0x980, 0x9FF), (0xE01, 0xE5B),
           (0x10A0, 0x10FF), (0x1200, 0x137F), (0x3041, 0x30FF), (0x4E00, 0x9FFF),
           (0xAC00, 0xD7A3), (0x1E00, 0x1EFF), (0x0B80, 0x0BFF), (0x1780, 0x17FF),
           (0x10400, 0x1044F), (0x1D400, 0x1D7FF), (0x20000, 0x2A6DF)]


def assigned(c):
    return unicodedata.category(c) not in ("Cn", "Cs")


def script_word(r):
    lo, hi = r.choice(SCRIPTS)
    out = []
    for _ in range(r.randint(1, 12)):
        c = chr(r.randint(lo, hi))
        if assigned(c):
            out.append(c)
    return "".join(out)


def any_char(r):
    while True:
        cp = r.randint(0x20, 0x10FFFF) if r.random() < 0.3 else r.randint(0x20, 0xFFFF)
        c = chr(cp)
        if assigned(c) and unicodedata.category(c) != "Co":
            return c


def piece(r):
    k = r.random()
    if k < 0.30:
        w = r.choice(WORDS)
        return (" " if r.random() < 0.7 else "") + (w.capitalize() if r.random() < 0.2 else w)
    if k < 0.40:
        return r.choice(CONTRACTIONS)
    if k < 0.52:
        return (" " if r.random() < 0.5 else "") + script_word(r)
    if k < 0.62:
        return r.choice(SPACES)
    if k < 0.72:
        return "".join(r.choice(PUNCT) for _ in range(r.randint(1, 4)))
    if k < 0.78:
        d = r.choice(DIGITS)
        return (" " if r.random() < 0.5 else "") + "".join(r.choice(d) for _ in range(r.randint(1, 9)))
    if k < 0.81:
        return r.choice(NUMS)
    if k < 0.86:
        return (" " if r.random() < 0.5 else "") + "".join(r.choice(EMOJI) for _ in range(r.randint(1, 3)))
    if k < 0.94:
        return "".join(any_char(r) for _ in range(r.randint(1, 6)))
    if k < 0.945:  # long runs of one class: the long-piece merge path
        kind = r.randrange(5)
        n = r.randint(49, 160)
        if kind == 0:
            return " " + "".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))
        if kind == 1:
            return "".join(r.choice("0123456789") for _ in range(n))
        if kind == 2:
            return "".join(r.choice(",.-!?*=") for _ in range(n))
        if kind == 3:
            return "".join(r.choice(" \t\n") for _ in range(n)) + "x"
        return "ab" * n
    return "\n"


def prose(r):
    k = r.random()
    if k < 0.80:
        w = WORDS[min(int(r.paretovariate(1.0)) - 1, len(WORDS) - 1)] if r.random() < 0.6 else r.choice(WORDS)
        return " " + (w.capitalize() if r.random() < 0.08 else w)
    if k < 0.85:
        return " " + r.choice(CONTRACTIONS[:13])
    if k < 0.93:
        return r.choice([",", ".", ".", ";", ":", "!", "?", " (", ")", " \"", "\""])
    if k < 0.96:
        return " " + str(r.randint(0, 10 ** r.randint(1, 6)))
    if k < 0.99:
        return r.choice(["\n", "\n\n", ".\n\n", "\n  "])
    return piece(r)


def main():
    seed, size, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    invalid = "--invalid" in sys.argv[4:]
    gen = prose if "--prose" in sys.argv[4:] else piece
    r = random.Random(seed)
    parts, n = [], 0
    while n < size:
        if invalid and r.random() < 0.05:
            b = bytes(r.choice([0x80, 0xBF, 0xC0, 0xC1, 0xE2, 0xF0, 0xF5, 0xFF, 0xED]) for _ in range(r.randint(1, 3)))
            b += r.choice([b"", b"\x80", b"\xa0\x80", b" ", b"a", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"])
        else:
            b = gen(r).encode("utf-8")
        parts.append(b)
        n += len(b)
    with open(out, "wb") as f:
        f.write(b"".join(parts))


if __name__ == "__main__":
    main()
