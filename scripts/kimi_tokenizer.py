# kimi_tokenizer.py: what scripts/llama-convert.py and scripts/kimi-tokenizer-ids.py need to run
# Moonshot's own Kimi tokenizer (a checkpoint's tokenization_kimi.py, through transformers'
# AutoTokenizer) on a checkpoint that ships only tiktoken.model and tokenizer_config.json.
import atexit
import json
import os
import shutil
import sys
import tempfile


def with_tokenizer_code(model_dir, code):
    """A temporary copy of model_dir (links to its files, removed at exit) with code as its
    tokenization_kimi.py and an auto_map naming it in tokenizer_config.json."""
    copy = tempfile.mkdtemp(prefix="kimi-tokenizer-")
    atexit.register(shutil.rmtree, copy, True)
    for f in os.listdir(model_dir):
        os.symlink(os.path.abspath(os.path.join(model_dir, f)), os.path.join(copy, f))
    shutil.copy(code, os.path.join(copy, "tokenization_kimi.py"))
    path = os.path.join(copy, "tokenizer_config.json")
    config = json.load(open(path))
    config.setdefault("auto_map", {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]})
    os.unlink(path)
    json.dump(config, open(path, "w"), indent=2)
    return copy


def transformers_compat():
    """Kimi's tokenization_kimi.py was written for transformers 4, which had bytes_to_unicode in
    transformers.models.gpt2.tokenization_gpt2 and the module transformers.tokenization_utils;
    transformers 5 moved both. Puts them back where the file looks (nothing when they are there)."""
    try:
        import transformers.models.gpt2.tokenization_gpt2 as gpt2
    except ImportError:
        return
    if not hasattr(gpt2, "bytes_to_unicode"):
        def bytes_to_unicode():
            bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
            cs, n = bs[:], 0
            for b in range(256):
                if b not in bs:
                    bs.append(b)
                    cs.append(256 + n)
                    n += 1
            return dict(zip(bs, map(chr, cs)))
        gpt2.bytes_to_unicode = bytes_to_unicode
    try:
        import transformers.tokenization_utils  # noqa: F401
    except ImportError:
        import transformers.tokenization_python as python_tokenizers
        sys.modules["transformers.tokenization_utils"] = python_tokenizers
