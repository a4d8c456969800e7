//! The mount's naming scheme, parsed strictly.
//!
//! Names arrive from the kernel as raw bytes. Only the canonical lowercase
//! hex forms are accepted, so one block has exactly one name (no aliasing
//! through uppercase digits) and no name can carry path syntax (`..`, `/`,
//! NUL) into a namespace implementation.

use crate::error::{Error, Result};
use kvtier_client::{BlockKey, NamespaceId};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

/// Name of the read-only control directory at the mount root.
pub const META_DIR: &str = ".kvtier";
/// Text statistics file inside [`META_DIR`].
pub const STATS_FILE: &str = "stats";
/// Tail-able event log inside [`META_DIR`].
pub const EVENTS_FILE: &str = "events";

/// Longest name component that is even looked at: a 64-byte key is 128
/// hex digits; anything longer is refused without parsing.
const NAME_BYTES_MAX: usize = 128;

fn invalid(name: &OsStr, reason: &'static str) -> Error {
    let shown: String = name
        .as_bytes()
        .iter()
        .take(80)
        .flat_map(|b| std::ascii::escape_default(*b))
        .map(char::from)
        .collect();
    Error::InvalidName {
        name: shown,
        reason,
    }
}

/// Lowercase hex digits only, of even length, within the limit.
fn canonical_hex<'a>(name: &'a OsStr, what: &'static str) -> Result<&'a str> {
    let b = name.as_bytes();
    if b.is_empty() || b.len() > NAME_BYTES_MAX {
        return Err(invalid(name, what));
    }
    if !b
        .iter()
        .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    {
        return Err(invalid(name, "only lowercase hex digits are allowed"));
    }
    std::str::from_utf8(b).map_err(|_| invalid(name, "not UTF-8"))
}

/// A namespace directory name: exactly 32 lowercase hex digits.
pub fn parse_namespace(name: &OsStr) -> Result<NamespaceId> {
    let s = canonical_hex(name, "a namespace is 32 lowercase hex digits")?;
    if s.len() != 32 {
        return Err(invalid(name, "a namespace is 32 lowercase hex digits"));
    }
    NamespaceId::from_hex(s).map_err(|_| invalid(name, "a namespace is 32 lowercase hex digits"))
}

/// A shard directory name: exactly 2 lowercase hex digits.
pub fn parse_shard(name: &OsStr) -> Result<u8> {
    let s = canonical_hex(name, "a shard is 2 lowercase hex digits")?;
    if s.len() != 2 {
        return Err(invalid(name, "a shard is 2 lowercase hex digits"));
    }
    u8::from_str_radix(s, 16).map_err(|_| invalid(name, "a shard is 2 lowercase hex digits"))
}

/// A block file name inside shard directory `shard`: 2 to 128 lowercase hex
/// digits whose first byte is the shard.
pub fn parse_block(name: &OsStr, shard: u8) -> Result<BlockKey> {
    let s = canonical_hex(name, "a key is 2 to 128 lowercase hex digits")?;
    let key = BlockKey::from_hex(s)
        .map_err(|_| invalid(name, "a key is an even number (2 to 128) of hex digits"))?;
    if key.as_bytes()[0] != shard {
        return Err(invalid(
            name,
            "the key does not belong in this shard directory",
        ));
    }
    Ok(key)
}

/// The two-digit shard directory name.
pub fn shard_name(shard: u8) -> String {
    format!("{shard:02x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(s: &[u8]) -> &OsStr {
        OsStr::from_bytes(s)
    }

    #[test]
    fn hostile_names_are_refused_before_the_store() {
        let long = vec![b'a'; 300];
        for bad in [
            &b".."[..],
            b".",
            b"",
            b"a/b",
            b"ab\0cd",
            &long,
            b"zz",
            b"AB",
            b"abc",
            b"ab cd",
            "é1".as_bytes(),
            &[0xff, 0xfe],
        ] {
            assert!(parse_shard(os(bad)).is_err(), "shard {bad:?}");
            assert!(parse_block(os(bad), 0xab).is_err(), "block {bad:?}");
            assert!(parse_namespace(os(bad)).is_err(), "ns {bad:?}");
        }
        assert!(parse_namespace(os(&[b'A'; 32])).is_err(), "uppercase alias");
        assert!(parse_namespace(os(&[b'a'; 30])).is_err(), "wrong length");
        assert!(parse_block(os(&[b'a'; 130]), 0xaa).is_err(), "overlong key");
    }

    #[test]
    fn canonical_names_parse() {
        assert_eq!(parse_shard(os(b"0f")).unwrap(), 0x0f);
        let k = parse_block(os(b"ab01"), 0xab).unwrap();
        assert_eq!(k.to_hex(), "ab01");
        assert!(parse_block(os(b"ab01"), 0xac).is_err(), "wrong shard");
        let ns = parse_namespace(os(&[b'0'; 32])).unwrap();
        assert_eq!(ns.to_hex(), "0".repeat(32));
        assert_eq!(shard_name(7), "07");
    }
}
