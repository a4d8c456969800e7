//! End-to-end, through a real `kvtierd` (issue 27): a chain larger than
//! G3 keeps a reachable head and strands nothing; pins past the budget are
//! answered `StoredUnpinned` on the wire.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kvtier_client::{
    BlockKey, Client, ClientConfig, Hints, KvLayout, Namespace, NsHandle, OffloadOutcome,
};
use std::time::{Duration, Instant};
use support::Daemon;

const BLOCK: usize = 1 << 20;

fn ns() -> Namespace {
    Namespace::new(
        "e2e-evict",
        KvLayout::with_block_bytes(BLOCK as u64).unwrap(),
        "",
        "t",
    )
    .unwrap()
}

fn client(d: &Daemon) -> Client {
    let mut c = ClientConfig::new(&d.socket);
    c.region_bytes = 16 << 20;
    c.timeout_ms = 30_000;
    Client::with_config(c)
}

/// (lookup prefix, how many of `keys` G3 holds, whether those are the
/// chain's head: `keys[..held]` exactly).
fn prefix_and_g3_head(h: &NsHandle<'_>, keys: &[BlockKey]) -> (usize, usize, bool) {
    let prefix = h.lookup(keys).prefix_len();
    let on_g3: Vec<bool> = h
        .stat(keys)
        .unwrap()
        .iter()
        .map(|s| {
            s.as_ref()
                .is_some_and(|s| s.tier == kvtier_client::Tier::G3)
        })
        .collect();
    let held = on_g3.iter().filter(|&&b| b).count();
    (prefix, held, on_g3[..held].iter().all(|&b| b))
}

/// The repro of issue 27: 100 chained 1 MiB blocks into a 64 MiB G3. The
/// lookup prefix was 19 while blocks 62-99 stayed stored and unreachable;
/// now G3 holds exactly a head of the chain, every block of it reachable,
/// before and after the background reclaimer has run. Run with G4 off (the
/// lookup sees G3 alone: prefix == held) and with the default file:// G4
/// on (uploaded blocks the reclaimer took stay reachable through G4:
/// prefix >= held). With G4 on, a block whose parent was refused is
/// refused too, since no tier holds that parent (blocks 75-99 were stored
/// as G3 roots no lookup reaches).
#[test]
fn a_chain_larger_than_g3_keeps_a_reachable_head() {
    for g4 in [Some(""), None] {
        let mut args = vec!["--g3-capacity".to_string(), "64MiB".to_string()];
        if let Some(url) = g4 {
            args.extend(["--g4".to_string(), url.to_string()]);
        }
        let d = Daemon::start_with(&args, &[]);
        let c = client(&d);
        let h = c.namespace(&ns());
        let tokens: Vec<u32> = (0..100 * 16).collect();
        let keys = h.hash_chain(&tokens);
        let data: Vec<Vec<u8>> = (0..100u8).map(|i| vec![i; BLOCK]).collect();
        let refs: Vec<&[u8]> = data.iter().map(|v| &v[..]).collect();
        let out = h.offload_chain(None, &keys, &refs, Hints::default());
        let stored = out.iter().take_while(|o| o.is_stored()).count();
        assert!(
            out[stored..].iter().all(|o| !o.is_stored()),
            "g4 {g4:?}: a block stored after a refused one: {out:?}"
        );
        assert!(
            stored >= 48,
            "g4 {g4:?}: only {stored} blocks of a 64 MiB tier"
        );
        // The background reclaimer (every second, down to the low
        // watermark): whatever it takes, it takes from the tail.
        let until = Instant::now() + Duration::from_secs(8);
        loop {
            let (prefix, held, head) = prefix_and_g3_head(&h, &keys);
            assert!(
                head,
                "g4 {g4:?}: G3's {held} blocks are not the chain's head"
            );
            assert!(held > 0, "g4 {g4:?}: G3 holds nothing");
            if g4.is_some() {
                assert_eq!(prefix, held, "g4 off: {held} held, lookup prefix {prefix}");
            } else {
                assert!(prefix >= held, "{held} held, lookup prefix {prefix}");
            }
            if Instant::now() >= until {
                break;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

/// Pins past the budget (half of G3) are `StoredUnpinned`, never a plain
/// `Stored`, and the pinned ones all survive a tier filled twice over.
#[test]
fn pins_past_the_budget_are_answered_as_such() {
    let d = Daemon::start_with(&["--g3-capacity".into(), "16MiB".into()], &[]);
    let c = client(&d);
    let h = c.namespace(&ns());
    let pin = Hints {
        pinned: true,
        ..Hints::default()
    };
    let mut pinned = Vec::new();
    let mut unpinned = 0;
    for i in 0..12u32 {
        let key = h.hash_chain(&(i * 16..i * 16 + 16).collect::<Vec<u32>>())[0];
        let data = vec![i as u8; BLOCK];
        let out = h.offload(&[kvtier_client::OffloadBlock {
            key,
            parent: None,
            payload: &data,
            hints: pin,
        }]);
        match &out[0] {
            OffloadOutcome::Stored => pinned.push(key),
            OffloadOutcome::StoredUnpinned => unpinned += 1,
            other => panic!("block {i}: {other:?}"),
        }
    }
    assert!(
        !pinned.is_empty() && pinned.len() < 8,
        "{} pinned",
        pinned.len()
    );
    assert_eq!(pinned.len() + unpinned, 12);
    for i in 100..140u32 {
        let key = h.hash_chain(&(i * 16..i * 16 + 16).collect::<Vec<u32>>())[0];
        let data = vec![i as u8; BLOCK];
        let _ = h.offload(&[kvtier_client::OffloadBlock {
            key,
            parent: None,
            payload: &data,
            hints: Hints::default(),
        }]);
    }
    let held = h.stat(&pinned).unwrap();
    assert!(
        held.iter().all(Option::is_some),
        "a pinned block was evicted"
    );
}
