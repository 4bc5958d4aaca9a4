#!/usr/bin/env python3
"""The several-GPU scaling table: squeeze's ZeRO-3 rows (bench_table JSON lines, bench "table") beside the PyTorch FSDP2
peer in the same configuration (fsdp2_llama.py JSON lines, bench "fsdp2", matched by peer_of = the bench_table
case, preset, layers, world, batch per GPU and seq), per world size. Where the peer ran in several variants (eager,
compiled blocks, Liger's kernels, both), the fastest is the one compared, and the note names it. At world 1 fully_shard
shards nothing, so an unsharded row of ours (bf16-ckpt, fp8-ckpt, ...) without a peer of its own takes the peer of its
zero3- twin: bf16* rows the bf16 FSDP2 runs, fp8* rows the torchao float8 ones (peer_of zero3-fp8...).

    python3 bench/fsdp2/compare.py gpu-results/scale.jsonl gpu-results/fsdp2.jsonl [--jsonl fsdp2-compare.jsonl]

Columns: peak GB per GPU (the largest over the ranks) and the planner's, tokens/s per GPU, MFU (6N + 12LTd model
FLOPs over the dense bf16 peak of an H100 SXM or an H200, the same in both programs), x1: tokens/s per GPU over the same row's at
world 1 (scaling efficiency), then FSDP2's peak and tokens/s per GPU, speed = ours / FSDP2 tokens/s,
mem = FSDP2's peak / ours (> 1: ours smaller). The last line of each configuration wins (files may be appended to).
--jsonl OUT appends one line per matched pair: {"case", "preset", "world", "tokens_per_s_per_gpu",
"fsdp2_tokens_per_s_per_gpu", "speed_vs_fsdp2", "peak_gb", "fsdp2_peak_gb", "mem_vs_fsdp2", "fsdp2_variant", "fused_loss", "gather_layers_alone",
"commit", "date"}.
Standard library only (and bench/bench_common.py).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_common import append_jsonl, fmt as f, read_jsonl, split_jsonl_option  # noqa: E402


def load(paths):
    ours, peer, variants = {}, {}, {}
    def deferred(r, case):  # rows whose losses were read after the clock (--deferred-loss) pair with peers run so
        return case + "+deferred" if case and r.get("deferred_loss") else case

    for r in read_jsonl(paths, "compare.py"):
        if r.get("bench") == "table":
            ours[(r.get("preset"), deferred(r, r.get("case")), r.get("world", 1), r.get("batch"), r.get("seq"), r.get("layers"))] = r
        elif r.get("bench") == "fsdp2":
            k = (r.get("preset"), deferred(r, r.get("peer_of")), r.get("world", 1), r.get("batch"), r.get("seq"), r.get("layers"))
            variants.setdefault(k, {})[r.get("variant", "eager")] = r  # the last line of each variant wins
    for k, by_variant in variants.items():  # the fastest variant that ran, else any (its error shows)
        ran = [r for r in by_variant.values() if r.get("tokens_per_s_per_gpu")]
        peer[k] = max(ran, key=lambda r: r["tokens_per_s_per_gpu"]) if ran else next(iter(by_variant.values()))
    return ours, peer


def peer_key(peer, k):
    """The FSDP2 entry compared with our row k: its own, else at world 1 the zero3- twin's (see the docstring)."""
    preset, case, world, batch, seq, layers = k
    if k in peer or world != 1 or not case or case.startswith("zero"):
        return k
    twin = (preset, "zero3-" + case, world, batch, seq, layers)
    return twin if twin in peer else k


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    args, jsonl = split_jsonl_option(sys.argv[1:])
    ours, peer = load(args)
    pairs = []
    matched = {k: peer_key(peer, k) for k in ours}
    keys = set(ours) | (set(peer) - set(matched.values()))  # a peer shown beside an unsharded row is not shown again alone
    keys = sorted(keys, key=lambda k: (str(k[0]), str(k[1]), k[3] or 0, k[4] or 0, k[2]))
    print(f"{'preset':<15} {'case':<26} {'world':>5} {'B':>3} {'peak GB':>8} {'plan GB':>8} {'tok/s/GPU':>10} {'MFU':>6} {'x1':>5} |"
          f" {'FSDP2 GB':>8} {'tok/s/GPU':>10} {'MFU':>6} | {'speed':>6} {'mem':>6}  note")
    for k in keys:
        preset, case, world, batch, seq, layers = k
        o, p = ours.get(k), peer.get(matched.get(k, k))
        one = ours.get((preset, case, 1, batch, seq, layers))
        scale = "-"
        if o is not None and one is not None and "tokens_per_s_per_gpu" in o and "tokens_per_s_per_gpu" in one:
            scale = f"{o['tokens_per_s_per_gpu'] / one['tokens_per_s_per_gpu']:.2f}"
        speed = mem = "-"
        if o is not None and p is not None and "tokens_per_s_per_gpu" in o and "tokens_per_s_per_gpu" in p:
            speed = f"{o['tokens_per_s_per_gpu'] / p['tokens_per_s_per_gpu']:.2f}"
        if o is not None and p is not None and o.get("peak_gb") and p.get("peak_gb"):
            mem = f"{p['peak_gb'] / o['peak_gb']:.2f}"
            if o.get("tokens_per_s_per_gpu") and p.get("tokens_per_s_per_gpu"):
                pairs.append({"case": case, "preset": preset, "world": world, "tokens_per_s_per_gpu": o["tokens_per_s_per_gpu"],
                              "fsdp2_tokens_per_s_per_gpu": p["tokens_per_s_per_gpu"],
                              "speed_vs_fsdp2": o["tokens_per_s_per_gpu"] / p["tokens_per_s_per_gpu"], "peak_gb": o["peak_gb"],
                              "fsdp2_peak_gb": p["peak_gb"], "mem_vs_fsdp2": p["peak_gb"] / o["peak_gb"],
                              "fsdp2_variant": p.get("variant", "eager"), "fused_loss": o.get("fused_loss", False), "gather_layers_alone": o.get("gather_layers_alone", False),
                              "commit": o.get("commit"), "date": o.get("date")})
        notes = [f"ours: {o['error']}" for o in [o] if o is not None and o.get("error")]
        notes += [f"FSDP2: {p['error']}" for p in [p] if p is not None and p.get("error")]
        if p is not None and p.get("variant", "eager") != "eager":
            notes.append(f"FSDP2 {p['variant']}")
        print(f"{str(preset):<15} {str(case):<26} {world:>5} {batch or 0:>3} {f(o, 'peak_gb', '.2f'):>8} {f(o, 'planned_gb', '.2f'):>8} "
              f"{f(o, 'tokens_per_s_per_gpu', '.0f'):>10} {f(o, 'mfu', '.3f'):>6} {scale:>5} | {f(p, 'peak_gb', '.2f'):>8} "
              f"{f(p, 'tokens_per_s_per_gpu', '.0f'):>10} {f(p, 'mfu', '.3f'):>6} | {speed:>6} {mem:>6}  {'; '.join(notes)[:120]}")
    if jsonl:
        append_jsonl(jsonl, pairs)
    print("reference (published, not this machine): torchtitan FSDP, Llama3.1-8B on 8x H100: 5,762 tokens/s per GPU")


if __name__ == "__main__":
    main()
