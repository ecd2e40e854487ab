#!/usr/bin/env python3
"""Side-by-side runs of smoe-pipeline and llama.cpp on the same model (issue 16, item 3).

For every (readahead, format, memory cap, prompt length) condition both engines run one
after the other (their order alternating), each cold — `sync; echo 3 >
/proc/sys/vm/drop_caches` first — inside a cgroup-v1 memory group (`memory.limit_in_bytes`
at the cap, or unlimited), on the same prompt token ids, with a greedy decode of
`--decode` tokens. Measured per run: prefill and decode tok/s (each engine's own timers),
disk bytes read per decoded token (`read_bytes` of `/proc/PID/io` between the first and
the last generated token), the process's total disk reads, its peak RSS and the cgroup's
peak usage (page cache included), and the 1-minute load average before and after.

The block device's readahead (`/sys/block/DEV/queue/read_ahead_kb`) is set for each row
and restored at the end. A machine whose load average is above `--max-load` is refused
unless `--allow-busy`, which records the load in the output instead.

Usage: measure.py --bin smoe-pipeline --llama LLAMA_COMPLETION --tokenizer tokenizer.json
                  --pair bf16 OURS_VAULT GGUF [--pair q4_k_m OURS_VAULT GGUF] --out TXT --csv CSV
"""
import argparse
import csv
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import threading
import time

CGROUP_ROOT = "/sys/fs/cgroup/memory"
MB = 1e6
# Words the prompt is made of: plain ASCII, so both tokenizers see the same text.
WORDS = (
    "the of and to in is was for on that with as by at from it an be this which or are "
    "river mountain engine memory disk token expert layer model stream read write cache "
    "north south light water stone paper signal number river city garden winter summer "
    "a I we they you she he its our their old new small large quick slow early late"
).split()


def read_int(path):
    with open(path) as f:
        return int(f.read().split()[0])


def write(path, value):
    with open(path, "w") as f:
        f.write(str(value))


def proc_read_bytes(pid):
    """`read_bytes` of /proc/PID/io (readable until the process is reaped), or None."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def block_device(path):
    """The /sys/block name of the whole disk holding `path`."""
    st = os.stat(path)
    dev = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if os.path.exists(os.path.join(dev, "partition")):
        dev = os.path.dirname(dev)
    return os.path.basename(dev)


def make_prompt(tok, n, seed):
    """Text of plain words whose encoding is exactly `n` ids, and those ids."""
    rng = random.Random(seed)
    words = []
    while True:
        for _ in range(64):
            w = rng.choice(WORDS)
            ids = tok.encode(" ".join(words + [w]), add_special_tokens=False).ids
            if len(ids) <= n:
                words.append(w)
                break
        else:
            raise SystemExit(f"cannot build a prompt of exactly {n} tokens")
        text = " ".join(words)
        ids = tok.encode(text, add_special_tokens=False).ids
        if len(ids) == n:
            return text, ids


class Cgroup:
    """A cgroup-v1 memory group the measured process enters before it execs."""

    def __init__(self, name):
        self.path = os.path.join(CGROUP_ROOT, name)
        os.makedirs(self.path, exist_ok=True)

    def prepare(self, limit_bytes):
        try:  # uncharge what earlier runs left (no tasks are in the group now)
            write(os.path.join(self.path, "memory.force_empty"), 0)
        except OSError:
            pass
        write(os.path.join(self.path, "memory.limit_in_bytes"), limit_bytes if limit_bytes else -1)
        write(os.path.join(self.path, "memory.max_usage_in_bytes"), 0)
        self.failcnt0 = read_int(os.path.join(self.path, "memory.failcnt"))
        self.oom0 = self.oom_kills()

    def oom_kills(self):
        try:
            with open(os.path.join(self.path, "memory.oom_control")) as f:
                for line in f:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except OSError:
            pass
        return 0

    def enter(self):
        write(os.path.join(self.path, "cgroup.procs"), os.getpid())

    def peak(self):
        return read_int(os.path.join(self.path, "memory.max_usage_in_bytes"))

    def remove(self):
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def hot_resident_bytes(vault):
    """The resident tensors every token reads: all but the embedding table, of which a
    token touches one row."""
    with open(os.path.join(vault, "manifest.json")) as f:
        tensors = json.load(f)["resident"]["tensors"]
    return sum(t["len"] for t in tensors if "embed_tokens" not in t["name"])


def drop_caches():
    os.sync()
    write("/proc/sys/vm/drop_caches", 3)


class Run:
    """One engine process: its stderr lines go to `on_line(run, line)`; stdout is kept."""

    def __init__(self, cmd, cgroup, on_line=None):
        self.cmd = cmd
        self.marks = {}
        self.lines = []
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=cgroup.enter
        )
        self.pid = self.proc.pid
        self.stdout = b""
        out = threading.Thread(target=self._read_stdout)
        err = threading.Thread(target=self._read_stderr, args=(on_line,))
        out.start()
        err.start()
        # Wait for the exit without reaping, so /proc/PID/io still holds the totals.
        os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        self.wall_s = time.monotonic() - self.t0
        self.total_read = proc_read_bytes(self.pid)
        _, status, ru = os.wait4(self.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.peak_rss = ru.ru_maxrss * 1024
        out.join()
        err.join()

    def _read_stdout(self):
        self.stdout = self.proc.stdout.read()

    def _read_stderr(self, on_line):
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.lines.append(line)
            if on_line:
                on_line(self, line)

    def mark(self, name):
        self.marks[name] = (time.monotonic() - self.t0, proc_read_bytes(self.pid))

    def tail(self, n=15):
        return "\n".join(self.lines[-n:])


# Decode modes: greedy, or `random` (temperature 1 over the whole vocabulary, fixed seed):
# a random model's greedy decode cycles through a few tokens, which flatters any cache;
# sampled tokens defeat that locality. Both engines get the same settings (not the same
# tokens: their samplers differ).
RANDOM_SEED = 1234


def run_ours(args, vault, ids, ring_bytes, cgroup, mode):
    cmd = [args.bin, "generate", "--vault", vault, "--prompt-ids", ",".join(map(str, ids)),
           "--max-tokens", str(args.decode), "--ignore-eos", "--json",
           "--max-context", str(max(len(ids) + args.decode + 64, 1024))]
    if mode == "random":
        cmd += ["--temperature", "1", "--top-k", "0", "--top-p", "1", "--seed", str(RANDOM_SEED)]
    if ring_bytes:
        cmd += ["--ring-bytes", str(ring_bytes)]
    r = Run(cmd, cgroup)
    row = {"returncode": r.proc.returncode, "wall_s": r.wall_s, "total_read": r.total_read,
           "peak_rss": r.peak_rss}
    if r.proc.returncode != 0:
        row["error"] = r.tail()
        return row
    out = json.loads(r.stdout.decode().strip().splitlines()[-1])
    s = out["stats"]
    n = max(s["decode_tokens"], 1)
    row.update(
        prefill_tok_s=s["prefill_tok_s"], decode_tok_s=s["decode_tok_s"], decode_tokens=s["decode_tokens"],
        bytes_per_token=(s["process_read_bytes_decode"] or 0) / n,
        engine_bytes_per_token=s["decode_bytes_read"] / n,
        prefill_read=s["process_read_bytes_prefill"], ring_slots=s["ring_slots"],
        ring_bytes=s["ring_slots"] * s["ring_slot_bytes"],
    )
    return row


PERF_PROMPT = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
PERF_EVAL = re.compile(r"(?:print:|^)\s*eval time =\s*([\d.]+) ms /\s*(\d+) runs")
LOG_TOKENS = re.compile(r"(?:^|\s)tokens: (\[.*)$")
LOG_REMAIN = re.compile(r"(?:^|\s)n_remain: (\d+)$")
TOKEN_IDS = re.compile(r"':(\d+)(?=[,\s\]])")


def run_llama(args, gguf, text, ids, cgroup, mode):
    n = args.decode
    sampling = ["--temp", "0"] if mode == "greedy" else [
        "--temp", "1", "--top-k", "0", "--top-p", "1", "--min-p", "0", "--seed", str(RANDOM_SEED)]
    cmd = [args.llama, "-m", gguf, "-p", text, "-n", str(n), *sampling, "--ignore-eos",
           "--no-warmup", "-no-cnv", "--no-display-prompt", "-t", str(args.threads),
           "-c", str(max(len(ids) + n + 64, 1024)), "-b", "512", "-ub", "512", "-v",
           # Weights stay in the file mapping: repacking (q4_K_8x8, AMX) copies them into
           # anonymous memory, which no cap below the model fits, and crashed on Q4_K_M
           # MoE tensors in the build measured (SIGSEGV in the first batch).
           "--no-repack"]
    state = {}

    def on_line(run, line):
        # Lines may carry a timestamp and a level letter before the message.
        if (m := LOG_TOKENS.search(line)) and "prompt_ids" not in state:
            state["prompt_ids"] = [int(x) for x in TOKEN_IDS.findall(m.group(1))]
        elif m := LOG_REMAIN.search(line):
            left = int(m.group(1))
            if left == n - 1:
                run.mark("first")
            if left == 0:
                run.mark("last")
        elif m := PERF_PROMPT.search(line):
            state["prompt"] = (float(m.group(1)), int(m.group(2)))
        elif m := PERF_EVAL.search(line):
            state["eval"] = (float(m.group(1)), int(m.group(2)))

    r = Run(cmd, cgroup, on_line)
    row = {"returncode": r.proc.returncode, "wall_s": r.wall_s, "total_read": r.total_read,
           "peak_rss": r.peak_rss}
    if r.proc.returncode != 0 or "prompt" not in state or "eval" not in state:
        row["error"] = r.tail()
        return row
    (pms, pn), (ems, en) = state["prompt"], state["eval"]
    # The log is written by a thread of its own: a line can arrive after the process has
    # been reaped. The last token's reads then count as the total at exit (nothing is read
    # after it).
    first = r.marks.get("first", (None, None))[1]
    last = r.marks.get("last", (None, None))[1]
    last = r.total_read if last is None else last
    row.update(
        prefill_tok_s=pn / pms * 1e3, decode_tok_s=en / ems * 1e3 if ems else 0.0, decode_tokens=en,
        bytes_per_token=(last - first) / max(en, 1) if first is not None and last is not None else None,
        prefill_read=first,
        same_prompt_ids=state.get("prompt_ids") == list(ids),
    )
    return row


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


COLUMNS = [
    ("readahead_kb", "ra_kb", "d"), ("format", "format", "s"), ("cap_mb", "cap_MB", ".0f"),
    ("prompt", "prompt", "d"), ("decode", "decode", "s"), ("engine", "engine", "s"), ("prefill_tok_s", "prefill_t/s", ".2f"),
    ("decode_tok_s", "decode_t/s", ".3f"), ("bytes_per_token_mb", "MB/dec_tok", ".2f"),
    ("total_read_mb", "read_MB", ".0f"), ("peak_rss_mb", "rss_MB", ".0f"), ("cg_peak_mb", "cg_MB", ".0f"),
    ("ring_mb", "ring_MB", ".0f"), ("wall_s", "wall_s", ".1f"), ("load_before", "load0", ".2f"),
    ("load_after", "load1", ".2f"), ("note", "note", "s"),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="smoe-pipeline binary")
    ap.add_argument("--llama", required=True, help="llama-completion binary")
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json the prompts are encoded with")
    ap.add_argument("--pair", nargs=3, action="append", required=True, metavar=("FORMAT", "VAULT", "GGUF"))
    ap.add_argument("--prompts", default="64,512")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--decode-modes", default="greedy,random",
                    help="greedy and/or random (temperature 1, whole vocabulary, fixed seed)")
    ap.add_argument("--caps", default="none,quarter", help="none and/or quarter (of the GGUF's bytes)")
    ap.add_argument("--readahead", default="128", help="KiB, comma-separated: one row set each")
    ap.add_argument("--ring-slack-mb", type=float, default=300,
                    help="capped runs: ring = cap - resident tensors but the embedding table - this (KV cache, activations, heap)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-load", type=float, default=0.5)
    ap.add_argument("--allow-busy", action="store_true")
    ap.add_argument("--wait-idle", type=float, default=240,
                    help="seconds to wait for the load to fall below --max-load before refusing")
    ap.add_argument("--cgroup", default="smoe-peer")
    ap.add_argument("--note", default="", help="a line for the header (versions, commands)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--csv", required=True)
    args = ap.parse_args()

    load = os.getloadavg()[0]
    waited = 0
    while load > args.max_load and not args.allow_busy and waited < args.wait_idle:
        # The conversions just before leave the 1-minute load high for a minute or two.
        time.sleep(5)
        waited += 5
        load = os.getloadavg()[0]
    if load > args.max_load and not args.allow_busy:
        sys.exit(f"refusing to measure: load average {load:.2f} > {args.max_load} (pass --allow-busy to record it)")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(args.tokenizer)
    prompts = {n: make_prompt(tok, n, seed=n) for n in map(int, args.prompts.split(","))}
    dev = block_device(args.pair[0][2])
    ra_path = f"/sys/block/{dev}/queue/read_ahead_kb"
    ra_orig = read_int(ra_path)
    cg = Cgroup(args.cgroup)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = []
    header = [
        f"# peer comparison {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} on {platform.node()}: "
        f"{os.cpu_count()} CPUs, kernel {platform.release()}, disk {dev} (read_ahead_kb was {ra_orig})",
        f"# load average at start {os.getloadavg()}; max-load {args.max_load}"
        + (" -- BUSY HOST, --allow-busy: figures are not idle-machine figures" if load > args.max_load else ""),
        f"# decode {args.decode} tokens ({args.decode_modes}) after prompts of {args.prompts} ids; cold runs (drop_caches); "
        f"threads {args.threads}; cap = 1/4 of the GGUF file",
    ] + ([f"# {args.note}"] if args.note else [])
    print("\n".join(header), flush=True)
    try:
        order = 0
        for ra in map(int, args.readahead.split(",")):
            write(ra_path, ra)
            for fmt_name, vault, gguf in args.pair:
                model_bytes = os.path.getsize(gguf)
                resident = hot_resident_bytes(vault)
                for cap_name in args.caps.split(","):
                    cap = model_bytes // 4 if cap_name == "quarter" else 0
                    ring = None
                    if cap:
                        ring = max(int(cap - resident - args.ring_slack_mb * MB), 64 << 20)
                    for n, (text, ids), mode in [(n, p, m) for n, p in prompts.items()
                                                  for m in args.decode_modes.split(",")]:
                        engines = ["ours", "llama"] if order % 2 == 0 else ["llama", "ours"]
                        order += 1
                        for engine in engines:
                            drop_caches()
                            cg.prepare(cap)
                            before = os.getloadavg()[0]
                            if engine == "ours":
                                row = run_ours(args, vault, ids, ring, cg, mode)
                            else:
                                row = run_llama(args, gguf, text, ids, cg, mode)
                            oom = cg.oom_kills() - cg.oom0
                            row.update(
                                readahead_kb=ra, format=fmt_name, cap_mb=cap / MB, prompt=n, decode=mode, engine=engine,
                                load_before=before, load_after=os.getloadavg()[0], cg_peak_mb=cg.peak() / MB,
                            )
                            notes = []
                            if oom:
                                notes.append(f"oom_kill={oom}")
                            if row.get("error"):
                                # rc 0 without timings: llama.cpp's asynchronous logger lost
                                # its last lines at exit (seen on a loaded host).
                                notes.append(f"rc={row['returncode']}" if row["returncode"] else "no-timings-in-log")
                                print(f"## {engine} {fmt_name} failed:\n{row['error']}", file=sys.stderr)
                            if engine == "llama" and "same_prompt_ids" in row and not row["same_prompt_ids"]:
                                notes.append("PROMPT IDS DIFFER")
                            row["note"] = " ".join(notes)
                            for k in ("bytes_per_token", "total_read", "peak_rss"):
                                v = row.get(k)
                                row[k + "_mb"] = None if v is None else v / MB
                            row["ring_mb"] = row["ring_bytes"] / MB if row.get("ring_bytes") else None
                            rows.append(row)
                            print(" ".join(f"{k}={fmt(row.get(k), f)}" for k, _, f in COLUMNS), flush=True)
    finally:
        write(ra_path, ra_orig)
        cg.remove()

    with open(args.csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([k for k, _, _ in COLUMNS])
        for r in rows:
            w.writerow(["" if r.get(k) is None else (f"{r[k]:.4f}" if isinstance(r[k], float) else r[k]) for k, _, _ in COLUMNS])
    widths = [max(len(h), 8) for _, h, _ in COLUMNS]
    with open(args.out, "w") as f:
        f.write("\n".join(header) + "\n")
        f.write("# MB/dec_tok: /proc/PID/io read_bytes between the first and the last generated token, per decoded token;\n")
        f.write("# read_MB: the process's total disk reads; rss_MB: peak RSS; cg_MB: the cgroup's peak (page cache included);\n")
        f.write("# ring_MB: our ring (capped runs: cap - resident tensors but the embedding table - slack); load0/load1: 1-min load before/after the run\n")
        f.write("  ".join(h.rjust(wd) for (_, h, _), wd in zip(COLUMNS, widths)) + "\n")
        for r in rows:
            f.write("  ".join(fmt(r.get(k), s).rjust(wd) for (k, _, s), wd in zip(COLUMNS, widths)) + "\n")
    print(f"wrote {args.out} and {args.csv}")


if __name__ == "__main__":
    main()
