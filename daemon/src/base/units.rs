//! Sizes as people write them (`64KiB`, `1.5TiB`, `800GB`): the parser and
//! the serde helpers every config section uses. A leaf: imports nothing from
//! the daemon, so each subsystem's section can parse sizes without reaching
//! up to the config file that composes them.

/// A size key that may be left out (then the struct default, `None`).
pub fn de_size_opt<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<u64>, D::Error> {
    de_size(d).map(Some)
}

/// A size key: a number of bytes or a string with a unit ([`parse_size`]).
pub fn de_size<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<u64, D::Error> {
    struct V;
    impl serde::de::Visitor<'_> for V {
        type Value = u64;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(
                "a size: a number of bytes or a string such as \"64KiB\", \"1.5TiB\", \"800GB\"",
            )
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<u64, E> {
            Ok(v)
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<u64, E> {
            u64::try_from(v)
                .map_err(|_| E::custom(format!("size {v} is negative; sizes are at least 0")))
        }
        fn visit_f64<E: serde::de::Error>(self, v: f64) -> std::result::Result<u64, E> {
            Err(E::custom(format!(
                "size {v} is not a whole number of bytes; write fractions with a unit as a string, e.g. \"1.5GiB\""
            )))
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<u64, E> {
            parse_size(v).map_err(E::custom)
        }
    }
    d.deserialize_any(V)
}

/// Parses sizes as people write them: `4096`, `64KiB`, `1.5TiB` (IEC, powers
/// of 1024), `800GB`, `2TB` (SI, powers of 1000), and `K`/`M`/`G`/`T` alone as
/// IEC (as coreutils reads them). Decimals are accepted where they come to a
/// whole number of bytes.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!("size {s:?} is negative; sizes are at least 0"));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let not_a_size = || format!("{s:?} is not a size (use e.g. 4096, 64KiB, 1.5TiB, 800GB)");
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() || frac.contains('.') || frac.len() > 18 {
        return Err(not_a_size());
    }
    let digits = |d: &str| -> std::result::Result<u128, String> {
        if d.is_empty() {
            Ok(0)
        } else {
            d.parse::<u128>().map_err(|_| not_a_size())
        }
    };
    let mult: u128 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "p" | "pib" => 1 << 50,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "pb" => 1_000_000_000_000_000,
        u => {
            return Err(format!(
                "unknown unit {u:?} in {s:?} (use B, KiB, MiB, GiB, TiB, PiB or KB, MB, GB, TB, PB)"
            ))
        }
    };
    let scale = 10u128.pow(frac.len() as u32);
    let scaled = digits(int)?
        .checked_mul(scale)
        .and_then(|v| v.checked_add(digits(frac).ok()?))
        .and_then(|v| v.checked_mul(mult))
        .ok_or_else(|| format!("size {s:?} overflows"))?;
    if scaled % scale != 0 {
        return Err(format!("size {s:?} is not a whole number of bytes"));
    }
    u64::try_from(scaled / scale).map_err(|_| format!("size {s:?} overflows"))
}
