//! `KVTIERD_*` environment overrides for every daemon config key.
//!
//! `KVTIERD_<SECTION>_<KEY>` sets `<section>.<key>`: `KVTIERD_G3_CAPACITY`
//! is `g3.capacity`, `KVTIERD_EVENTS_ZMQ_ENDPOINT` is
//! `events.zmq.endpoint` (the longest section wins). Nothing is listed by
//! hand: the sections are the headers of the annotated default
//! ([`crate::app::config::DEFAULT_TOML`]) and a key is valid when the typed
//! configuration accepts it (serde's `deny_unknown_fields`), so a key added
//! to a section is overridable at once. `KVTIER_SOCKET` (no D) stays the
//! client's and is not read here.
//!
//! Precedence: flag > environment > file > default (kvtierd applies its
//! flags after [`Config::load_layered`]). A value is read as TOML (`1024`,
//! `0.9`, `true`, `["a:1", "b:2"]`, `"text"`), else as a plain string, so
//! `KVTIERD_G3_CAPACITY=1.5TiB` and `KVTIERD_G4_URL=s3://b/p` need no
//! quotes. A bad value is an error naming the variable; a `KVTIERD_*`
//! variable that names no key is a warning (a typo must be visible, an
//! unrelated variable must not stop the node). `[[tenants]]` tables are not
//! settable this way (use the file).

use crate::app::config::{Config, DEFAULT_TOML};
use crate::base::error::{Error, Result};
use serde::Deserialize;

/// The prefix of kvtierd's variables.
pub const ENV_PREFIX: &str = "KVTIERD_";

/// Section paths of the configuration (`server`, `events.zmq`, ...), from
/// the annotated default's headers.
pub fn sections() -> Vec<String> {
    DEFAULT_TOML
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let inner = l.strip_prefix('[')?.strip_suffix(']')?;
            // `[[tenants]]` is an array of tables: not a settable section.
            (!inner.starts_with('[')).then(|| inner.to_string())
        })
        .collect()
}

/// `KVTIERD_G3_HIGH_WATERMARK` -> `(["g3"], "high_watermark")`.
fn key_of(var: &str, sections: &[String]) -> Option<(Vec<String>, String)> {
    let rest = var.strip_prefix(ENV_PREFIX)?.to_ascii_lowercase();
    let mut best: Option<&String> = None;
    for s in sections {
        let p = format!("{}_", s.replace('.', "_"));
        if rest.starts_with(&p) && rest.len() > p.len() && best.is_none_or(|b| b.len() < s.len()) {
            best = Some(s);
        }
    }
    let s = best?;
    let key = rest[s.len() + 1..].to_string();
    Some((s.split('.').map(str::to_string).collect(), key))
}

/// The value as TOML when it reads as one, else as a string.
fn value_of(raw: &str) -> toml::Value {
    toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()))
}

fn set(table: &mut toml::Table, path: &[String], key: &str, v: toml::Value) {
    let mut t = table;
    for p in path {
        let entry = t
            .entry(p.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if !entry.is_table() {
            *entry = toml::Value::Table(toml::Table::new());
        }
        let toml::Value::Table(next) = entry else {
            return;
        };
        t = next;
    }
    t.insert(key.to_string(), v);
}

fn parse(table: &toml::Table) -> std::result::Result<Config, String> {
    Config::deserialize(toml::Value::Table(table.clone())).map_err(|e| e.to_string())
}

/// What applying the environment did.
#[derive(Debug, Default)]
pub struct EnvReport {
    /// Variables applied, as `(variable, key)`.
    pub applied: Vec<(String, String)>,
    /// One line per `KVTIERD_*` variable that names no key.
    pub warnings: Vec<String>,
}

/// Applies `vars` (`KVTIERD_*` ones; others are ignored) over `table`.
pub fn apply(table: &mut toml::Table, vars: &[(String, String)]) -> Result<EnvReport> {
    let sections = sections();
    let mut report = EnvReport::default();
    let mut vars: Vec<&(String, String)> = vars
        .iter()
        .filter(|(k, _)| k.starts_with(ENV_PREFIX))
        .collect();
    vars.sort();
    for (var, raw) in vars {
        let Some((path, key)) = key_of(var, &sections) else {
            report.warnings.push(format!(
                "{var}: no configuration section matches (sections: {}); ignored",
                sections.join(", ")
            ));
            continue;
        };
        let dotted = format!("{}.{key}", path.join("."));
        let mut tried = table.clone();
        set(&mut tried, &path, &key, value_of(raw));
        let mut outcome = parse(&tried);
        if outcome.is_err() && !matches!(value_of(raw), toml::Value::String(_)) {
            // `1024` for a string key (a node id): take it as text.
            let mut as_text = table.clone();
            set(&mut as_text, &path, &key, toml::Value::String(raw.clone()));
            if parse(&as_text).is_ok() {
                tried = as_text;
                outcome = Ok(Config::default());
            }
        }
        match outcome {
            Ok(_) => {
                *table = tried;
                report.applied.push((var.clone(), dotted));
            }
            Err(e) if e.contains("unknown field") => report.warnings.push(format!(
                "{var}: `{dotted}` is not a configuration key; ignored"
            )),
            Err(e) => {
                // serde's message ends with "in `key`": said already.
                let msg = e.lines().next().unwrap_or("").trim().to_string();
                return Err(Error::Config {
                    key: var.clone(),
                    problem: format!("(sets {dotted}) {msg}"),
                });
            }
        }
    }
    Ok(report)
}

impl Config {
    /// The file (if any) over the defaults, then the `KVTIERD_*` variables
    /// of `vars` over both. File errors name the file and line; a bad
    /// variable names the variable.
    pub fn load_layered(
        path: Option<&std::path::Path>,
        vars: &[(String, String)],
    ) -> Result<(Config, EnvReport)> {
        let text = match path {
            Some(p) => std::fs::read_to_string(p).map_err(|e| Error::Config {
                key: "--config".into(),
                problem: format!("cannot read {}: {e}", p.display()),
            })?,
            None => String::new(),
        };
        let origin = path.map_or("<no file>".to_string(), |p| p.display().to_string());
        // Typed first: a file's mistakes are reported with its line.
        let from_file = Config::from_toml_named(&text, &origin)?;
        if let Some(p) = path {
            secrets_private(p, &from_file)?;
        }
        if !vars.iter().any(|(k, _)| k.starts_with(ENV_PREFIX)) {
            return Ok((from_file, EnvReport::default()));
        }
        let mut table: toml::Table = toml::from_str(&text).map_err(|e| Error::Config {
            key: origin.clone(),
            problem: e.message().to_string(),
        })?;
        let report = apply(&mut table, vars)?;
        let cfg = parse(&table).map_err(|e| Error::Config {
            key: "environment".into(),
            problem: e,
        })?;
        Ok((cfg, report))
    }
}

/// A config file that holds a G4 secret is held to the peer secret file's
/// rule: readable by its owner only.
fn secrets_private(path: &std::path::Path, cfg: &Config) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let g4 = &cfg.g4.store;
    let key = if g4.secret_access_key.is_some() {
        "g4.secret_access_key"
    } else if g4.session_token.is_some() {
        "g4.session_token"
    } else {
        return Ok(());
    };
    let mode = std::fs::metadata(path)
        .map_err(|e| Error::io("reading", path, e))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(Error::Config {
            key: key.into(),
            problem: format!(
                "{} holds it and is readable by group or others (mode {:o}); chmod 600 it, \
                 or give the key through AWS_SECRET_ACCESS_KEY",
                path.display(),
                mode & 0o777
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn vars(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    fn layered(file: &str, v: &[(&str, &str)]) -> Result<(Config, EnvReport)> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("kvtierd.toml");
        std::fs::write(&p, file).unwrap();
        Config::load_layered(Some(&p), &vars(v))
    }

    #[test]
    fn sections_come_from_the_default() {
        let s = sections();
        for want in [
            "server",
            "g3",
            "g4",
            "peer",
            "events",
            "events.zmq",
            "mount",
        ] {
            assert!(s.iter().any(|x| x == want), "{want} in {s:?}");
        }
    }

    #[test]
    fn env_overrides_file_over_default() {
        let (c, r) = layered(
            "[g3]\ncapacity = \"2GiB\"\npolicy = \"lru\"\n",
            &[
                ("KVTIERD_G3_CAPACITY", "1.5TiB"),
                ("KVTIERD_G4_URL", "s3://bucket/prefix"),
                ("KVTIERD_G3_HIGH_WATERMARK", "0.9"),
                ("KVTIERD_SERVER_SOCKET_MODE", "0600"),
                ("KVTIERD_EVENTS_ZMQ_ENDPOINT", "ipc:///tmp/x.sock"),
                ("KVTIERD_PEER_NODE_ID", "1024"),
                ("KVTIER_SOCKET", "/ignored"),
                ("HOME", "/root"),
            ],
        )
        .unwrap();
        assert_eq!(c.g3.capacity, 3 << 39);
        assert_eq!(c.g3.policy, "lru", "the file's value where no variable");
        assert_eq!(c.g4.url.as_deref(), Some("s3://bucket/prefix"));
        assert!((c.g3.high_watermark - 0.9).abs() < 1e-9);
        assert_eq!(c.server.socket_mode, "0600");
        assert_eq!(c.events.zmq.endpoint, "ipc:///tmp/x.sock");
        assert_eq!(c.peer.node_id.as_deref(), Some("1024"));
        assert_eq!(r.applied.len(), 6, "{:?}", r.applied);
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        // Without a file: over the defaults.
        let (c, _) = Config::load_layered(None, &vars(&[("KVTIERD_G3_CAPACITY", "10GB")])).unwrap();
        assert_eq!(c.g3.capacity, 10_000_000_000);
    }

    #[test]
    fn a_bad_value_names_the_variable() {
        let e = layered("", &[("KVTIERD_G3_CAPACITY", "lots")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("KVTIERD_G3_CAPACITY") && e.contains("g3.capacity"),
            "{e}"
        );
        let e = layered("", &[("KVTIERD_SERVER_MAX_CONNECTIONS", "-3")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("KVTIERD_SERVER_MAX_CONNECTIONS"), "{e}");
    }

    #[test]
    fn unknown_variables_are_warned_about() {
        let (c, r) = layered("", &[("KVTIERD_G3_CAPACTY", "1GiB"), ("KVTIERD_NOPE", "1")]).unwrap();
        assert_eq!(c.g3.capacity, Config::default().g3.capacity);
        assert_eq!(r.warnings.len(), 2, "{:?}", r.warnings);
        assert!(
            r.warnings[0].contains("KVTIERD_G3_CAPACTY"),
            "{:?}",
            r.warnings
        );
        assert!(r.warnings[1].contains("KVTIERD_NOPE"), "{:?}", r.warnings);
    }

    #[test]
    fn file_errors_keep_their_line() {
        let e = layered("[g3]\n\ncapacty = 1\n", &[("KVTIERD_G3_CAPACITY", "1GiB")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("kvtierd.toml:3"), "{e}");
    }

    /// Every key of the annotated default is settable by its variable
    /// (the default's own value, given as the text an operator would type).
    #[test]
    fn every_default_key_has_a_variable() {
        let text = Config::default_toml();
        let t: toml::Table = toml::from_str(&text).unwrap();
        let mut v = Vec::new();
        fn walk(prefix: &str, t: &toml::Table, v: &mut Vec<(String, String)>) {
            for (k, x) in t {
                let name = format!("{prefix}_{}", k.to_ascii_uppercase());
                match x {
                    toml::Value::Table(sub) => walk(&name, sub, v),
                    toml::Value::String(s) => v.push((name, s.clone())),
                    other => v.push((name, other.to_string())),
                }
            }
        }
        walk("KVTIERD", &t, &mut v);
        assert!(v.len() > 35, "{} keys: {v:?}", v.len());
        let (_, r) = Config::load_layered(None, &v).unwrap();
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        assert_eq!(r.applied.len(), v.len());
    }
}
