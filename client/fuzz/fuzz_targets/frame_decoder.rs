//! Fuzzes the wire decoders the daemon runs on untrusted bytes: every
//! request decoder, every reply decoder (the client side), and the re-encode
//! round trip of whatever decodes.
#![no_main]

use kvtier_client::proto::{Request, Response};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((id, req)) = Request::decode(data) {
        let again = req.encode(id);
        assert_eq!(Request::decode(&again[4..]).ok(), Some((id, req)));
    }
    for op in 1..=12u8 {
        let _ = Response::decode(data, op);
    }
});
