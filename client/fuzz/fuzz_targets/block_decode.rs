#![no_main]
//! Feeds arbitrary bytes to the block decoder, twice: as they are, and with
//! the header checksum re-sealed so mutations reach the checks behind it.
//! The decoder must never panic and never hand out an unverified payload.

use kvtier_client::block::{decode_block, reseal_header};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((h, p)) = decode_block(data) {
        assert!(h.payload_sum.matches(p));
    }
    let mut sealed = data.to_vec();
    reseal_header(&mut sealed);
    if let Ok((h, p)) = decode_block(&sealed) {
        assert!(h.payload_sum.matches(p));
    }
});
