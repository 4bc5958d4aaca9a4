#!/usr/bin/env python3
"""Where a training step's time goes: every JSON line with a "profile" (bench_table --profile-steps N, or a Python
peer's --profile-steps N: fsdp2/fsdp2_llama.py, qlora/qlora_peer.py) as one row of milliseconds per step by kind.

    python3 bench/profile_table.py gpu-results/table.jsonl gpu-results/fsdp2.jsonl [--top 5] [--jsonl profile.jsonl]
    python3 bench/profile_table.py --check FILE...   (the classifier, and every profile in the files well formed)

Columns, per step: step (the host clock, each step synchronised), host (the step less the time the device was busy
at all: launches, synchronisations and host work nothing overlapped), then the device time of each kind of kernel
(bench_common.KERNEL_KINDS, by name: gemm, attention, dequantize, elementwise, copy, communication). Kinds on several
streams may overlap, so the kinds can add up to more than step - host. --top N lists each row's N longest elementwise
kernels below the table. --jsonl OUT appends one line per row: {"bench": "profile", "case", "preset", "batch", "seq",
"device", "commit", "date", "step_ms", "host_ms", "<kind>_ms"...}. Standard library only.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    KINDS, add_run_arguments, append_jsonl, device_work, kernel_kind, read_jsonl, split_jsonl_option, union_ms)


def row_of(r):
    """The per-step figures of one line's profile."""
    p = r["profile"]
    n = max(1, p["steps"])
    by_kind = dict.fromkeys(KINDS, 0.0)
    for name, _count, ms in p["kernels"]:
        by_kind[kernel_kind(name)] += ms / n
    return {"bench": "profile", "case": r.get("case"), "preset": r.get("preset"), "batch": r.get("batch"), "seq": r.get("seq"),
            "world": r.get("world", 1), "device": r.get("device"), "commit": r.get("commit"), "date": r.get("date"),
            "step_ms": p["wall_ms"] / n, "host_ms": max(0.0, p["wall_ms"] - p["busy_ms"]) / n,
            **{f"{k}_ms": v for k, v in by_kind.items()}}


def check(paths):
    """--check FILE...: the classifier on known kernel names, the union of intervals, and every profile in the files
    well formed (steps > 0, kernels with launches and time, the device busy no longer than the host clock)."""
    n = 0
    for name, kind in (("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"), ("nvjet_hsh_256x128_2cta", "gemm"),
                       ("triton_tem_fused_mm_4", "gemm"), ("qgemm_sm90_kernel<4>", "gemm"), ("gemv_kernel", "gemm"),
                       ("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
                       ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"), ("kDequantizeBlockwise", "dequantize"),
                       ("nf4_dequantize_kernel", "dequantize"), ("ncclDevKernel_AllGather_RING_LL", "communication"),
                       ("Memcpy HtoD (Pinned -> Device)", "copy"), ("Memset (Device)", "copy"),
                       ("rms_norm_forward_kernel", "elementwise"), ("triton_poi_fused_add_mul_0", "elementwise")):
        assert kernel_kind(name) == kind, (name, kernel_kind(name), kind)
        n += 1
    assert union_ms([(0, 2_000_000), (1_000_000, 3_000_000), (5_000_000, 6_000_000)]) == 4.0
    assert union_ms([]) == 0.0
    n += 2

    class Named:  # an event of a torch that names its activity
        def __init__(self, activity):
            self.activity = activity

        def activity_type(self):
            return self.activity

    class Unnamed:  # torch 2.11's events: only whether one is an annotation
        def __init__(self, annotation):
            self.annotation = annotation

        def is_user_annotation(self):
            return self.annotation

    assert device_work(Named("kernel")) and device_work(Named("gpu_memcpy")) and not device_work(Named("gpu_user_annotation"))
    assert device_work(Unnamed(False)) and not device_work(Unnamed(True))
    n += 2
    import argparse
    import contextlib
    import io

    ap = argparse.ArgumentParser()
    add_run_arguments(ap, "out", "batch")
    assert ap.parse_args(["--out", "x", "--profile-steps", "2"]).profile_steps == 2
    for bad in ("-1", "two"):  # the peers' --profile-steps refuses these, naming the value
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
            ap.parse_args(["--out", "x", "--profile-steps", bad])
            raise AssertionError(f"--profile-steps {bad} accepted")
        assert bad in err.getvalue(), err.getvalue()
    n += 3
    for r in read_jsonl(paths, "profile_table.py"):
        p = r.get("profile")
        if not p:
            continue
        assert p["steps"] > 0 and p["kernels"], r.get("case")
        assert p["busy_ms"] <= p["wall_ms"] * 1.001, (r.get("case"), p["busy_ms"], p["wall_ms"])
        assert all(count > 0 and ms >= 0 for _name, count, ms in p["kernels"]), r.get("case")
        row = row_of(r)
        assert abs(row["step_ms"] * p["steps"] - p["wall_ms"]) < 1e-6 and row["host_ms"] >= 0
        n += 4
    print(f"profile_table: {n} checks passed")


def main(argv):
    if argv and argv[0] == "--check":
        return check(argv[1:])
    argv, jsonl = split_jsonl_option(argv)
    top = 0
    if "--top" in argv:
        i = argv.index("--top")
        top = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    if not argv or any(a.startswith("-") for a in argv):
        raise SystemExit(__doc__)
    lines = [r for r in read_jsonl(argv, "profile_table.py") if r.get("profile")]
    rows = [row_of(r) for r in lines]
    print("ms per step")
    print(f"{'case':<28} {'preset':<15} {'B':>3} {'T':>6} {'step':>8} {'host':>7}" + "".join(f" {k:>13}" for k in KINDS))
    for row in rows:
        print(f"{str(row['case'])[:28]:<28} {str(row['preset'])[:15]:<15} {row['batch'] or 0:>3} {row['seq'] or 0:>6} "
              f"{row['step_ms']:>8.1f} {row['host_ms']:>7.1f}" + "".join(f" {row[k + '_ms']:>13.1f}" for k in KINDS))
    if top > 0:
        for r, row in zip(lines, rows):
            n = max(1, r["profile"]["steps"])
            rest = [k for k in r["profile"]["kernels"] if kernel_kind(k[0]) == "elementwise"][:top]
            print(f"{row['case']}: the longest elementwise kernels, ms per step (launches): " +
                  "; ".join(f"{name[:80]} {ms / n:.1f} ({count // n})" for name, count, ms in rest))
    if jsonl:
        append_jsonl(jsonl, rows)


if __name__ == "__main__":
    main(sys.argv[1:])
