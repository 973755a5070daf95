#!/usr/bin/env python3
"""Copies a GGUF's tokenizer.* keys into a metadata-only GGUF (no tensors) whose architecture is
ARCH (default kimi-linear), for scripts/llama-compare: llama.cpp loads such a file with
vocab_only (it stops before the hyperparameters), so its tokenizer can be run on the vocabulary
moe-convert writes even for kimi-k3 models, an architecture llama.cpp does not have.
    scripts/gguf-vocab-only.py IN.gguf OUT.gguf [ARCH]"""
import struct
import sys

SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # scalar types
STRING, ARRAY = 8, 9


def skip_value(b, at, t):
    """offset just past a value of GGUF type t starting at at"""
    if t == STRING:
        return at + 8 + struct.unpack_from('<Q', b, at)[0]
    if t == ARRAY:
        et, n = struct.unpack_from('<IQ', b, at)
        at += 12
        if et in SIZES:
            return at + SIZES[et] * n
        for _ in range(n):
            at = skip_value(b, at, et)
        return at
    return at + SIZES[t]


def gguf_str(s):
    e = s.encode()
    return struct.pack('<Q', len(e)) + e


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    arch = sys.argv[3] if len(sys.argv) == 4 else 'kimi-linear'
    b = open(sys.argv[1], 'rb').read()
    magic, version, _, n_kv = struct.unpack_from('<4sIQQ', b, 0)
    if magic != b'GGUF' or version < 2:
        sys.exit('%s: not a GGUF v2/v3 file' % sys.argv[1])
    at, kept = 24, []
    for _ in range(n_kv):
        klen = struct.unpack_from('<Q', b, at)[0]
        key = b[at + 8:at + 8 + klen].decode()
        t = struct.unpack_from('<I', b, at + 8 + klen)[0]
        end = skip_value(b, at + 12 + klen, t)
        if key.startswith('tokenizer.'):
            kept.append(b[at:end])
        at = end
    kv = [gguf_str('general.architecture') + struct.pack('<I', STRING) + gguf_str(arch)] + kept
    out = struct.pack('<4sIQQ', b'GGUF', 3, 0, len(kv)) + b''.join(kv)
    out += b'\0' * (-len(out) % 32)
    open(sys.argv[2], 'wb').write(out)


main()
