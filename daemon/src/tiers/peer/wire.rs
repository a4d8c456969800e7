//! The peer URL scheme and `Range` parsing.
//!
//! One URL form exists: `/v1/blocks/<ns-hex32>/<key-hex>`, lowercase hex
//! only. The parser accepts nothing else (no percent-encoding, no `..`, no
//! uppercase, no query), so that a request maps to exactly one block.

use kvtier_client::{BlockKey, NamespaceId};

/// Path prefix of block URLs.
pub const BLOCKS_PREFIX: &str = "/v1/blocks/";

/// Why a path was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathFault {
    /// Not under [`BLOCKS_PREFIX`] at all (HTTP 404).
    NotFound,
    /// Under the prefix but malformed (HTTP 400).
    Malformed,
}

/// The URL path of a block.
pub fn block_url_path(ns: &NamespaceId, key: &BlockKey) -> String {
    format!("{BLOCKS_PREFIX}{}/{}", ns.to_hex(), key.to_hex())
}

fn is_lower_hex(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Parses a request path into `(namespace, key)`. Pure: touches nothing.
pub fn parse_block_path(path: &str) -> Result<(NamespaceId, BlockKey), PathFault> {
    let rest = path
        .strip_prefix(BLOCKS_PREFIX)
        .ok_or(PathFault::NotFound)?;
    let (ns, key) = rest.split_once('/').ok_or(PathFault::Malformed)?;
    if ns.len() != 32 || !is_lower_hex(ns) {
        return Err(PathFault::Malformed);
    }
    if key.is_empty() || key.len() > 128 || key.len() % 2 != 0 || !is_lower_hex(key) {
        return Err(PathFault::Malformed);
    }
    let ns = NamespaceId::from_hex(ns).map_err(|_| PathFault::Malformed)?;
    let key = BlockKey::from_hex(key).map_err(|_| PathFault::Malformed)?;
    Ok((ns, key))
}

/// A parsed, satisfiable byte range: `[start, end)` of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteRange {
    /// First byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
}

/// A `Range` header's meaning for a file of `len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeRequest {
    /// No header: the whole file.
    Whole,
    /// One satisfiable range.
    Partial(ByteRange),
    /// Syntactically valid but outside the file (HTTP 416).
    Unsatisfiable,
    /// Not a single `bytes=` range (HTTP 400; multi-ranges are refused).
    Malformed,
}

/// Parses a single-range `Range` header (`bytes=a-b`, `bytes=a-`, `bytes=-n`).
pub fn parse_range(header: Option<&str>, len: u64) -> RangeRequest {
    let Some(h) = header else {
        return RangeRequest::Whole;
    };
    let Some(spec) = h.trim().strip_prefix("bytes=") else {
        return RangeRequest::Malformed;
    };
    let Some((a, b)) = spec.split_once('-') else {
        return RangeRequest::Malformed;
    };
    let num = |s: &str| -> Option<u64> {
        if s.is_empty() || s.len() > 19 || !s.bytes().all(|c| c.is_ascii_digit()) {
            None
        } else {
            s.parse().ok()
        }
    };
    match (a.is_empty(), b.is_empty()) {
        (true, true) => RangeRequest::Malformed,
        (true, false) => match num(b) {
            None => RangeRequest::Malformed,
            Some(0) => RangeRequest::Unsatisfiable,
            Some(n) => RangeRequest::Partial(ByteRange {
                start: len.saturating_sub(n),
                end: len,
            }),
        },
        (false, _) => {
            let Some(start) = num(a) else {
                return RangeRequest::Malformed;
            };
            let last = if b.is_empty() {
                if start >= len {
                    return RangeRequest::Unsatisfiable;
                }
                len - 1
            } else {
                match num(b) {
                    Some(v) => v,
                    None => return RangeRequest::Malformed,
                }
            };
            if last < start {
                return RangeRequest::Malformed;
            }
            if start >= len {
                return RangeRequest::Unsatisfiable;
            }
            RangeRequest::Partial(ByteRange {
                start,
                end: last.min(len - 1) + 1,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        let ns = NamespaceId([0xab; 16]);
        let key = BlockKey::from_u64(0x0102_0304_0506_0708);
        let p = block_url_path(&ns, &key);
        assert_eq!(parse_block_path(&p), Ok((ns, key)));
        let nsx = ns.to_hex();
        for (bad, fault) in [
            ("/", PathFault::NotFound),
            ("/etc/passwd", PathFault::NotFound),
            ("/v1/blocks", PathFault::NotFound),
            ("/v1/blocks/", PathFault::Malformed),
            ("/v1/blocks/../../etc/passwd", PathFault::Malformed),
            (&format!("/v1/blocks/{nsx}/../x"), PathFault::Malformed),
            (&format!("/v1/blocks/{nsx}/ab/cd"), PathFault::Malformed),
            (&format!("/v1/blocks/{nsx}/ABCD"), PathFault::Malformed),
            (&format!("/v1/blocks/{nsx}/abc"), PathFault::Malformed),
            (&format!("/v1/blocks/{nsx}/%2e%2e"), PathFault::Malformed),
            (&format!("/v1/blocks/{nsx}/"), PathFault::Malformed),
            (
                &format!("/v1/blocks/{nsx}/{}", "a".repeat(130)),
                PathFault::Malformed,
            ),
            (
                &format!("/v1/blocks/{}/abcd", &nsx[..30]),
                PathFault::Malformed,
            ),
            (
                "/v1/blocks/zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz/abcd",
                PathFault::Malformed,
            ),
        ] {
            assert_eq!(parse_block_path(bad), Err(fault), "{bad}");
        }
    }

    #[test]
    fn ranges() {
        use RangeRequest::*;
        let r = |s, e| Partial(ByteRange { start: s, end: e });
        assert_eq!(parse_range(None, 10), Whole);
        assert_eq!(parse_range(Some("bytes=0-3"), 10), r(0, 4));
        assert_eq!(parse_range(Some("bytes=4-"), 10), r(4, 10));
        assert_eq!(parse_range(Some("bytes=-3"), 10), r(7, 10));
        assert_eq!(parse_range(Some("bytes=5-100"), 10), r(5, 10));
        assert_eq!(parse_range(Some("bytes=10-"), 10), Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=-0"), 10), Unsatisfiable);
        for bad in [
            "bytes=",
            "bytes=-",
            "bytes=3-1",
            "items=0-1",
            "bytes=0-1,3-4",
            "bytes=a-b",
            "bytes=+1-2",
        ] {
            assert_eq!(parse_range(Some(bad), 10), Malformed, "{bad}");
        }
    }
}
