#!/usr/bin/env python3
# kimi-tokenizer-ids.py: the ids Moonshot's own Kimi tokenizer gives for text files, one line of
# space-separated ids per file, as an oracle for moe's tokenizer. The tokenizer is the checkpoint's
# tokenization_kimi.py run by transformers' AutoTokenizer (its encode takes special names in the
# text as specials: compare with moe-tokenize --special); each file is read as bytes and decoded
# as UTF-8, line ends kept. Needs transformers and tiktoken.
#   [KIMI_TOKENIZER_CODE=tokenization_kimi.py] python3 scripts/kimi-tokenizer-ids.py MODEL_DIR FILE...
# KIMI_TOKENIZER_CODE names the code for a checkpoint that does not ship it (moe's shipped model).
import os
import sys

import kimi_tokenizer  # scripts/kimi_tokenizer.py

if len(sys.argv) < 3:
    sys.exit("usage: [KIMI_TOKENIZER_CODE=FILE] python3 scripts/kimi-tokenizer-ids.py MODEL_DIR FILE...")
model_dir = sys.argv[1]
code = os.environ.get("KIMI_TOKENIZER_CODE")
if code and not os.path.exists(os.path.join(model_dir, "tokenization_kimi.py")):
    model_dir = kimi_tokenizer.with_tokenizer_code(model_dir, code)

from transformers import AutoTokenizer  # noqa: E402

kimi_tokenizer.transformers_compat()
tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
for path in sys.argv[2:]:
    text = open(path, "rb").read().decode("utf-8")
    print(" ".join(map(str, tokenizer.encode(text))))
