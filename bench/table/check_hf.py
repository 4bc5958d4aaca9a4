#!/usr/bin/env python3
"""The strategy table started from a trained base (bench_table --hf), checked on the CPU.

Trains a tiny base with llama_train and exports it as a Hugging Face directory, then runs bench_table twice on the
same geometry: from random weights (--preset tiny) and from that base (--hf). Checks that
  - every row of the --hf table starts from the base: its first training loss (the loss of the initial weights on
    the first batch) is at least MIN_GAIN nats below the random row's, and within LOSS_RTOL of the plain-libtorch
    peer's (float weights under bf16 autocast); the quantized rows within QUANT_RTOL (NF4 rounds every weight);
  - every row trained and evaluated (no error, a finite validation perplexity);
  - bad invocations fail with a message naming the problem (--hf with --preset; --hf without --lr).

  usage: check_hf.py --bench-table BIN --llama-train BIN --corpus TEXT --work DIR
"""
import argparse
import math
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_common import read_jsonl  # noqa: E402

MIN_GAIN = 1.0     # nats: the base's first loss below random weights' (ln 256 = 5.5 at the start)
LOSS_RTOL = 0.02   # dense rows against the peer: bf16 weights and activations against float under autocast
QUANT_RTOL = 0.08  # NF4 + DoubleQuant base (qlora) against the float base
ROWS = "libtorch-autocast-bf16,bf16,zero3-offload-fp16-accum4,lora,qlora"
QUANTIZED = {"qlora"}


def run(cmd, expect_ok=True):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if expect_ok and p.returncode != 0:
        sys.exit(f"check_hf: {' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p


def rows(path):
    return {r["case"]: r for r in read_jsonl([path], "check_hf")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench-table", required=True)
    ap.add_argument("--llama-train", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--work", required=True)
    a = ap.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    base = os.path.join(a.work, "base")
    geometry = ["--batch", "4", "--seq", "64", "--corpus", a.corpus]
    run([a.llama_train, "--threads", "1", "--preset", "tiny", "--strategy", "bf16", "--steps", "40", "--lr", "3e-3",
         "--eval-every", "0", "--eval-batches", "1", "--sample", "0", "--export-hf", base, "--batch", "8", "--seq", "64",
         "--corpus", a.corpus])
    table = ["--device", "cpu", "--threads", "1", "--steps", "1", "--warmup", "1", "--eval-seqs", "4", *geometry]
    random_out, hf_out = os.path.join(a.work, "random.jsonl"), os.path.join(a.work, "hf.jsonl")
    run([a.bench_table, *table, "--preset", "tiny", "--rows", "bf16", "--out", random_out])
    run([a.bench_table, *table, "--hf", base, "--lr", "1e-3", "--rows", ROWS, "--out", hf_out])

    checks, failures = 0, []

    def expect(ok, what):
        nonlocal checks
        checks += 1
        if not ok:
            failures.append(what)

    random_first = rows(random_out)["bf16"]["losses"][0]
    hf = rows(hf_out)
    expect(set(hf) == set(ROWS.split(",")), f"rows {sorted(hf)} != {ROWS}")
    peer_first = hf.get("libtorch-autocast-bf16", {}).get("losses", [math.nan])[0]
    for name, r in hf.items():
        expect("error" not in r, f"{name}: {r.get('error')}")
        expect(r.get("hf") == base, f"{name}: hf = {r.get('hf')!r}, not {base!r}")
        first = r.get("losses", [math.nan])[0]
        expect(first < random_first - MIN_GAIN, f"{name}: first loss {first:.4f} not {MIN_GAIN} below random weights' {random_first:.4f}")
        rtol = QUANT_RTOL if name in QUANTIZED else LOSS_RTOL
        expect(abs(first - peer_first) <= rtol * peer_first, f"{name}: first loss {first:.4f} vs the peer's {peer_first:.4f} (rtol {rtol})")
        expect(math.isfinite(r.get("val_ppl", math.nan)), f"{name}: val_ppl {r.get('val_ppl')}")

    both = run([a.bench_table, *table, "--hf", base, "--lr", "1e-3", "--preset", "tiny", "--rows", "bf16",
                "--out", os.path.join(a.work, "bad.jsonl")], expect_ok=False)
    expect(both.returncode != 0 and "leave out --preset" in both.stderr, f"--hf with --preset: rc {both.returncode}, {both.stderr!r}")
    no_lr = run([a.bench_table, *table, "--hf", base, "--rows", "bf16", "--out", os.path.join(a.work, "bad.jsonl")], expect_ok=False)
    expect(no_lr.returncode != 0 and "--lr" in no_lr.stderr + no_lr.stdout, f"--hf without --lr: rc {no_lr.returncode}, {no_lr.stderr!r}")

    if failures:
        sys.exit("check_hf: FAILED\n  " + "\n  ".join(failures))
    print(f"check_hf: {checks} checks passed (random first loss {random_first:.3f}, the base's {peer_first:.3f})")


if __name__ == "__main__":
    main()
