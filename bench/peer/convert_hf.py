#!/usr/bin/env python3
"""llama.cpp's convert_hf_to_gguf.py, run with its BPE pre-tokenizer fingerprint check
answered "qwen2" (what Qwen3 uses): our synthetic checkpoints carry the small demo
tokenizer, whose fingerprint llama.cpp does not know. The vendored file is not edited.

Usage: convert_hf.py LLAMA_CPP_SRC [convert_hf_to_gguf.py arguments...]
"""
import runpy
import sys
from pathlib import Path

src = Path(sys.argv[1]).resolve()
script = src / "convert_hf_to_gguf.py"
sys.argv = [str(script)] + sys.argv[2:]
sys.path.insert(0, str(src))
sys.path.insert(1, str(src / "gguf-py"))

import conversion.base as base  # noqa: E402  (after the path is set)

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
runpy.run_path(str(script), run_name="__main__")
