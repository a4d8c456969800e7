//! Keeps credentials out of logs and errors: every object-store message
//! passes through [`scrub`] before it leaves the G4 module.

/// Query and header parameters whose values are credentials or signatures.
const MARKERS: [&str; 6] = [
    "X-Amz-Signature=",
    "X-Amz-Credential=",
    "X-Amz-Security-Token=",
    "Signature=",
    "Credential=",
    "x-amz-security-token:",
];

/// `msg` with every secret replaced by `<redacted>`, and the values of
/// signature/credential parameters removed.
pub fn scrub(msg: &str, secrets: &[String]) -> String {
    let mut out = msg.to_string();
    for s in secrets {
        if !s.is_empty() {
            out = out.replace(s.as_str(), "<redacted>");
        }
    }
    for m in MARKERS {
        let mut from = 0;
        while let Some(i) = out[from..].find(m) {
            let start = from + i + m.len();
            let end = out[start..]
                .find(|c: char| c == '&' || c == ',' || c == '"' || c.is_whitespace())
                .map_or(out.len(), |j| start + j);
            out.replace_range(start..end, "<redacted>");
            from = start + "<redacted>".len();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::scrub;

    #[test]
    fn secrets_and_signatures_are_removed() {
        let secrets = vec!["AKIAEXAMPLEKEY".to_string(), "s3cr3t/KEY+xyz".to_string()];
        let msg = "403 for AKIAEXAMPLEKEY at https://h/b/k?X-Amz-Signature=abcdef&x=1 \
                   Authorization: AWS4 Credential=AKIA/2024, Signature=deadbeef s3cr3t/KEY+xyz";
        let s = scrub(msg, &secrets);
        for bad in [
            "AKIAEXAMPLEKEY",
            "s3cr3t/KEY+xyz",
            "abcdef",
            "deadbeef",
            "AKIA/2024",
        ] {
            assert!(!s.contains(bad), "{bad} left in {s}");
        }
        assert!(s.contains("403 for <redacted>"));
        assert!(s.contains("&x=1"));
    }
}
