#!/usr/bin/env python3
"""Generate the Unicode class table the tokenizer's pre-tokenizers use and write it into moe.c.

Reads the Unicode Character Database shipped by Debian's `unicode-data` package
(/usr/share/unicode: UnicodeData.txt, Scripts.txt, PropList.txt; UCD 15.0 on Debian 12) and
replaces the region of moe.c between the BEGIN/END GENERATED UNICODE TABLE markers.

Each code point gets one byte: a class in the low 3 bits
  0 other, 1 Lu/Lt, 2 Ll, 3 Lm/Lo, 4 Mn/Mc/Me, 5 Nd/Nl/No
plus flag 8 = Script=Han (the Script property, not Script_Extensions) and 16 = White_Space.
The table is a sorted list of runs (first code point, byte), searched by bisection.

The CJK ideograph ranges assigned after UCD 15.0 (Ext. I in 15.1, Ext. J in 17.0, and the other
Han additions listed in docs/spec/TOKENIZER.md section 3.2) are added as Lo + Han so that the
tables agree with the vendor engine's (Unicode 16.0 or newer) on them.

Usage: scripts/gen-unicode-tables.py [UCD_DIR] [moe.c]
"""
import os
import re
import sys

ucd = sys.argv[1] if len(sys.argv) > 1 else "/usr/share/unicode"
target = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..", "moe.c")

CAT = {"Lu": 1, "Lt": 1, "Ll": 2, "Lm": 3, "Lo": 3, "Mn": 4, "Mc": 4, "Me": 4,
       "Nd": 5, "Nl": 5, "No": 5}
N = 0x110000
cls = bytearray(N)

def lines(name):
    with open(os.path.join(ucd, name), encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                yield [x.strip() for x in line.split(";")]

first = None
for f in lines("UnicodeData.txt"):
    cp, name, gc = int(f[0], 16), f[1], f[2]
    if name.endswith(", First>"):
        first = cp
        continue
    lo = first if name.endswith(", Last>") else cp
    first = None
    for c in range(lo, cp + 1):
        cls[c] = CAT.get(gc, 0)

def ranges(name, prop):
    for f in lines(name):
        if f[1] != prop:
            continue
        a, _, b = f[0].partition("..")
        yield int(a, 16), int(b or a, 16)

for a, b in ranges("Scripts.txt", "Han"):
    for c in range(a, b + 1):
        cls[c] |= 8
for a, b in ranges("PropList.txt", "White_Space"):
    for c in range(a, b + 1):
        cls[c] |= 16
# Han assigned after UCD 15.0 (TOKENIZER.md 3.2): ideographs, so Lo + Han.
for a, b in [(0x2EBF0, 0x2EE5D), (0x323B0, 0x33479), (0x16FF2, 0x16FF6),
             (0x2B73A, 0x2B73F), (0x2CEA2, 0x2CEAD)]:
    for c in range(a, b + 1):
        if cls[c] == 0:
            cls[c] = 3 | 8

runs = []
for c in range(N):
    if not runs or runs[-1][1] != cls[c]:
        runs.append((c, cls[c]))

out = ["/* BEGIN GENERATED UNICODE TABLE (scripts/gen-unicode-tables.py; UCD %s) */" %
       open(os.path.join(ucd, "ReadMe.txt"), encoding="utf-8").read().split("Version ", 1)[1].split()[0].rstrip(".")
       if os.path.exists(os.path.join(ucd, "ReadMe.txt")) else "/* BEGIN GENERATED UNICODE TABLE */"]
out.append("#define MOE_UNI_RUNS %d" % len(runs))
out.append("static const uint32_t moe__uni_run_start[MOE_UNI_RUNS] = {")
for i in range(0, len(runs), 10):
    out.append("    " + ",".join("0x%X" % r[0] for r in runs[i:i + 10]) + ",")
out.append("};")
out.append("static const uint8_t moe__uni_run_class[MOE_UNI_RUNS] = {")
for i in range(0, len(runs), 24):
    out.append("    " + ",".join("%d" % r[1] for r in runs[i:i + 24]) + ",")
out.append("};")
out.append("/* END GENERATED UNICODE TABLE */")
table = "\n".join(out)

src = open(target, encoding="utf-8").read()
pat = re.compile(r"/\* BEGIN GENERATED UNICODE TABLE.*?/\* END GENERATED UNICODE TABLE \*/", re.S)
if not pat.search(src):
    sys.exit("%s: no GENERATED UNICODE TABLE markers" % target)
src = pat.sub(lambda m: table, src, count=1)
open(target, "w", encoding="utf-8").write(src)
print("%d runs written to %s" % (len(runs), target))
