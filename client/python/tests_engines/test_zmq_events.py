"""kvtierd's ``[events.zmq]`` publisher as a consumer written against vLLM
0.33.0's own types sees it (issue #27): every live and every replayed
payload decodes with ``msgspec.msgpack.Decoder(vllm.distributed.kv_events.
KVEventBatch)`` and re-encodes, with vLLM's encoder, to the same bytes; the
replay socket answers with vLLM's framing (``[topic, seq, payload]`` after
the delimiter, end marker ``["", END, ""]``); a replay older than the kept
batches is contiguous and ends at the newest batch (Dynamo's replay check);
and a subscriber connected across a kvtierd restart learns of it (the
``AllBlocksCleared`` and the holdings) without any new store.

The blocks come from ``kvtier demo --mode dynamo`` (dynamo-mode namespace,
token ids sent along): stored on G3, uploaded to G4, evicted from G3 and
fetched back. Tiers are named as vLLM 0.33.0's own storage tiers name
theirs (issue #43): ``medium`` STORAGE with ``locality`` LOCAL for G3 and
REMOTE for G4, values of vLLM's own ``Medium`` and ``Locality`` enums; with
``media = "dynamo"`` the older DISK / EXTERNAL without a locality.
"""

from __future__ import annotations

import pathlib
import subprocess
import time

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.v1.kv_offload.base import Locality, Medium

import kvtier

TOPIC = b"kv-events"
DECODE = msgspec.msgpack.Decoder(KVEventBatch)
ENCODE = msgspec.msgpack.Encoder()


def demo_ns() -> kvtier.Namespace:
    # tools/src/ops.rs demo_namespace, dynamo mode.
    return kvtier.Namespace(
        "demo/llama-ish",
        kvtier.Layout.with_block_bytes(256 << 10),
        tenant_salt=b"demo-tenant",
        hash_mode="dynamo",
    )


def decode(payload: bytes) -> KVEventBatch:
    """vLLM's decoder; vLLM's encoder gives the same bytes back."""
    batch = DECODE.decode(payload)
    assert ENCODE.encode(batch) == payload, batch
    return batch


class Consumer:
    """A subscriber as Dynamo's listener behaves, with vLLM's types: SUB for
    live batches, DEALER for replays on a sequence gap."""

    def __init__(self, pub: str, replay: str, reconnect_ms: int) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RECONNECT_IVL, reconnect_ms)
        self.sub.setsockopt(zmq.RECONNECT_IVL_MAX, reconnect_ms)
        self.sub.connect(pub)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.RCVTIMEO, 30_000)
        self.dealer.setsockopt(zmq.RECONNECT_IVL, 50)
        self.dealer.connect(replay)
        self.watermark: int | None = None
        self.events: list[tuple[int, object]] = []
        self.replays = 0

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=0)
        self.ctx.term()

    def replay(self, start: int) -> list[tuple[int, KVEventBatch]]:
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            frames = self.dealer.recv_multipart()
            # vLLM 0.33.0's ROUTER sends [id, "", topic, seq, payload]; the
            # DEALER sees what follows the identity.
            assert len(frames) == 4, frames
            assert frames[0] == b""
            if frames[3] == b"":
                assert frames[1] == b"" and frames[2] == ZmqEventPublisher.END_SEQ, frames
                self.replays += 1
                return out
            assert frames[1] == TOPIC
            out.append((int.from_bytes(frames[2], "big"), decode(frames[3])))

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        self.events.extend((seq, e) for e in batch.events)
        self.watermark = seq if self.watermark is None else max(self.watermark, seq)

    def pump_until(self, what: str, done, within_s: float = 90) -> None:
        """Live batches until ``done()``; a gap is filled by a replay that
        must be what Dynamo's listener accepts: contiguous from the first
        number, reaching the batch that showed the gap."""
        deadline = time.monotonic() + within_s
        while not done():
            assert time.monotonic() < deadline, f"timed out: {what}"
            if not self.sub.poll(200):
                continue
            frames = self.sub.recv_multipart()
            assert len(frames) == 3 and frames[0] == TOPIC, frames
            seq = int.from_bytes(frames[1], "big")
            batch = decode(frames[2])
            w = self.watermark
            if w is not None and seq <= w:
                continue
            if w is None or seq > w + 1:
                got = self.replay(0 if w is None else w + 1)
                seqs = [s for s, _ in got]
                assert seqs, "an empty replay"
                assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
                assert seqs[-1] >= seq - 1, (seqs, seq)
                for s, b in got:
                    self.apply(s, b)
                if seq <= self.watermark:
                    continue
            self.apply(seq, batch)

    def stored(self, tier: str, since: int = 0) -> list[BlockStored]:
        return [
            e for i, (_, e) in enumerate(self.events) if i >= since and isinstance(e, BlockStored) and where(e) == tier
        ]


# vLLM 0.33.0's names of a storage tier (its fs tier: LOCAL, obj: REMOTE).
TIERS = {"G3": (Medium.STORAGE, Locality.LOCAL), "G4": (Medium.STORAGE, Locality.REMOTE)}


def where(e) -> str:
    """The tier an event names, read with vLLM's own enums (a name they do
    not know raises ValueError)."""
    got = (Medium(e.medium), Locality(e.locality) if e.locality is not None else None)
    return next(t for t, m in TIERS.items() if m == got)


def config(tmp: pathlib.Path) -> tuple[str, str, str]:
    pub = f"ipc://{tmp}/kv-events.ipc"
    replay = f"ipc://{tmp}/kv-replay.ipc"
    toml = (
        "[events.zmq]\n"
        f'endpoint = "{pub}"\nreplay_endpoint = "{replay}"\ntopic = "{TOPIC.decode()}"\n'
        "dp_rank = 0\nheartbeat_ms = 300\n"
        "[[events.zmq.namespaces]]\n"
        f'id = "{demo_ns().id}"\nsalt = "demo-tenant"\nlora_name = ""\n'
    )
    return toml, pub, replay


def test_vllm_decodes_every_payload_and_a_restart_is_seen_without_a_store(start_daemon, tmp_path):
    toml, pub, replay = config(tmp_path)
    d = start_daemon(config=toml)
    # Reconnects slower than a restart's first batches go out, as a
    # subscriber across the network would.
    c = Consumer(pub, replay, reconnect_ms=1000)
    try:
        # Idle: the heartbeat shows the stream, the replay from 0 brings
        # the start-up's AllBlocksCleared (nothing held yet).
        c.pump_until("the first batch", lambda: c.watermark is not None)
        assert any(isinstance(e, AllBlocksCleared) for _, e in c.events)
        kvtier_bin = pathlib.Path(d.args[0]).with_name("kvtier")
        out = subprocess.run(
            [str(kvtier_bin), "demo", "--mode", "dynamo", "--socket", d.socket],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stdout + out.stderr

        def demo_seen() -> bool:
            removed = [e for _, e in c.events if isinstance(e, BlockRemoved) and where(e) == "G3"]
            # (An upload's G4 store may be skipped when the demo's
            # eviction wins the race with it; the holdings announce G4
            # copies after the restart below.)
            return sum(len(e.block_hashes) for e in c.stored("G3")) >= 8 and sum(len(e.block_hashes) for e in removed) >= 4

        c.pump_until("the demo's stores, uploads, evictions and promotions", demo_seen)
        for e in c.stored("G3") + c.stored("G4"):
            assert e.ownership is None, e
            assert e.block_size == 16 and len(e.token_ids) == 16 * len(e.block_hashes), e
            assert e.lora_id is None and e.lora_name is None, e
            assert e.extra_keys is not None and e.extra_keys[0] == ("dynamo-cache-salt:demo-tenant",), e
        # The demo's chain (offloaded at once): parents in order.
        first = c.stored("G3")[:4]
        assert first[0].parent_block_hash is None
        for a, b in zip(first, first[1:]):
            assert b.parent_block_hash == a.block_hashes[-1]

        # Replays: of kept batches from a number seen, and from 0 (older
        # than every kept batch: the snapshot, numbered up to the newest).
        seen = c.watermark
        kept = c.replay(seen)
        assert [s for s, _ in kept][:1] == [seen]
        snap = c.replay(0)
        seqs = [s for s, _ in snap]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[-1] >= seen, seqs
        events = [e for _, b in snap for e in b.events]
        assert isinstance(events[0], AllBlocksCleared), events[:2]
        assert sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored) and where(e) == "G3") == 4

        # A restart with this subscriber connected and no store after it:
        # it learns of the restart (AllBlocksCleared, then the holdings).
        mark = len(c.events)
        d.restart()

        def restart_seen() -> bool:
            after = [e for _, e in c.events[mark:]]
            cleared = [i for i, e in enumerate(after) if isinstance(e, AllBlocksCleared)]
            if not cleared:
                return False
            held = [e for e in after[cleared[-1] :] if isinstance(e, BlockStored)]
            return all(sum(len(e.block_hashes) for e in held if where(e) == t) >= 4 for t in ("G3", "G4"))

        c.pump_until("the restart's AllBlocksCleared and holdings", restart_seen, within_s=60)
    finally:
        c.close()
