#!/usr/bin/env python3
"""The QLoRA table: bench_table's `qlora` rows (JSON lines, bench "table": the case qlora and its variants qlora-*,
e.g. qlora-hostckpt) beside the transformers + bitsandbytes + PEFT peers in the same configuration (qlora_peer.py JSON
lines, bench "hf_qlora", matched by preset, layers, batch and seq; its peer_of names the qlora row), one GPU. Each
peer configuration is its own line: "peft-bnb" (the plain peer) and "peft-bnb-liger" (the same with Liger's kernels),
named by the peer line's `peer` field.

    python3 bench/qlora/compare.py gpu-results/qlora-table.jsonl gpu-results/qlora-peer.jsonl [--jsonl qlora-compare.jsonl]

Columns: peak GB (both: the CUDA caching allocator's peak of allocated bytes from the model's construction or
loading to the last timed step) and the planner's, tokens/s, MFU (6N + 12LTd model FLOPs over the dense
bf16 peak of an H100 SXM or an H200, the same in both programs), then the peer's peak and tokens/s, speed = ours / peer's tokens/s,
mem = the peer's peak / ours (> 1: ours smaller), target: speed >= 1.5 against peft-bnb, >= 1.2 against peft-bnb-liger,
and mem >= 1. The last line of each configuration wins (files may be appended to). --jsonl OUT appends one line per
matched pair: {"case", "peer", "preset", "world", "batch", "seq", "tokens_per_s", "peer_tokens_per_s", "speed_vs_peer",
"peak_gb", "peer_peak_gb", "mem_vs_peer", "mfu", "peer_mfu", "commit", "date", "device"} (commit, date and device:
bench_table's line). Standard library only (and bench/bench_common.py).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_common import append_jsonl, fmt as f, read_jsonl, split_jsonl_option  # noqa: E402

SPEED_TARGETS = {"peft-bnb": 1.5, "peft-bnb-liger": 1.2}  # ours / the peer's tokens/s
MEM_TARGET = 1.0  # peer's peak / ours


DEFERRED = "+deferred"  # rows whose losses were read after the clock (--deferred-loss) pair with peers run so


def key(r, case_field):
    case = r.get(case_field)
    return (r.get("preset"), case + DEFERRED if case and r.get("deferred_loss") else case, r.get("layers"), r.get("batch"), r.get("seq"))


def is_qlora_row(r):
    case = str(r.get("case"))
    return r.get("bench") == "table" and (case == "qlora" or case.startswith("qlora-")) and r.get("world", 1) == 1


def peer_name(r):
    """Which peer configuration a qlora_peer.py line is (lines from before the field: the plain peer)."""
    return r.get("peer") or "peft-bnb"


def load(paths):
    ours, peer = {}, {}
    for r in read_jsonl(paths, "compare.py"):
        if is_qlora_row(r):
            ours[key(r, "case")] = r
        elif r.get("bench") == "hf_qlora":
            peer[key(r, "peer_of") + (peer_name(r),)] = r
    return ours, peer


def peer_keys(k, peer):
    """The peers' keys for one of our rows: every qlora variant is compared with each peer configuration measured."""
    preset, case, layers, batch, seq = k
    base = "qlora" + (DEFERRED if case and case.endswith(DEFERRED) else "")
    return sorted(pk for pk in peer if pk[:5] == (preset, base, layers, batch, seq)) or [(preset, base, layers, batch, seq, "peft-bnb")]


def pair(o, p):
    """The qlora-compare line of a matched pair, or None when either side has no measurement."""
    if o is None or p is None or not all(r.get("tokens_per_s") and r.get("peak_gb") for r in (o, p)):
        return None
    return {"case": o["case"], "peer": peer_name(p), "deferred_loss": bool(o.get("deferred_loss")), "preset": o["preset"],
            "world": o.get("world", 1), "batch": o.get("batch"),
            "seq": o.get("seq"), "tokens_per_s": o["tokens_per_s"], "peer_tokens_per_s": p["tokens_per_s"],
            "speed_vs_peer": o["tokens_per_s"] / p["tokens_per_s"], "peak_gb": o["peak_gb"], "peer_peak_gb": p["peak_gb"],
            "mem_vs_peer": p["peak_gb"] / o["peak_gb"], "mfu": o.get("mfu"), "peer_mfu": p.get("mfu"), "commit": o.get("commit"),
            "date": o.get("date"), "device": o.get("device")}


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    args, jsonl = split_jsonl_option(sys.argv[1:])
    ours, peer = load(args)
    pairs = []
    matched = {pk for k in ours for pk in peer_keys(k, peer)}
    lines = [(k, pk) for k in ours for pk in peer_keys(k, peer)] + [((pk[0], None) + pk[2:5], pk) for pk in peer if pk not in matched]
    lines.sort(key=lambda line: tuple(str(x) for x in line[0] + line[1][5:]))
    print(f"{'preset':<15} {'case':<14} {'L':>3} {'B':>3} {'T':>5} {'peak GB':>8} {'plan GB':>8} {'tok/s':>8} {'MFU':>6} |"
          f" {'peer':<15} {'GB':>6} {'tok/s':>8} {'MFU':>6} | {'speed':>6} {'mem':>6} {'target':>6}  note")
    for k, pk in lines:
        preset, case, layers, batch, seq = k
        o, p = ours.get(k), peer.get(pk)
        row = pair(o, p)
        speed = mem = target = "-"
        if row is not None:
            pairs.append(row)
            speed, mem = f"{row['speed_vs_peer']:.2f}", f"{row['mem_vs_peer']:.2f}"
            goal = SPEED_TARGETS.get(row["peer"], SPEED_TARGETS["peft-bnb"])
            target = "met" if row["speed_vs_peer"] >= goal and row["mem_vs_peer"] >= MEM_TARGET else "missed"
        notes = [f"{who}: {'OOM' if r.get('oom') else r['error']}" for who, r in (("ours", o), ("peer", p)) if r is not None and r.get("error")]
        if o is None:
            notes.append("no bench_table line")
        if p is None:
            notes.append("no peer line")
        if o is not None and p is not None and o.get("commit") and p.get("commit") and o["commit"] != p["commit"]:
            notes.append(f"commits differ: {o['commit']} / {p['commit']}")
        print(f"{str(preset):<15} {str(case):<14} {layers or 0:>3} {batch or 0:>3} {seq or 0:>5} {f(o, 'peak_gb', '.2f'):>8} "
              f"{f(o, 'planned_gb', '.2f'):>8} {f(o, 'tokens_per_s', '.0f'):>8} {f(o, 'mfu', '.3f'):>6} | {pk[5]:<15} {f(p, 'peak_gb', '.2f'):>6} "
              f"{f(p, 'tokens_per_s', '.0f'):>8} {f(p, 'mfu', '.3f'):>6} | {speed:>6} {mem:>6} {target:>6}  {'; '.join(notes)[:120]}")
    if jsonl:
        append_jsonl(jsonl, pairs)
    print(f"peers: transformers LlamaForCausalLM + bitsandbytes NF4 (double quant, bf16 compute) + PEFT LoRA, gradient "
          f"checkpointing, sdpa (peft-bnb), and the same with Liger's kernels (peft-bnb-liger); target: speed >= "
          f"{', '.join(f'{v} ({k})' for k, v in SPEED_TARGETS.items())} and mem >= {MEM_TARGET}")


if __name__ == "__main__":
    main()
