#!/usr/bin/env python3
"""bench_table --deferred-loss, checked on the CPU: the same rows run twice, each step's loss read back and read only after
the timed steps (TrainerOptions::read_loss off). On the CPU both take the same arithmetic, so every row's losses must be
equal, bit for bit, and each line must say which way it ran (deferred_loss).

  usage: check_deferred.py --bench-table BIN --work DIR
"""
import argparse
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_common import read_jsonl  # noqa: E402

ROWS = "libtorch-autocast-bf16,bf16,zero3-bf16-ckpt,qlora"


def run(bench_table, out, deferred):
    cmd = [bench_table, "--device", "cpu", "--threads", "1", "--preset", "tiny", "--layers", "2", "--batch", "4", "--seq", "48",
           "--steps", "2", "--warmup", "1", "--eval-seqs", "0", "--rows", ROWS, "--out", out] + (["--deferred-loss"] if deferred else [])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return {r["case"]: r for r in read_jsonl([out], "check_deferred.py")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench-table", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    read = run(args.bench_table, os.path.join(args.work, "read.jsonl"), False)
    deferred = run(args.bench_table, os.path.join(args.work, "deferred.jsonl"), True)
    checks, failures = 0, []
    for case in ROWS.split(","):
        a, b = read.get(case), deferred.get(case)
        checks += 1
        if a is None or b is None:
            failures.append(f"{case}: a run wrote no line")
            continue
        checks += 2
        if a.get("deferred_loss") is not False or b.get("deferred_loss") is not True:
            failures.append(f"{case}: deferred_loss {a.get('deferred_loss')} / {b.get('deferred_loss')}, expected false / true")
        if a.get("losses") != b.get("losses") or len(a.get("losses", [])) != 3:
            failures.append(f"{case}: losses {a.get('losses')} read each step, {b.get('losses')} deferred")
    for f in failures:
        print("check_deferred: FAILED", f)
    if failures:
        sys.exit(1)
    print(f"check_deferred: {checks} checks passed")


if __name__ == "__main__":
    main()
