#!/usr/bin/env python3
"""Builds the training data of the small model we ship (scripts/train.py), from Debian packages:
  bible-kjv (the King James Bible, public domain), dict-gcide (GNU Collaborative International
  Dictionary of English, GPL), fortunes (fortune-mod's fortunes, BSD/various free licenses).

Steps, all here on the CPU machine, output in OUT_DIR (default build/train):
  1. corpus.txt: the three texts, cleaned (verse references dropped, dictionary layout
     whitespace collapsed, fortunes split on their '%' lines), one document per paragraph;
  2. tiktoken.model: a byte-level BPE vocabulary trained on the corpus (256 single bytes, then
     merges in the order learned; the rank of a token is its id), --vocab entries in all;
  3. tokenizer_config.json: K3's special tokens after the base ranks (docs/spec/TOKENIZER.md 1.3);
  4. train.bin / valid.bin: the corpus tokenized by our own C tokenizer (build/moe-tokenize,
     Kimi pre-tokenizer), uint16 little-endian, documents joined by [EOS]; valid is 1% held out.

Usage: scripts/train-data.py [--vocab 4096] [--gcide-mb 10] [OUT_DIR]   (needs `make` first)"""
import argparse
import base64
import collections
import gzip
import os
import random
import re
import subprocess
import sys

ap = argparse.ArgumentParser()
ap.add_argument("out", nargs="?", default="build/train")
ap.add_argument("--vocab", type=int, default=4096)
ap.add_argument("--gcide-mb", type=float, default=10.0)
args = ap.parse_args()
os.makedirs(args.out, exist_ok=True)
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

# ---- 1. corpus ----
docs = []
bible = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True).stdout
chapter = []
last = None
for line in bible.splitlines():
    m = re.match(r"^(\w+?)(\d+):(\d+) (.*)$", line)
    if not m:
        continue
    key = (m.group(1), m.group(2))
    if key != last and chapter:
        docs.append(" ".join(chapter))
        chapter = []
    last = key
    chapter.append(m.group(4).strip())
if chapter:
    docs.append(" ".join(chapter))
n_bible = len(docs)

gc = gzip.open("/usr/share/dictd/gcide.dict.dz").read().decode("utf-8", "replace")
budget = int(args.gcide_mb * 1e6)
entries = re.split(r"\n(?=\S)", gc)
random.Random(1).shuffle(entries)
size = 0
for e in entries:
    e = re.sub(r"\[1913 Webster\]|\[PJC\]|\[WordNet 1\.5\]", "", e)
    e = re.sub(r"[ \t]+", " ", e)
    e = re.sub(r"\n ?", "\n", e).strip()
    if len(e) < 40:
        continue
    docs.append(e)
    size += len(e)
    if size > budget:
        break
n_gcide = len(docs) - n_bible

fdir = "/usr/share/games/fortunes"
for name in sorted(os.listdir(fdir)):
    p = os.path.join(fdir, name)
    if "." in name or not os.path.isfile(p) or os.path.islink(p):
        continue
    for f in open(p, encoding="utf-8", errors="replace").read().split("\n%\n"):
        f = f.strip()
        if len(f) > 20:
            docs.append(f)
n_fortunes = len(docs) - n_bible - n_gcide
random.Random(2).shuffle(docs)
corpus = "\n\n".join(docs)
open(os.path.join(args.out, "corpus.txt"), "w", encoding="utf-8").write(corpus)
print(f"corpus: {len(corpus) / 1e6:.1f} MB: {n_bible} Bible chapters, {n_gcide} GCIDE entries, {n_fortunes} fortunes")

# ---- 2. byte-level BPE (incremental pair counts over the distinct pre-tokenized words) ----
words = collections.Counter(re.findall(r" ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+", corpus[:8_000_000]))
seqs = [[bytes([b]) for b in w.encode("utf-8")] for w in words]
freqs = list(words.values())
pairs = collections.Counter()
where = collections.defaultdict(set)
for i, (s, f) in enumerate(zip(seqs, freqs)):
    for a, b in zip(s, s[1:]):
        pairs[a, b] += f
        where[a, b].add(i)
vocab = [bytes([b]) for b in range(256)]
known = set(vocab)
while len(vocab) < args.vocab and pairs:
    (a, b), c = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
    if c < 2:
        break
    new = a + b
    for i in list(where[a, b]):
        s, f = seqs[i], freqs[i]
        for x, y in zip(s, s[1:]):
            pairs[x, y] -= f
            where[x, y].discard(i)
        j, out = 0, []
        while j < len(s):
            if j + 1 < len(s) and s[j] == a and s[j + 1] == b:
                out.append(new)
                j += 2
            else:
                out.append(s[j])
                j += 1
        seqs[i] = out
        for x, y in zip(out, out[1:]):
            pairs[x, y] += f
            where[x, y].add(i)
    for k in [k for k, v in pairs.items() if v <= 0]:
        del pairs[k]
        where.pop(k, None)
    if new not in known:
        known.add(new)
        vocab.append(new)
with open(os.path.join(args.out, "tiktoken.model"), "w") as f:
    for rank, tok in enumerate(vocab):
        f.write(f"{base64.b64encode(tok).decode()} {rank}\n")
n_base = len(vocab)
print(f"vocabulary: {n_base} tokens")

# ---- 3. K3 special tokens (docs/spec/TOKENIZER.md 1.3), at their offsets from the base ----
special = {0: ("[BOS]", True), 1: ("[EOS]", False), 2: ("<|end_of_msg|>", True), 3: ("<|open|>", False),
           4: ("<|close|>", False), 5: ("<|sep|>", False), 18: ("<|media_begin|>", True),
           19: ("<|media_content|>", True), 20: ("<|media_end|>", True), 21: ("<|media_pad|>", True),
           254: ("[UNK]", False), 255: ("[PAD]", False)}
import json
cfg = {"added_tokens_decoder": {str(n_base + k): {"content": v[0], "special": v[1]} for k, v in sorted(special.items())},
       "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
       "tokenizer_class": "TikTokenTokenizer", "model_max_length": 1048576}
json.dump(cfg, open(os.path.join(args.out, "tokenizer_config.json"), "w"), indent=2)

# ---- 4. tokenize with our own tokenizer; documents joined by [EOS] ----
exe = os.path.join(root, "build", "moe-tokenize")
eos = n_base + 1
rng = random.Random(3)
import array
train, valid = array.array("H"), array.array("H")
batch, held = [], []
for d in docs:
    (held if rng.random() < 0.01 else batch).append(d)
for dest, group in ((train, batch), (valid, held)):
    # one call per group: documents separated by a marker we split on afterwards would change
    # the pre-tokenization at the edges, so each chunk of documents is encoded with [EOS] text
    # allowed as a special between them
    text = "[EOS]".join(group) + "[EOS]"
    r = subprocess.run([exe, "--ranks", os.path.join(args.out, "tiktoken.model"), "--pre", "kimi", "--config",
                        os.path.join(args.out, "tokenizer_config.json"), "--special"], input=text.encode("utf-8"),
                       capture_output=True, check=True)
    dest.extend(int(x) for x in r.stdout.split())
for name, a in (("train.bin", train), ("valid.bin", valid)):
    assert max(a) < n_base + 256
    with open(os.path.join(args.out, name), "wb") as f:
        a.tofile(f)
print(f"tokens: train {len(train)}, valid {len(valid)}; vocab_size {n_base + 256}")
