"""Print one line per benchmark case from JSON-lines result files: bench, case, ratio to peer, roofline.
Strategy-table lines (bench "table") also show peak memory beside the planner and validation perplexity (and the
number of GPUs when more than one); FSDP2 peer lines (bench "fsdp2") peak memory per GPU, tokens/s per GPU and MFU; the QLoRA
peer's (bench "hf_qlora") and bench/qlora/compare.py's lines likewise;
llama_gptq lines (examples/llama_gptq) show perplexity, its ratio to the unquantized model and the KL to it (and a run's
wall time by phase, as bench/quant/quantize_7b.sh's lines do); wgmma_rate
lines (bench_wgmma_rate) cycles per instruction; fidelity / finetune lines (bench/fidelity) perplexity over seeds
against fp32's and the share of full fine-tuning's improvement."""
import json
import os
import sys


def num(r, key):
    v = r.get(key)
    return v if isinstance(v, (int, float)) else 0.0


for path in sys.argv[1:]:
    if not os.path.exists(path):  # e.g. an unmatched glob: a run of profiles only writes no JSON lines
        print(f"(no results: {path})")
        continue
    for line in open(path):
        if not line.strip():
            continue
        r = json.loads(line)
        ratio = num(r, "ratio_vs_peer")
        if r.get("bench") == "table":
            world = r.get("world", 1)
            name = f"{r.get('case', '?')} {r.get('preset', '')} B={r.get('batch', '?')}" + (f" x{world} GPUs" if world != 1 else "")
            if r.get("error"):
                print(f"table    {name:<44} {'OOM' if r.get('oom') else 'error'}: {r['error'][:80]}")
                continue
            plan = num(r, "planned_gb")
            plan_txt = f"plan {plan:6.2f} GB ({num(r, 'plan_ratio'):5.3f}x)" if plan else "plan      -         "
            print(f"table    {name:<44} x{ratio:6.2f} vs {r.get('peer', '?'):<22} peak {num(r, 'peak_gb'):6.2f} GB {plan_txt} "
                  f"{num(r, 'tokens_per_s'):8.0f} tok/s  ppl {num(r, 'val_ppl'):7.2f}")
            continue
        if r.get("bench") == "fsdp2":  # bench/fsdp2/fsdp2_llama.py: the PyTorch FSDP2 peer of the ZeRO-3 rows
            name = f"{r.get('case', '?')} {r.get('preset', '')} B={r.get('batch', '?')} x{r.get('world', 1)} GPUs"
            if r.get("error"):
                print(f"fsdp2    {name:<44} {'OOM' if r.get('oom') else 'error'}: {r['error'][:80]}")
                continue
            print(f"fsdp2    {name:<44} peer of {r.get('peer_of', '?'):<24} peak {num(r, 'peak_gb'):6.2f} GB/GPU "
                  f"{num(r, 'tokens_per_s_per_gpu'):8.0f} tok/s/GPU  MFU {num(r, 'mfu'):5.3f}")
            continue
        if r.get("bench") == "hf_qlora":  # bench/qlora/qlora_peer.py: the transformers + bitsandbytes + PEFT peer of qlora
            name = f"{r.get('case', '?')} {r.get('preset', '')} B={r.get('batch', '?')}"
            if r.get("error"):
                print(f"hf_qlora {name:<44} {'OOM' if r.get('oom') else 'error'}: {r['error'][:80]}")
                continue
            print(f"hf_qlora {name:<44} peer of {r.get('peer_of', '?'):<24} peak {num(r, 'peak_gb'):6.2f} GB "
                  f"{num(r, 'tokens_per_s'):8.0f} tok/s  MFU {num(r, 'mfu'):5.3f}")
            continue
        if "bench" not in r and "peer_tokens_per_s" in r:  # bench/qlora/compare.py --jsonl: ours against the peer
            print(f"qlora    {r.get('case', '?')} {r.get('preset', ''):<38} x{num(r, 'speed_vs_peer'):6.2f} tokens/s, "
                  f"x{num(r, 'mem_vs_peer'):5.2f} memory vs transformers + bitsandbytes + PEFT ({num(r, 'peak_gb'):.2f} GB)")
            continue
        if r.get("bench") == "wgmma_rate":  # bench_wgmma_rate: an instruction rate, no peer
            print(f"wgmma_rate {r.get('case', '?'):<42} {num(r, 'cycles_per_wgmma_per_sm'):6.1f} cycles per wgmma per SM  "
                  f"{num(r, 'fma_per_cycle_per_sm'):6.0f} FMA per cycle per SM")
            continue
        if "phases_s" in r:  # llama_gptq's last line, and bench/quant/quantize_7b.sh's: wall time by phase
            phases = " ".join(f"{k} {v:.1f}" for k, v in r["phases_s"].items())
            print(f"{r.get('bench', '?'):<8} {r.get('case', '?'):<44} {num(r, 'time_ms') / 1e3:7.1f} s ({phases})  "
                  f"ppl {num(r, 'ppl_reference'):.4g} -> {num(r, 'ppl_quantized'):.4g}")
            continue
        if r.get("bench") == "llama_gptq" or r.get("example") == "llama_gptq":
            group = r.get("group")
            group_txt = "channel" if group in (-1, "channel") else f"g{group}"
            name = f"{r.get('method', '?')} {r.get('bits', '?')}-bit {group_txt}{' act-order' if r.get('act_order') else ''} {r.get('preset', '')}"
            kl = r.get("kl_to_reference")
            kl_txt = f"KL {kl:9.3e}" if isinstance(kl, (int, float)) else "KL         -"
            print(f"gptq     {name:<44} ppl {num(r, 'ppl'):8.4f} ({num(r, 'ppl_ratio'):6.4f}x reference)  {kl_txt}  "
                  f"quantized in {num(r, 'quantize_s'):6.1f} s")
            continue
        if r.get("bench") == "fidelity-run":  # bench/fidelity's per-run records: their summary lines say it
            continue
        if r.get("bench") == "fidelity":  # bench/fidelity: validation perplexity over seeds against fp32's
            std = r.get("ppl_std")
            print(f"fidelity {r.get('case', '?'):<44} ppl {num(r, 'ppl_mean'):8.4f} ± {std if std is not None else 0:.4f} "
                  f"({num(r, 'ratio_vs_fp32'):6.4f}x fp32, {len(r.get('seeds', []))} seeds, {r.get('tokens')} tokens)"
                  f"{'' if r.get('within_target') else '  outside target'}")
            continue
        if r.get("bench") == "finetune":  # bench/fidelity: fine-tuning methods against full fine-tuning
            print(f"finetune {r.get('case', '?'):<44} ppl {num(r, 'base_ppl'):8.4f} -> {num(r, 'ppl_mean'):8.4f}  "
                  f"{100 * num(r, 'share_of_full'):5.1f}% of full fine-tuning's improvement")
            continue
        roof = num(r, "roofline_fraction") or num(r, "roofline_fraction_same_bytes")  # the latter alone: bench_adamw8_shapes
        case = r.get("case", "?") + (f" [{r['variant']}]" if r.get("variant") else "")  # bench_adamw's 8-bit kernel shapes
        print(f"{r.get('bench', '?'):<8} {case:<44} x{ratio:6.2f} vs {r.get('peer', '?'):<22} "
              f"roof {roof:5.2f}  {num(r, 'time_ms'):9.3f} ms")
