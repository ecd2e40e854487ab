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

echo "== golden fixtures: recompute with transformers and compare"
python3 tests/fixtures/make_fixtures.py --check

echo "== format and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings

echo "== tests"
cargo test --workspace
