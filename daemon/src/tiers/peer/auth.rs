//! Request signatures with a shared secret.
//!
//! Header: `Authorization: kvtier-hmac <node>/<epoch>:<unix_ms>:<nonce>:<64
//! hex digits>`, where `<node>` and `<epoch>` name the receiving server
//! (its node id, and the epoch it took at its start: [`Target`]), the nonce
//! is 32 fresh random hex digits and the digits are `blake3::keyed_hash(K,
//! method \n path \n range \n nonce \n node \n epoch \n unix_ms)`, `K =
//! blake3::derive_key("kvtier peer v3", secret)`. The signature binds the
//! method, the exact path and the `Range` header, the nonce, the receiving
//! node and its epoch, and a timestamp that must lie within the allowed
//! clock skew, so a captured header is useless for another block, at
//! another node sharing the secret, and after the server restarted (its
//! epoch grows at every start, whatever the clock says); within one run
//! the server remembers every signature it accepted (peer/replay.rs), so a
//! captured request replayed is refused. A client learns a server's node
//! and epoch from the [`TARGET_HEADER`] of any answer (a request signed
//! for another is answered 401 with it, and signed again). Comparison is constant-time
//! (`blake3::Hash`'s `PartialEq`). Transport is plain TCP: the secret proves
//! who asks, it does not hide the bytes (see docs/OPERATIONS.md).
//!
//! Mutual: the client also sends a fresh random `x-kvtier-nonce`, and the
//! server answers with `x-kvtier-proof: <64 hex digits>`, a keyed hash of
//! the nonce, the client's `Authorization` value and the status code. The
//! client believes no answer (block, header probe, 404) without a valid
//! proof, so a process that took a peer's address without the secret
//! cannot feed this node blocks.

/// Authorization scheme name.
pub const SCHEME: &str = "kvtier-hmac";
/// Key-derivation context.
/// (v2: the nonce is signed; v3: the receiving node and its epoch are.
/// An older node's requests are refused, 401.)
const CONTEXT: &str = "kvtier peer v3";
/// Hex digits of a signature nonce.
const NONCE_HEX_DIGITS: usize = 32;
/// Request header carrying the client's nonce.
pub const NONCE_HEADER: &str = "x-kvtier-nonce";
/// Response header carrying the server's proof.
pub const PROOF_HEADER: &str = "x-kvtier-proof";
/// Response header naming the server: `<node>/<epoch>` ([`Target`]).
pub const TARGET_HEADER: &str = "x-kvtier-node";
/// Shortest secret accepted, in bytes.
pub const SECRET_BYTES_MIN: usize = 16;

/// A derived signing key. Debug output never shows it.
#[derive(Clone)]
pub struct PeerKey([u8; 32]);

impl std::fmt::Debug for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerKey(..)")
    }
}

/// Why a request's authorization was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFault {
    /// No `Authorization` header.
    Missing,
    /// Not `kvtier-hmac <ms>:<hex64>`.
    Malformed,
    /// The timestamp is outside the allowed skew.
    Stale,
    /// The signature does not match.
    BadSignature,
    /// The signature was accepted before (peer/replay.rs).
    Replayed,
    /// Signed for another node, or for an earlier start of this one.
    OtherTarget,
}

/// The server a request is signed for: its node id and the epoch it took
/// at its start (larger at every start of the node).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Target {
    /// Node id ([`super::validate_node_id`]; empty: not known yet).
    pub node: String,
    /// Epoch (0: not known yet).
    pub epoch: u64,
}

impl Target {
    /// `<node>/<epoch>`, as [`TARGET_HEADER`] and the signature carry it.
    pub fn to_header(&self) -> String {
        format!("{}/{}", self.node, self.epoch)
    }

    /// Parses `<node>/<epoch>` (a node id of at most 64 bytes of
    /// `[A-Za-z0-9._-]`, or none).
    pub fn parse(s: &str) -> Option<Target> {
        let (node, epoch) = s.split_once('/')?;
        if !node.is_empty() && super::validate_node_id(node).is_err() {
            return None;
        }
        if epoch.is_empty() || epoch.len() > 20 || !epoch.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        Some(Target {
            node: node.to_string(),
            epoch: epoch.parse().ok()?,
        })
    }
}

/// An accepted signature: what the replay cache remembers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signed {
    /// The request's timestamp.
    pub unix_ms: u64,
    /// Its MAC (unique per nonce).
    pub mac: [u8; 32],
}

impl PeerKey {
    /// Derives the key from a shared secret (at least 16 bytes).
    pub fn from_secret(secret: &[u8]) -> crate::Result<Self> {
        if secret.len() < SECRET_BYTES_MIN {
            return Err(crate::Error::Config {
                key: "peer.secret".into(),
                problem: format!(
                    "{} bytes; use at least {SECRET_BYTES_MIN} random bytes, the same on every node",
                    secret.len()
                ),
            });
        }
        Ok(PeerKey(blake3::derive_key(CONTEXT, secret)))
    }

    fn mac(
        &self,
        method: &str,
        path: &str,
        range: &str,
        nonce: &str,
        to: &Target,
        unix_ms: u64,
    ) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        let epoch = to.epoch.to_string();
        for part in [method, path, range, nonce, &to.node, &epoch] {
            h.update(part.as_bytes());
            h.update(b"\n");
        }
        h.update(unix_ms.to_string().as_bytes());
        h.finalize()
    }

    /// The `Authorization` header value for a request to `to`, with a
    /// fresh nonce: no two calls give the same value.
    pub fn sign(&self, method: &str, path: &str, range: &str, to: &Target, unix_ms: u64) -> String {
        let nonce = Self::nonce();
        format!(
            "{SCHEME} {}:{unix_ms}:{nonce}:{}",
            to.to_header(),
            self.mac(method, path, range, &nonce, to, unix_ms).to_hex()
        )
    }

    /// A fresh nonce for one request (32 hex digits).
    pub fn nonce() -> String {
        let n: [u8; 16] = rand::random();
        n.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn proof_mac(&self, nonce: &str, authorization: &str, status: u16) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(b"kvtier server proof v1\n");
        for part in [nonce, authorization] {
            h.update(part.as_bytes());
            h.update(b"\n");
        }
        h.update(status.to_string().as_bytes());
        h.finalize()
    }

    /// The server's `x-kvtier-proof` value for an answer with `status` to a
    /// request carrying `nonce` and `authorization`.
    pub fn prove(&self, nonce: &str, authorization: &str, status: u16) -> String {
        self.proof_mac(nonce, authorization, status)
            .to_hex()
            .to_string()
    }

    /// Whether `proof` (the response's header, if any) proves that the
    /// server holds the secret. Constant-time comparison.
    pub fn check_proof(
        &self,
        proof: Option<&str>,
        nonce: &str,
        authorization: &str,
        status: u16,
    ) -> bool {
        let Some(p) = proof.and_then(|p| blake3::Hash::from_hex(p).ok()) else {
            return false;
        };
        self.proof_mac(nonce, authorization, status) == p
    }

    /// Checks an `Authorization` header value against the request at the
    /// server `me`, with `now_unix_ms` and the allowed skew in either
    /// direction.
    #[allow(clippy::too_many_arguments)]
    pub fn verify(
        &self,
        header: Option<&str>,
        method: &str,
        path: &str,
        range: &str,
        me: &Target,
        now_unix_ms: u64,
        skew_ms: u64,
    ) -> Result<Signed, AuthFault> {
        let h = header.ok_or(AuthFault::Missing)?;
        let rest = h
            .strip_prefix(SCHEME)
            .and_then(|r| r.strip_prefix(' '))
            .ok_or(AuthFault::Malformed)?;
        let (to, rest) = rest.split_once(':').ok_or(AuthFault::Malformed)?;
        let to = Target::parse(to).ok_or(AuthFault::Malformed)?;
        let (ms, rest) = rest.split_once(':').ok_or(AuthFault::Malformed)?;
        let (nonce, sig) = rest.split_once(':').ok_or(AuthFault::Malformed)?;
        if ms.is_empty() || ms.len() > 19 || !ms.bytes().all(|b| b.is_ascii_digit()) {
            return Err(AuthFault::Malformed);
        }
        if nonce.len() != NONCE_HEX_DIGITS || !nonce.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(AuthFault::Malformed);
        }
        let unix_ms: u64 = ms.parse().map_err(|_| AuthFault::Malformed)?;
        let sig = blake3::Hash::from_hex(sig).map_err(|_| AuthFault::Malformed)?;
        if self.mac(method, path, range, nonce, &to, unix_ms) != sig {
            return Err(AuthFault::BadSignature);
        }
        // Signed with the secret, for another server (or an earlier start
        // of this one): the client signs again for `me`.
        if to != *me {
            return Err(AuthFault::OtherTarget);
        }
        if now_unix_ms.abs_diff(unix_ms) > skew_ms {
            return Err(AuthFault::Stale);
        }
        Ok(Signed {
            unix_ms,
            mac: *sig.as_bytes(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_proof_binds_secret_nonce_request_and_status() {
        let k = PeerKey::from_secret(&[1u8; 32]).unwrap();
        let other = PeerKey::from_secret(&[2u8; 32]).unwrap();
        let (n, a) = (
            PeerKey::nonce(),
            k.sign("GET", "/v1/blocks/x/y", "", &Target::default(), 5),
        );
        assert_ne!(n, PeerKey::nonce());
        let p = k.prove(&n, &a, 200);
        assert!(k.check_proof(Some(&p), &n, &a, 200));
        assert!(!k.check_proof(None, &n, &a, 200));
        assert!(!k.check_proof(Some("zz"), &n, &a, 200));
        assert!(!k.check_proof(Some(&other.prove(&n, &a, 200)), &n, &a, 200));
        assert!(!k.check_proof(Some(&p), &PeerKey::nonce(), &a, 200));
        assert!(!k.check_proof(Some(&p), &n, &a, 404));
    }

    fn me() -> Target {
        Target {
            node: "node-a".into(),
            epoch: 7,
        }
    }

    #[test]
    fn a_request_signed_for_another_node_or_start_is_refused() {
        let k = PeerKey::from_secret(b"0123456789abcdef-secret").unwrap();
        let h = k.sign("GET", "/p", "", &me(), 1000);
        assert!(k.verify(Some(&h), "GET", "/p", "", &me(), 1000, 10).is_ok());
        let b = Target {
            node: "node-b".into(),
            epoch: 7,
        };
        assert_eq!(
            k.verify(Some(&h), "GET", "/p", "", &b, 1000, 10),
            Err(AuthFault::OtherTarget)
        );
        let restarted = Target { epoch: 8, ..me() };
        assert_eq!(
            k.verify(Some(&h), "GET", "/p", "", &restarted, 1000, 10),
            Err(AuthFault::OtherTarget)
        );
        // The target is signed: rewriting it breaks the signature.
        let forged = h.replace("node-a/7", "node-b/7");
        assert_eq!(
            k.verify(Some(&forged), "GET", "/p", "", &b, 1000, 10),
            Err(AuthFault::BadSignature)
        );
        assert_eq!(Target::parse("node-a/7"), Some(me()));
        assert_eq!(Target::parse("/0"), Some(Target::default()));
        for bad in ["node-a", "a b/1", "x/", "x/1a", ".h/1"] {
            assert_eq!(Target::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn sign_verify() {
        let k = PeerKey::from_secret(b"0123456789abcdef-secret").unwrap();
        let other = PeerKey::from_secret(b"another-secret-0123456").unwrap();
        let h = k.sign("GET", "/v1/blocks/x/y", "", &me(), 1000);
        assert!(k
            .verify(Some(&h), "GET", "/v1/blocks/x/y", "", &me(), 1500, 1000)
            .is_ok());
        // Every signature is fresh: same request, same instant, new nonce.
        assert_ne!(h, k.sign("GET", "/v1/blocks/x/y", "", &me(), 1000));
        assert_eq!(
            other.verify(Some(&h), "GET", "/v1/blocks/x/y", "", &me(), 1500, 1000),
            Err(AuthFault::BadSignature)
        );
        assert_eq!(
            k.verify(Some(&h), "GET", "/v1/blocks/x/z", "", &me(), 1500, 1000),
            Err(AuthFault::BadSignature)
        );
        assert_eq!(
            k.verify(
                Some(&h),
                "GET",
                "/v1/blocks/x/y",
                "bytes=0-1",
                &me(),
                1500,
                1000
            ),
            Err(AuthFault::BadSignature)
        );
        assert_eq!(
            k.verify(Some(&h), "GET", "/v1/blocks/x/y", "", &me(), 2001, 1000),
            Err(AuthFault::Stale)
        );
        assert_eq!(
            k.verify(None, "GET", "/", "", &me(), 0, 1),
            Err(AuthFault::Missing)
        );
        for bad in [
            "Bearer x",
            "kvtier-hmac",
            "kvtier-hmac 1:zz",
            "kvtier-hmac :00",
            "kvtier-hmac 1",
            // v1 form (no nonce).
            &format!("kvtier-hmac 1:{}", "0".repeat(64)),
            "kvtier-hmac 1:0123:00",
            // v2 form (no target).
            &format!("kvtier-hmac 1:{}:{}", "0".repeat(32), "0".repeat(64)),
        ] {
            assert_eq!(
                k.verify(Some(bad), "GET", "/", "", &me(), 1, 10),
                Err(AuthFault::Malformed)
            );
        }
        assert!(PeerKey::from_secret(b"short").is_err());
        assert_eq!(format!("{k:?}"), "PeerKey(..)");
    }
}
