#!/usr/bin/env python3
"""Prefill and decode benchmark on a synthetic vault (prints a table and ratios).

Layer-major prefill vs token-serial replay at several prompt lengths and chunk sizes,
in one run, each in a fresh process (cold ring), with the ring holding at most a
quarter of the expert bytes; then decode tok/s with spec_depth 0 vs 4.

    cargo build --release
    python3 bench/prefill_bench.py [--vault DIR] [--layers 4] [--lengths 64,512,2048]

Without --vault it synthesises qwen3-30b-a3b cut to --layers into /tmp (bf16).
"""
import argparse
import json
import os
import random
import subprocess
import sys

BIN = os.path.join(os.path.dirname(__file__), "..", "target", "release", "smoe-pipeline")


def run(vault, ids, slots, extra):
    cmd = [BIN, "generate", "--vault", vault, "--prompt-ids", ",".join(map(str, ids)),
           "--ring-slots", str(slots), "--json", "--ignore-eos"] + extra
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd[:4])} ...\n{out.stderr}")
    return json.loads(out.stdout)["stats"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vault")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lengths", default="64,512,2048")
    ap.add_argument("--chunks", default="64,512,2048")
    ap.add_argument("--ring-fraction", type=float, default=0.25)
    ap.add_argument("--decode-tokens", type=int, default=32)
    a = ap.parse_args()
    vault = a.vault or f"/tmp/smoe-bench-q30-l{a.layers}.vault"
    if not os.path.exists(os.path.join(vault, "manifest.json")):
        subprocess.run([BIN, "synth", "--out", vault, "--preset", "qwen3-30b-a3b",
                        "--layers", str(a.layers), "--force"], check=True)
    m = json.load(open(os.path.join(vault, "manifest.json")))
    blob = m["experts"]["layout"]["blob_len"]
    n_experts = sum(len(l["blobs"]) for l in m["experts"]["layers"])
    slots = max(1, int(n_experts * a.ring_fraction))
    vocab = m["model"]["vocab_size"]
    print(f"vault {vault}: {m['model']['num_hidden_layers']} layers, {n_experts} experts x "
          f"{blob / 1e6:.2f} MB = {n_experts * blob / 1e9:.2f} GB; ring {slots} slots "
          f"({slots * blob / 1e9:.2f} GB, {100 * slots / n_experts:.0f}% of expert bytes)")
    print(f"{'prompt':>6} {'mode':>12} {'tok/s':>8} {'ttft s':>8} {'MB/token':>9} {'reads':>6} "
          f"{'hits':>5} {'bytes/Σ|U|':>10} {'speedup':>8}")
    rng = random.Random(7)
    for length in map(int, a.lengths.split(",")):
        ids = [rng.randrange(vocab) for _ in range(length)]
        serial = None
        modes = [("serial", ["--prefill", "serial"])]
        modes += [(f"chunk {c}", ["--chunk-size", str(c)]) for c in map(int, a.chunks.split(","))
                  if c < 2 * length]
        for name, extra in modes:
            s = run(vault, ids, slots, extra + ["--max-tokens", "1"])
            tok_s = s["prefill_tok_s"]
            if serial is None:
                serial = tok_s
            body = max(1, length - 1)
            union_bytes = sum(sum(c) for c in s["prefill_unions"]) * blob
            ratio = s["prefill_bytes_read"] / union_bytes if union_bytes else 0
            print(f"{length:>6} {name:>12} {tok_s:>8.2f} {s['ttft_ms'] / 1e3:>8.2f} "
                  f"{s['prefill_bytes_read'] / body / 1e6:>9.1f} {s['prefill_blob_reads']:>6} "
                  f"{s['prefill_ring_hits']:>5} {ratio:>10.3f} {tok_s / serial:>7.2f}x")
    ids = [rng.randrange(vocab) for _ in range(16)]
    print(f"\ndecode, {a.decode_tokens} tokens after a 16-token prompt:")
    print(f"{'spec_depth':>10} {'tok/s':>8} {'reads':>6} {'bets':>6} {'bets used':>9} {'bet MB':>8}")
    for depth in (0, 4):
        s = run(vault, ids, slots, ["--max-tokens", str(a.decode_tokens), "--spec-depth", str(depth)])
        print(f"{depth:>10} {s['decode_tok_s']:>8.2f} {s['decode_blob_reads']:>6} {s['bets_issued']:>6} "
              f"{s['bets_used']:>9} {s['bet_bytes'] / 1e6:>8.1f}")


if __name__ == "__main__":
    main()
