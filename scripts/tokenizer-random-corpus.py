#!/usr/bin/env python3
"""Writes test/tokenizer/random.jsonl: 3000 random strings (JSON, one per line) of 1-24 code
points from a palette chosen to hit the pre-tokenizers' edge cases (docs/spec/TOKENIZER.md 6.3):
letters of every case class, contractions, digits, CR/LF/TAB/VT/FF, NBSP, U+3000, U+2028,
U+001C, combining marks, Han (with the Script=Han oddities), kana, Hangul, other scripts,
titlecase, fullwidth Latin, emoji with VS16 and ZWJ, Nl/No numbers. U+0085 and U+FEFF are left
out because JavaScript's \\s (used by js-tiktoken) disagrees with White_Space on them; U+017F is
left out of the o200k/cl100k comparison for the same reason (js-tiktoken lacks the s fold)."""
import json
import random

PALETTE = list("aAbBsStTrReEvVmMlLdDxyzXYZ'''    019") + [
    "\r", "\n", "\t", "\x0b", "\x0c", "\u00a0", "\u3000", "\u2028", "\x1c", "\u0301", "\u0308",
    "\u4e00", "\u6771", "\u4eac", "\u3005", "\u3006", "\u3007", "\u2e80", "\u2f00", "\uf900",
    "\u30bf", "\u30ef", "\u30fc", "\u3042", "\u3001", "\u3002", "\ud55c", "\uae00", "\u03b1",
    "\u0391", "\u0431", "\u0411", "\u0639", "\u0928", "\u093f", "\u0e2a", "\u05e9", "\u01c5",
    "\uff21", "\uff44", "\U0001F600", "\u2764", "\ufe0f", "\u200d", "\U0001F468", "\u2160",
    "\u00bd", "\u0663", "!", ".", ",", "(", ")", "/", "_", "$", "#", "<", "|", ">", "-", "\"",
    "\u2019", "\u00e9", "\u00df", "\U00020000", "\u1e9e",
]
rng = random.Random(20261129)
with open("test/tokenizer/random.jsonl", "w", encoding="utf-8") as f:
    for _ in range(3000):
        s = "".join(rng.choice(PALETTE) for _ in range(rng.randint(1, 24)))
        f.write(json.dumps(s) + "\n")
