#!/usr/bin/env python3
"""tools/tokenize_hf.py against the tokenizers library it drives and the llm.c shard format (label hf).

A byte-level BPE tokenizer.json (LLaMA 3's kind) is trained here on the fixture text; the shards the script writes are
read back by this file's own reader of the format (header: 256 little-endian int32, magic / version / count, then the
ids) and must hold, document by document, BOS + tokenizers' ids + EOS, split into train and val by byte offset. Then
the refusals: existing shards without --force, ids over --vocab, a directory without tokenizer.json.
    python3 tests/hf/test_tokenize_hf.py TOOLS_DIR TEXT_FILE WORK_DIR
"""
import json
import os
import shutil
import struct
import subprocess
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

tools, text_file, work = sys.argv[1:4]
script = os.path.join(tools, "tokenize_hf.py")
shutil.rmtree(work, ignore_errors=True)
model = os.path.join(work, "model")
os.makedirs(model)

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train([text_file], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
tok.save(os.path.join(model, "tokenizer.json"))
bos, eos = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|end_of_text|>")
with open(os.path.join(model, "config.json"), "w") as f:
    json.dump({"vocab_size": 301, "bos_token_id": bos, "eos_token_id": eos}, f)

failures = []


def expect(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def run(*args):
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True)


def read_shard(path):
    with open(path, "rb") as f:
        data = f.read()
    magic, version, count = struct.unpack_from("<3i", data)
    width = {(20240520, 1): 2, (20240801, 7): 4}[(magic, version)]
    ids = list(struct.unpack_from(f"<{count}{'H' if width == 2 else 'I'}", data, 1024))
    expect(len(data) == 1024 + count * width, f"{path}: {len(data)} bytes for {count} ids of {width} bytes")
    return width, ids


def read_split(out, split):
    ids, widths = [], set()
    for name in sorted(f for f in os.listdir(out) if f.startswith(split + "_")):
        w, part = read_shard(os.path.join(out, name))
        widths.add(w)
        ids += part
    return widths, ids


# What the shards must hold: each line of the text a document, those starting in the last 20% of bytes validation.
with open(text_file, "rb") as f:
    raw = f.read()
want = {"train": [], "val": []}
offset = 0
for line in raw.split(b"\n"):
    text = line.decode("utf-8")
    if text.strip():
        split = "val" if offset >= len(raw) * 0.8 else "train"
        want[split] += [bos] + tok.encode(text, add_special_tokens=False).ids + [eos]
    offset += len(line) + 1

for vocab, width in ((None, 2), ("70000", 4)):  # config.json's 301: uint16; a vocabulary over 65536: uint32
    out = os.path.join(work, f"shards{width}")
    args = ["--model", model, "--out", out, "--split", "line", "--val-fraction", "0.2", "--shard-tokens", "997", text_file]
    r = run(*args, *(["--vocab", vocab] if vocab else []))
    expect(r.returncode == 0, f"uint{8 * width} run failed: {r.stderr}")
    for split in ("train", "val"):
        widths, got = read_split(out, split)
        expect(widths == {width}, f"{split} shards have widths {widths}, want {width}")
        expect(got == want[split], f"uint{8 * width} {split}: {len(got)} ids, want {len(want[split])} (first difference at "
                                   f"{next((i for i, (a, b) in enumerate(zip(got, want[split])) if a != b), min(len(got), len(want[split])))})")
    expect(len(os.listdir(out)) > 2, f"{out}: --shard-tokens 997 should cut several shards, got {os.listdir(out)}")
    expect(not os.path.exists(os.path.join(out, ".tokenize-hf.tmp")), "the temporary directory is left behind")
    if width == 2:
        before = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}
        r = run(*args)
        expect(r.returncode != 0 and "--force" in r.stderr, f"existing shards are not refused: {r.stderr}")
        r = run(*args[:-1], "--vocab", "100", text_file, "--force")
        expect(r.returncode != 0 and "not below the vocabulary (100)" in r.stderr, f"ids over --vocab are not refused: {r.stderr}")
        after = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}
        expect(before == after, "a refused run changed the shards already there")

r = run("--model", work, "--out", os.path.join(work, "none"), text_file)
expect(r.returncode != 0 and "no tokenizer.json" in r.stderr, f"a directory without tokenizer.json is not refused: {r.stderr}")

print(f"{len(want['train'])} training and {len(want['val'])} validation ids checked; {len(failures)} failure(s)")
sys.exit(1 if failures else 0)
