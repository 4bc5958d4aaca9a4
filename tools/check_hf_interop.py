#!/usr/bin/env python3
"""Load squeeze's Hugging Face exports with the real clients and compare with squeeze's own logits.

    python3 tools/check_hf_interop.py EXPORTS FIXTURES OUT.jsonl
EXPORTS is what test_hf's HfInterop.WritesExportsForTransformersAndPeft wrote (SQUEEZE_INTEROP_DIR): merged/ (an
adapted llama3-tiny exported with LoRA merged), peft/ (the same adapters in PEFT's format over FIXTURES/llama3-tiny),
llama2-bf16/ (llama2-tiny exported in bf16) and squeeze_logits.safetensors. Needs torch, transformers, safetensors
and peft. One JSON line per check; exits 1 when a check fails.
Tolerances, rel = max |a - b| / max |b| over the logits: fp32 1e-5 (the same network in another order of
operations); bf16 1.5e-2 (bf16 rounding, as tests/hf states); weights bit for bit where the format fixes them.
"""
import json
import os
import sys

import torch
import transformers
from safetensors.torch import load_file


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max())


def load(path, dtype):
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


def main():
    exports, fixtures, out_path = sys.argv[1:4]
    commit = os.environ.get("SQUEEZE_COMMIT", "unknown")
    date = os.environ.get("SQUEEZE_DATE", "")
    ours = load_file(os.path.join(exports, "squeeze_logits.safetensors"))
    rows, ok = [], True

    def record(check, client, value, bound, **extra):
        nonlocal ok
        passed = value <= bound
        ok &= passed
        rows.append({"bench": "interop", "case": check, "client": client, "rel_err": value, "bound": bound, "pass": passed,
                     "transformers": transformers.__version__, "torch": torch.__version__, "commit": commit, "date": date, **extra})
        print(f"{'ok  ' if passed else 'FAIL'} {check}: {value:.3g} (bound {bound:g})")

    with torch.no_grad():
        ids3 = ours["llama3_input_ids"]
        merged = load(os.path.join(exports, "merged"), torch.float32)
        record("transformers loads the merged LoRA export (fp32 logits)", "transformers",
               rel(merged(ids3).logits.float(), ours["llama3_lora_logits"]), 1e-5)

        import peft
        base = load(os.path.join(fixtures, "llama3-tiny"), torch.float32)
        adapted = peft.PeftModel.from_pretrained(base, os.path.join(exports, "peft")).eval()
        cfg = adapted.peft_config["default"]
        record("PEFT loads the adapters over the base (fp32 logits)", "peft",
               rel(adapted(ids3).logits.float(), ours["llama3_lora_logits"]), 1e-5,
               peft=peft.__version__, r=cfg.r, lora_alpha=cfg.lora_alpha, target_modules=sorted(cfg.target_modules))
        unloaded = adapted.merge_and_unload()
        worst = max(rel(unloaded.state_dict()[k].float(), v.float()) for k, v in merged.state_dict().items()
                    if k in unloaded.state_dict() and v.abs().max() > 0)
        record("PEFT's merge_and_unload equals squeeze's merged weights", "peft", worst, 1e-6, peft=peft.__version__)

        ids2 = ours["llama2_input_ids"]
        bf = load(os.path.join(exports, "llama2-bf16"), torch.bfloat16)
        record("transformers loads the bf16 export (bf16 logits)", "transformers",
               rel(bf(ids2).logits.float(), ours["llama2_bf16_logits"]), 1.5e-2)
        src = load(os.path.join(fixtures, "llama2-tiny"), torch.float32).to(torch.bfloat16)
        mismatched = [k for k, v in src.state_dict().items() if not torch.equal(bf.state_dict()[k], v)]
        record("bf16 export's weights equal the fixture's rounded to bf16 (count of tensors differing)", "transformers",
               float(len(mismatched)), 0.0, differing=mismatched[:5])

    with open(out_path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
