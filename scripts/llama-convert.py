#!/usr/bin/env python3
# llama-convert.py: runs llama.cpp's own Hugging Face converter (convert_hf_to_gguf.py of the
# llama.cpp tree in $LLAMA_SRC) on a checkpoint, as a user of llama.cpp would, so that moe can be
# checked on the files llama.cpp makes. Third-party code: it is read from $LLAMA_SRC (a git-ignored
# folder, see scripts/llama-convert) and never copied into this repository.
#
#   LLAMA_SRC=DIR python3 scripts/llama-convert.py MODEL_DIR [convert_hf_to_gguf.py's arguments]
#
# Two stand-ins let the converter run on an older torch without transformers (Debian's
# python3-torch 1.13): the float8 dtype names torch 1.13 lacks (no tensor of the Kimi checkpoints
# has those types), and a transformers module whose AutoConfig.from_pretrained fails, after which
# the converter reads config.json itself. A checkpoint with no tokenizer files (the golden cases)
# gets its vocabulary written as tokenizer.ggml.model = "none", which llama.cpp loads as "no
# vocabulary"; LLAMA_CONVERT_NO_VOCAB=1 does the same for any checkpoint (the Kimi tokenizer path
# of the converter needs transformers and the checkpoint's tokenization_kimi.py).
#
# With transformers and tiktoken installed, the converter writes the Kimi vocabulary itself
# (KimiLinearModel.set_vocab: tokens, types, merges, specials, eos, chat template), through the
# checkpoint's own tokenization_kimi.py. For a checkpoint that ships tiktoken.model but not that
# code (moe's shipped model), KIMI_TOKENIZER_CODE=FILE names a tokenization_kimi.py from a Kimi
# checkpoint: the converter then reads a copy of the directory (links to its files) with FILE and
# an auto_map for it added to tokenizer_config.json. LLAMA_CONVERT_PRE=NAME answers for the
# converter's pre-tokenizer check when it does not know the vocabulary: that check hashes the ids
# of a fixed text, so it knows Kimi's own 163,584 ranks as "kimi-k2" but no smaller vocabulary
# cut by the same pattern (the shipped model's 4,096 ranks).
import os
import sys
import types

import kimi_tokenizer  # scripts/kimi_tokenizer.py

src = os.environ.get("LLAMA_SRC")
if not src or not os.path.isfile(os.path.join(src, "convert_hf_to_gguf.py")):
    sys.exit("llama-convert.py: LLAMA_SRC must name a llama.cpp tree with convert_hf_to_gguf.py (scripts/llama-convert says how to get one)")
if len(sys.argv) < 2:
    sys.exit("usage: LLAMA_SRC=DIR python3 scripts/llama-convert.py MODEL_DIR [convert_hf_to_gguf.py arguments]")
sys.path.insert(0, os.path.join(src, "gguf-py"))
sys.path.insert(0, src)

import torch  # noqa: E402

for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
    if not hasattr(torch, name):
        setattr(torch, name, torch.uint8)  # a name only: no tensor of these checkpoints has the type

try:
    import transformers  # noqa: F401
    kimi_tokenizer.transformers_compat()
except ImportError:
    shim = types.ModuleType("transformers")

    class AutoConfig:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise OSError("transformers is not installed: the converter reads config.json itself")

    shim.AutoConfig = AutoConfig
    sys.modules["transformers"] = shim

import convert_hf_to_gguf  # noqa: E402

model_dir = sys.argv[1]
code = os.environ.get("KIMI_TOKENIZER_CODE")
if code and not os.path.exists(os.path.join(model_dir, "tokenization_kimi.py")):
    copy = kimi_tokenizer.with_tokenizer_code(model_dir, code)
    print("llama-convert.py: %s read as %s, with %s as its tokenization_kimi.py" % (model_dir, copy, code), file=sys.stderr)
    sys.argv[1] = model_dir = copy

pre = os.environ.get("LLAMA_CONVERT_PRE")
if pre:
    from conversion import base  # noqa: E402

    known_pre = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return known_pre(self, tokenizer)
        except NotImplementedError:
            print("llama-convert.py: pre-tokenizer taken as %r (LLAMA_CONVERT_PRE)" % pre, file=sys.stderr)
            return pre

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre

tokenizer_files = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")
if os.environ.get("LLAMA_CONVERT_NO_VOCAB") or not any(os.path.exists(os.path.join(model_dir, f)) for f in tokenizer_files):
    from conversion import kimi_k3, kimi_linear  # noqa: E402

    def no_vocab(self):
        self.gguf_writer.add_tokenizer_model("none")

    kimi_k3.KimiK3Model.set_vocab = no_vocab
    kimi_linear.KimiLinearModel.set_vocab = no_vocab
    print("llama-convert.py: %s: tokenizer.ggml.model = none (no vocabulary)" % model_dir, file=sys.stderr)

sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
convert_hf_to_gguf.main()
