#!/usr/bin/env python3
# llama-k3-compare.py: the arithmetic of scripts/llama-k3-compare, on float32 logit files (rows of
# the vocabulary, as moe-logits --out and llama-compare-run write them). Standard library only.
#   llama-k3-compare.py ids CASE PROMPT                 the prompt's token ids from test/golden/CASE
#   llama-k3-compare.py golden CASE PROMPT FILE...      max |logit - expected| of each file
#   llama-k3-compare.py maxdiff REF FILE...             max |logit - REF's| of each file
#   llama-k3-compare.py kl V REF TEST                   mean KL(REF || TEST) per row in nats, max,
#                                                       and top-1 agreement
import json
import math
import struct
import sys


def floats(path):
    b = open(path, 'rb').read()
    return struct.unpack('<%df' % (len(b) // 4), b)


def prompt(case, name):
    c = json.load(open('test/golden/%s/cases.json' % case))
    return [q for q in c['prompts'] if q['name'] == name][0]


def golden_logits(case, name):
    key = prompt(case, name)['logits_key']
    raw = open('test/golden/%s/logits.safetensors' % case, 'rb').read()
    n = struct.unpack('<Q', raw[:8])[0]
    t = json.loads(raw[8:8 + n])[key]
    s, e = t['data_offsets']
    return struct.unpack('<%df' % ((e - s) // 4), raw[8 + n + s:8 + n + e])


def max_diff(got, want):
    if len(got) != len(want):
        return '(%d values, expected %d)' % (len(got), len(want))
    return '%.3g' % max(abs(a - b) for a, b in zip(got, want))


def log_softmax(row):
    m = max(row)
    s = math.log(sum(math.exp(v - m) for v in row)) + m
    return [v - s for v in row]


def kl(V, ref, test):
    a, b = floats(ref), floats(test)
    rows = min(len(a), len(b)) // V
    total, worst, agree = 0.0, 0.0, 0
    for r in range(rows):
        p, q = log_softmax(a[r * V:(r + 1) * V]), log_softmax(b[r * V:(r + 1) * V])
        k = sum(math.exp(x) * (x - y) for x, y in zip(p, q))
        total, worst = total + k, max(worst, k)
        agree += max(range(V), key=p.__getitem__) == max(range(V), key=q.__getitem__)
    return 'mean KL %.4g nats/token (max %.4g), top-1 agreement %.4f over %d positions' % (total / rows, worst, agree / rows, rows)


def show(path, fn):
    try:
        return fn(floats(path))
    except OSError:
        return '(no output)'


def main(argv):
    if len(argv) == 3 and argv[0] == 'ids':
        print(' '.join(map(str, prompt(argv[1], argv[2])['ids'])))
    elif len(argv) >= 4 and argv[0] == 'golden':
        want = golden_logits(argv[1], argv[2])
        print(' '.join(show(f, lambda got: max_diff(got, want)) for f in argv[3:]))
    elif len(argv) >= 3 and argv[0] == 'maxdiff':
        want = floats(argv[1])
        print(' '.join(show(f, lambda got: max_diff(got, want)) for f in argv[2:]))
    elif len(argv) == 4 and argv[0] == 'kl':
        print(kl(int(argv[1]), argv[2], argv[3]))
    else:
        sys.exit(__doc__ or 'usage: see the comment at the top of scripts/llama-k3-compare.py')


main(sys.argv[1:])
