#![allow(clippy::unwrap_used, clippy::expect_used)]
//! GPU tests: device memory round trips with checksums and guard bytes
//! around each destination region, over both plans (TwoHop, and Direct GDS
//! when the driver has it). Without a CUDA driver each test prints
//! `SKIP: no CUDA driver` and passes; with `KVTIER_REQUIRE_GPU=1` (set by
//! gds/scripts/device-check.sh) a missing GPU fails instead.
#![cfg(feature = "cuda")]

mod common;

use common::{open_direct, payload, tmp, write_block, CANARY, GUARD_BYTES};
use kvtier_client::block::HEADER_BYTES;
use kvtier_client::{BlockHeader, Dtype, KvLayout, LayoutKind};
use kvtier_gds::cuda::{DeviceBuf, PinnedBuf};
use kvtier_gds::{Capabilities, Destination, OnboardJob, Route, Transfer, TransferConfig};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Writes straight to stderr: libtest captures `eprintln!` of passing
/// tests, and a skip must be visible in a plain `cargo test` run.
fn skip(msg: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{msg}");
}

fn caps_or_skip(test: &str) -> Option<Capabilities> {
    let caps = Capabilities::probe();
    if caps.has_cuda() {
        eprintln!("{test}: {}", caps.describe());
        return Some(caps);
    }
    if std::env::var("KVTIER_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("KVTIER_REQUIRE_GPU=1 but {}", caps.describe());
    }
    skip(&format!(
        "SKIP: no CUDA driver ({test}: {})",
        caps.describe()
    ));
    None
}

fn sep_layout(layers: u32, head_dim: u32) -> KvLayout {
    KvLayout {
        layers,
        kv_heads: 8,
        head_dim,
        dtype: Dtype::Bf16,
        tokens_per_block: 16,
        kind: LayoutKind::LayerSeparate,
    }
}

/// One device allocation: guard | region 0 | guard | ... | guard.
fn device_arena(t: &Transfer, lens: &[usize]) -> (DeviceBuf, Vec<(usize, usize)>) {
    let total = lens.iter().sum::<usize>() + GUARD_BYTES * (lens.len() + 1);
    let buf = DeviceBuf::new(t.gpu().unwrap(), total).unwrap();
    buf.fill(CANARY).unwrap();
    let mut spans = Vec::new();
    let mut o = GUARD_BYTES;
    for &l in lens {
        spans.push((o, l));
        o += l + GUARD_BYTES;
    }
    (buf, spans)
}

/// Reads the arena back; checks every guard and returns the regions'
/// bytes in layer order.
fn check_arena(buf: &DeviceBuf, spans: &[(usize, usize)]) -> Vec<u8> {
    let mut host = vec![0u8; buf.len()];
    buf.read(0, &mut host).unwrap();
    let mut o = 0;
    for &(start, l) in spans {
        assert!(
            host[o..start].iter().all(|&b| b == CANARY),
            "guard before {start} overwritten"
        );
        o = start + l;
    }
    assert!(
        host[o..].iter().all(|&b| b == CANARY),
        "trailing guard overwritten"
    );
    spans
        .iter()
        .flat_map(|&(s, l)| host[s..s + l].to_vec())
        .collect()
}

fn onboard_device(
    t: &mut Transfer,
    path: &Path,
    h: &BlockHeader,
    layout: &KvLayout,
    lens: &[usize],
) -> (kvtier_gds::Result<kvtier_gds::Outcome>, Vec<u8>) {
    let (buf, spans) = device_arena(t, lens);
    let dspans = spans
        .iter()
        .map(|&(o, l)| buf.sub_span(o, l).unwrap())
        .collect();
    // SAFETY: sub-spans of `buf`, which outlives the transfer.
    let mut d = unsafe { Destination::device_raw(dspans) };
    let f = open_direct(path);
    let r = t.onboard(
        &f,
        HEADER_BYTES as u64,
        h.payload_len,
        &h.payload_sum,
        &mut d,
        layout,
    );
    let got = check_arena(&buf, &spans);
    (r, got)
}

fn both_plans(test: &str) -> Vec<(Transfer, Route)> {
    let Some(caps) = caps_or_skip(test) else {
        return Vec::new();
    };
    let mut v = Vec::new();
    let two_hop = TransferConfig {
        prefer_direct: false,
        chunk_bytes: 256 << 10,
        ..TransferConfig::default()
    };
    v.push((Transfer::new(caps.clone(), two_hop).unwrap(), Route::TwoHop));
    if caps.has_gds() {
        v.push((
            Transfer::new(caps, TransferConfig::default()).unwrap(),
            Route::Direct,
        ));
    } else {
        eprintln!(
            "SKIP: GDS absent, Direct plan not run ({})",
            caps.describe()
        );
    }
    v
}

#[test]
fn device_round_trip_contiguous_and_layer_separate() {
    let dir = tmp();
    for (mut t, planned) in both_plans("device_round_trip") {
        for (i, layout) in [
            KvLayout::llama3_8b(16),
            sep_layout(32, 128),
            sep_layout(3, 100),
            KvLayout::with_block_bytes(3 * 4096 + 96).unwrap(),
        ]
        .into_iter()
        .enumerate()
        {
            let (path, h, p) = write_block(dir.path(), layout, i as u8 + 1);
            let lens = match layout.kind {
                LayoutKind::LayerContiguous => vec![layout.block_bytes() as usize],
                LayoutKind::LayerSeparate => {
                    vec![layout.layer_bytes() as usize; layout.layers as usize]
                }
            };
            let (r, got) = onboard_device(&mut t, &path, &h, &layout, &lens);
            let out = r.unwrap();
            eprintln!("{planned:?} {layout:?}: {out:?}");
            assert_eq!(out.planned, planned);
            if out.fallback.is_some() {
                eprintln!("NOTE: Direct fell back: {:?}", out.fallback);
                assert_eq!(out.route, Route::TwoHop);
            } else {
                assert_eq!(out.route, planned);
            }
            assert!(got == p, "device bytes differ ({planned:?}, {layout:?})");
        }
    }
}

#[test]
fn device_corruption_is_an_error_on_both_plans() {
    let dir = tmp();
    for (mut t, planned) in both_plans("device_corruption") {
        let layout = sep_layout(4, 64);
        let (path, h, _) = write_block(dir.path(), layout, 9);
        let w = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let mut b = [0u8; 1];
        w.read_exact_at(&mut b, (HEADER_BYTES + 777) as u64)
            .unwrap_or(());
        w.write_all_at(&[!b[0]], (HEADER_BYTES + 777) as u64)
            .unwrap();
        drop(w);
        let lens = vec![layout.layer_bytes() as usize; 4];
        let (r, _) = onboard_device(&mut t, &path, &h, &layout, &lens);
        let e = r.unwrap_err();
        assert!(e.is_integrity(), "{planned:?}: {e}");
    }
}

#[test]
fn pinned_destination_round_trip() {
    let Some(caps) = caps_or_skip("pinned_round_trip") else {
        return;
    };
    let dir = tmp();
    let mut t = Transfer::new(caps, TransferConfig::default()).unwrap();
    let layout = KvLayout::llama3_8b(16);
    let (path, h, p) = write_block(dir.path(), layout, 3);
    let mut pb = PinnedBuf::new(t.gpu().unwrap(), p.len()).unwrap();
    let mut d = Destination::pinned(vec![&mut pb]);
    let f = open_direct(&path);
    let out = t
        .onboard(
            &f,
            HEADER_BYTES as u64,
            h.payload_len,
            &h.payload_sum,
            &mut d,
            &layout,
        )
        .unwrap();
    assert_eq!(out.route, Route::HostRead);
    assert!(pb.as_slice() == &p[..]);
}

#[test]
fn host_to_device_copy_verifies() {
    let Some(caps) = caps_or_skip("host_to_device") else {
        return;
    };
    let mut t = Transfer::new(caps, TransferConfig::default()).unwrap();
    let layout = sep_layout(2, 128);
    let lb = layout.layer_bytes() as usize;
    let p = payload(2 * lb, 4);
    let sum = kvtier_client::PayloadSum::of(&p);
    let (buf, spans) = device_arena(&t, &[lb, lb]);
    let dspans = spans
        .iter()
        .map(|&(o, l)| buf.sub_span(o, l).unwrap())
        .collect();
    // SAFETY: sub-spans of `buf`, alive for the call.
    let mut d = unsafe { Destination::device_raw(dspans) };
    let out = t.copy_from_host(&p, &sum, &mut d, &layout).unwrap();
    assert_eq!(out.route, Route::HostToDevice);
    assert!(check_arena(&buf, &spans) == p);
}

#[test]
fn h2d_bandwidth_is_measurable() {
    let Some(caps) = caps_or_skip("h2d_bandwidth") else {
        return;
    };
    let t = Transfer::new(caps, TransferConfig::default()).unwrap();
    let g = kvtier_gds::cuda::h2d_pinned_gbps(t.gpu().unwrap(), 8 << 20, 4).unwrap();
    eprintln!("h2d pinned: {g:.2} GB/s");
    assert!(g > 0.0);
}

#[test]
fn device_batch_with_one_corrupt_block() {
    let dir = tmp();
    for (mut t, planned) in both_plans("device_batch") {
        let layout = sep_layout(4, 64);
        let lb = layout.layer_bytes() as usize;
        let blocks: Vec<_> = (0..3)
            .map(|i| write_block(dir.path(), layout, 40 + i))
            .collect();
        let w = OpenOptions::new().write(true).open(&blocks[1].0).unwrap();
        w.write_all_at(&[1, 2, 3, 4, 5], (HEADER_BYTES + 99) as u64)
            .unwrap();
        drop(w);
        let arenas: Vec<_> = (0..3).map(|_| device_arena(&t, &[lb; 4])).collect();
        let files: Vec<File> = blocks.iter().map(|b| open_direct(&b.0)).collect();
        let mut dests: Vec<Destination<'_>> = arenas
            .iter()
            .map(|(buf, spans)| {
                let s = spans
                    .iter()
                    .map(|&(o, l)| buf.sub_span(o, l).unwrap())
                    .collect();
                // SAFETY: sub-spans of `buf`, alive for the batch.
                unsafe { Destination::device_raw(s) }
            })
            .collect();
        let mut jobs: Vec<OnboardJob<'_, '_>> = dests
            .iter_mut()
            .zip(&files)
            .zip(&blocks)
            .map(|((d, f), b)| OnboardJob {
                file: f,
                payload_offset: HEADER_BYTES as u64,
                payload_len: b.1.payload_len,
                expected_sum: b.1.payload_sum,
                dst: d,
                layout: &layout,
            })
            .collect();
        let results = t.onboard_batch(&mut jobs).unwrap();
        for (i, r) in results.iter().enumerate() {
            let got = check_arena(&arenas[i].0, &arenas[i].1);
            if i == 1 {
                assert!(r.as_ref().unwrap_err().is_integrity(), "{planned:?}");
            } else {
                assert_eq!(r.as_ref().unwrap().planned, planned);
                assert!(got == blocks[i].2, "{planned:?} block {i}");
            }
        }
    }
}

#[test]
fn cudarc_slice_destination() {
    let Some(caps) = caps_or_skip("cudarc_slice") else {
        return;
    };
    let dir = tmp();
    let mut t = Transfer::new(caps, TransferConfig::default()).unwrap();
    let layout = sep_layout(2, 128);
    let (path, h, p) = write_block(dir.path(), layout, 11);
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    let lb = layout.layer_bytes() as usize;
    let mut l0 = stream.alloc_zeros::<u8>(lb).unwrap();
    let mut l1 = stream.alloc_zeros::<u8>(lb).unwrap();
    let mut d = Destination::from_cudarc(vec![&mut l0, &mut l1]).unwrap();
    let f = open_direct(&path);
    t.onboard(
        &f,
        HEADER_BYTES as u64,
        h.payload_len,
        &h.payload_sum,
        &mut d,
        &layout,
    )
    .unwrap();
    drop(d);
    let mut got = stream.clone_dtoh(&l0).unwrap();
    got.extend(stream.clone_dtoh(&l1).unwrap());
    assert!(got == p);
}
