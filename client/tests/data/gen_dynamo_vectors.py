#!/usr/bin/env python3
"""Generates dynamo_vectors.json with Python's `xxhash` package (an
implementation independent of the Rust `xxhash-rust` crate under test).

Dynamo's `dynamo-tokens` chain: salt_hash = xxh3_64(salt, seed 0);
block_hash[i] = xxh3_64(tokens of block i as u32 LE, seed salt_hash);
seq[0] = block_hash[0]; seq[i] = xxh3_64(seq[i-1] LE u64 || block_hash[i] LE u64,
seed salt_hash). A trailing partial block is not hashed.

Run: python3 -m pip install xxhash && python3 gen_dynamo_vectors.py > dynamo_vectors.json
"""
import json
import random
import struct

import xxhash


def chain(salt: bytes, block_tokens: int, tokens):
    seed = xxhash.xxh3_64_intdigest(salt, seed=0)
    out = []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        blk = tokens[start:start + block_tokens]
        bh = xxhash.xxh3_64_intdigest(struct.pack("<%dI" % len(blk), *blk), seed=seed)
        if not out:
            out.append(bh)
        else:
            out.append(xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], bh), seed=seed))
    return seed, out


def main():
    rng = random.Random(20261130)
    cases = []
    for i in range(40):
        block_tokens = rng.choice([1, 4, 16, 32, 64])
        n = rng.randint(0, 6 * block_tokens + block_tokens - 1)
        tokens = [rng.randrange(0, 2**32) if i % 3 == 0 else rng.randrange(0, 200000) for _ in range(n)]
        salt_len = rng.choice([0, 1, 8, 33])
        salt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789-_") for _ in range(salt_len))
        seed, seq = chain(salt.encode(), block_tokens, tokens)
        cases.append({
            "salt": salt,
            "block_tokens": block_tokens,
            "tokens": tokens,
            "salt_hash": "%016x" % seed,
            "seq_hashes": ["%016x" % h for h in seq],
        })
    print(json.dumps({"generator": "gen_dynamo_vectors.py (python xxhash %s)" % xxhash.VERSION,
                      "cases": cases}, indent=0))


if __name__ == "__main__":
    main()
