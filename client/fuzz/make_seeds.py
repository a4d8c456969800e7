#!/usr/bin/env python3
"""Writes valid block files into seeds/ for the block_decode fuzzer, built
from docs/FORMAT.md with Python's blake3 (an independent encoder): the
fuzzer's corpus starts past the magic and checksum checks. The seeds are
block format 1 (blake3 checksums), which the decoder still reads; format 2
(XXH3-128) is reached by the fuzzer's own mutations of the version field
and by the proptest suite (client/tests/block_decode_props.rs).
Run: python3 -m pip install blake3 && python3 make_seeds.py"""
import os
import struct

import blake3

os.makedirs("seeds", exist_ok=True)
for i, (payload_len, key_len) in enumerate([(32, 32), (4096, 8), (4128, 64), (8192, 1)]):
    payload = bytes((j * 7 + i) & 0xFF for j in range(payload_len))
    h = bytearray(4096)
    h[0:8] = b"KVTIERB\x01"
    struct.pack_into("<HHI", h, 8, 1, 4096, 0)
    h[16:48] = blake3.blake3(b"ns%d" % i).digest()
    h[48] = key_len
    h[56:56 + key_len] = bytes(range(1, key_len + 1))
    # layers, kv_heads, head_dim, tokens_per_block, dtype u8, layer-contiguous
    struct.pack_into("<IIIIBB", h, 120, 1, 1, payload_len // 32, 16, 6, 1)
    struct.pack_into("<Q", h, 144, payload_len)
    h[152:184] = blake3.blake3(payload).digest()
    struct.pack_into("<Q", h, 184, 1_700_000_000_000 + i)
    h[4064:4096] = blake3.blake3(bytes(h[:4064])).digest()
    pad = (-payload_len) % 4096
    with open("seeds/valid-%d.blk" % i, "wb") as f:
        f.write(bytes(h) + payload + bytes(pad))
