#!/usr/bin/env python3
"""Text files to llm.c-format token shards with any Hugging Face tokenizer (tokenizer.json: LLaMA 3's byte-level BPE,
GPT-2, Mistral's, ...), through the `tokenizers` library. squeeze-tokenize does the same for SentencePiece
tokenizer.model files in C++; both write shards that llama_train --data and io::TokenDataset read.

    python3 tools/tokenize_hf.py --model DIR --out OUT FILE... [--split file|paragraph|line] [--val-fraction F]
                                 [--shard-tokens N] [--vocab N] [--no-bos] [--no-eos] [--force]

DIR is a Hugging Face model directory holding tokenizer.json (or that file itself). Every document (a file, a
blank-line-separated paragraph or a line) becomes BOS, its ids, EOS (the ids of config.json's bos_token_id /
eos_token_id, else tokenizer_config.json's bos_token / eos_token), as LLaMA pre-training concatenates them. The
documents starting in the last --val-fraction of the input's bytes are the validation split. Shards:
OUT/train_000000.bin, ... and OUT/val_000000.bin, ...: a header of 256 little-endian int32 (magic, version, token
count), then the ids, uint16 (magic 20240520, version 1) when the vocabulary fits, else uint32 (20240801, version 7).
Everything is written into OUT/.tokenize-hf.tmp and moved into place at the end; existing shards in OUT are refused
unless --force.
"""
import argparse
import array
import json
import os
import re
import shutil
import sys
import time

HEADER_INTS = 256
KINDS = {2: (20240520, 1, "H"), 4: (20240801, 7, "I")}  # id bytes -> (magic, version, array type code)


def fail(message):
    print(f"tokenize_hf: {message}", file=sys.stderr)
    sys.exit(2)


def tokenizer_file(model):
    if os.path.isfile(model):
        return model
    path = os.path.join(model, "tokenizer.json")
    if not os.path.isfile(path):
        hint = " (it has tokenizer.model: use squeeze-tokenize)" if os.path.isfile(os.path.join(model, "tokenizer.model")) else ""
        fail(f"--model {model} has no tokenizer.json{hint}")
    return path


def read_json(path):
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def special_ids(model_dir, tok):
    """BOS and EOS ids: config.json's, else tokenizer_config.json's tokens looked up in the vocabulary."""
    config = read_json(os.path.join(model_dir, "config.json"))
    tconfig = read_json(os.path.join(model_dir, "tokenizer_config.json"))

    def lookup(key):
        if isinstance(config.get(f"{key}_id"), int):
            return config[f"{key}_id"]
        token = tconfig.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        return tok.token_to_id(token) if isinstance(token, str) else None

    return lookup("bos_token"), lookup("eos_token")


def documents(files, split):
    """(text, byte offset of its start in the concatenated input) per non-empty document, in input order."""
    offset = 0
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            fail(f"{path} is not UTF-8 text (byte {e.start})")
        if split == "file":
            pieces = [(text, 0)]
        else:
            pattern = r"\n[ \t]*\n" if split == "paragraph" else r"\n"
            pieces, start = [], 0
            for m in re.finditer(pattern, text):
                pieces.append((text[start:m.start()], start))
                start = m.end()
            pieces.append((text[start:], start))
        for piece, start in pieces:
            if piece.strip():
                yield piece, offset + len(text[:start].encode("utf-8"))
        offset += len(data)


class ShardWriter:
    def __init__(self, directory, split, width, shard_tokens):
        self.directory, self.split, self.width, self.shard_tokens = directory, split, width, shard_tokens
        self.index, self.buf, self.files = 0, array.array(KINDS[width][2]), []

    def add(self, ids):
        for i in ids:
            self.buf.append(i)
            if len(self.buf) == self.shard_tokens:
                self.flush()

    def flush(self):
        if not self.buf:
            return
        magic, version, _ = KINDS[self.width]
        header = array.array("i", [0] * HEADER_INTS)
        header[0], header[1], header[2] = magic, version, len(self.buf)
        path = os.path.join(self.directory, f"{self.split}_{self.index:06d}.bin")
        with open(path, "wb") as f:
            f.write(header.tobytes())  # little-endian: main() runs on little-endian machines only
            f.write(self.buf.tobytes())
        self.files.append(path)
        self.index, self.buf = self.index + 1, array.array(KINDS[self.width][2])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="text files, read in this order")
    ap.add_argument("--model", required=True, help="Hugging Face model directory holding tokenizer.json, or the file")
    ap.add_argument("--out", required=True, help="directory for the shards (created if missing)")
    ap.add_argument("--split", choices=["file", "paragraph", "line"], default="file", help="what one document is")
    ap.add_argument("--val-fraction", type=float, default=0.05, help="validation: the documents starting in this last fraction of the input bytes")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard file")
    ap.add_argument("--vocab", type=int, default=0, help="the model's vocabulary size (default: config.json's vocab_size, else the tokenizer's)")
    ap.add_argument("--no-bos", dest="bos", action="store_false", help="no BOS before each document")
    ap.add_argument("--no-eos", dest="eos", action="store_false", help="no EOS after each document")
    ap.add_argument("--force", action="store_true", help="replace the shards already in --out")
    a = ap.parse_args()
    if sys.byteorder != "little":
        fail("token shards store little-endian ids; this machine is big-endian")
    if not 0 <= a.val_fraction < 1:
        fail(f"--val-fraction must be in [0, 1), got {a.val_fraction}")
    if not 0 < a.shard_tokens <= 0x7FFFFFFF:
        fail(f"--shard-tokens must be in [1, 2^31), got {a.shard_tokens}")
    for path in a.files:
        if not os.path.isfile(path):
            fail(f"input {path} does not exist")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        fail("needs the tokenizers package (pip install tokenizers)")
    model_dir = a.model if os.path.isdir(a.model) else os.path.dirname(a.model)
    tok = Tokenizer.from_file(tokenizer_file(a.model))
    vocab = a.vocab or read_json(os.path.join(model_dir, "config.json")).get("vocab_size") or tok.get_vocab_size(with_added_tokens=True)
    bos, eos = special_ids(model_dir, tok)
    if a.bos and bos is None:
        fail(f"--model {a.model}: no BOS token id in config.json or tokenizer_config.json (pass --no-bos)")
    if a.eos and eos is None:
        fail(f"--model {a.model}: no EOS token id in config.json or tokenizer_config.json (pass --no-eos)")
    width = 2 if vocab <= 65536 else 4

    existing = [f for f in os.listdir(a.out) if re.fullmatch(r"(train|val)_\d{6}\.bin", f)] if os.path.isdir(a.out) else []
    if existing and not a.force:
        fail(f"--out {a.out} already holds shards ({sorted(existing)[0]}, ...): pass --force to replace them")
    tmp = os.path.join(a.out, ".tokenize-hf.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    total_bytes = sum(os.path.getsize(p) for p in a.files)
    val_start = total_bytes * (1 - a.val_fraction)
    writers = {s: ShardWriter(tmp, s, width, a.shard_tokens) for s in ("train", "val")}
    counts = {"train": 0, "val": 0}
    t0, last = time.time(), time.time()
    for text, start in documents(a.files, a.split):
        ids = tok.encode(text, add_special_tokens=False).ids
        ids = ([bos] if a.bos else []) + ids + ([eos] if a.eos else [])
        bad = next((i for i in ids if i >= vocab), None)
        if bad is not None:
            shutil.rmtree(tmp)
            fail(f"token id {bad} is not below the vocabulary ({vocab}): --vocab or config.json's vocab_size disagrees with the tokenizer")
        split = "val" if a.val_fraction > 0 and start >= val_start else "train"
        writers[split].add(ids)
        counts[split] += len(ids)
        if time.time() - last > 5:
            print(f"  {start / 1e6:.0f} of {total_bytes / 1e6:.0f} MB, {sum(counts.values())} tokens", file=sys.stderr)
            last = time.time()
    for w in writers.values():
        w.flush()
    if counts["train"] == 0:
        shutil.rmtree(tmp)
        fail("no training tokens: the input is empty or entirely in the validation split")
    for f in existing:
        os.remove(os.path.join(a.out, f))
    for w in writers.values():
        for path in w.files:
            os.replace(path, os.path.join(a.out, os.path.basename(path)))
    os.rmdir(tmp)
    print(f"tokenize_hf: {counts['train']} training and {counts['val']} validation tokens (uint{8 * width}, vocabulary {vocab}) "
          f"in {len(writers['train'].files)} + {len(writers['val'].files)} shards under {a.out}, {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
