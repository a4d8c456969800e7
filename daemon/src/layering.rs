//! The layering check: reads the daemon's sources and fails on an import
//! that points up a layer, on product code that reaches into the test
//! scaffolding, and on an import cycle between the modules of a layer.
//!
//! Layers, bottom to top: `base`, `tiers`, `node`, `edges`, `app` (see the
//! crate docs). A file may import from its own layer and the ones below.
//! Test code (`tests.rs`, `tests_*.rs`, and `#[cfg(test)] mod ... { }`
//! blocks) is exempt: a test may build its fixture from any layer.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const LAYERS: [&str; 5] = ["base", "tiers", "node", "edges", "app"];

/// One import that breaks the rules, as a person would fix it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Violation {
    file: String,
    line: usize,
    what: String,
}

fn layer_rank(name: &str) -> Option<usize> {
    LAYERS.iter().position(|l| *l == name)
}

/// The module a source file belongs to: (layer, unit), where the unit is the
/// layer's second-level module (`tiers::g3`) or the layer itself (`node`).
fn unit_of(rel: &Path) -> Option<(String, String)> {
    let parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    let layer = parts.first()?.clone();
    layer_rank(&layer)?;
    let unit = match parts.get(1) {
        Some(m) if parts.len() > 1 && m != "mod" && layer != "node" => format!("{layer}::{m}"),
        _ => layer.clone(),
    };
    Some((layer, unit))
}

/// The source with test-only code blanked out (lines kept, so that line
/// numbers still match): every `#[cfg(test)]` item that opens a brace block.
fn strip_tests(src: &str) -> String {
    let bytes = src.as_bytes();
    let mut out = bytes.to_vec();
    let mut from = 0;
    while let Some(at) = src[from..].find("#[cfg(test)]") {
        let start = from + at;
        // The item's block: from the first `{` (or an item ending in `;`).
        let rest = &src[start..];
        let brace = rest.find('{');
        let semi = rest.find(';');
        let open = match (brace, semi) {
            (Some(b), Some(s)) if s < b => {
                from = start + s + 1;
                blank(&mut out, start, start + s + 1);
                continue;
            }
            (Some(b), _) => start + b,
            _ => break,
        };
        let end = matching_brace(bytes, open).unwrap_or(bytes.len());
        blank(&mut out, start, end);
        from = end;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn blank(out: &mut [u8], from: usize, to: usize) {
    let to = to.min(out.len());
    for b in &mut out[from..to] {
        if *b != b'\n' {
            *b = b' ';
        }
    }
}

/// The index just past the brace that closes the one at `open`, skipping
/// string and character literals and comments.
fn matching_brace(b: &[u8], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    let mut i = open;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    if b[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
            }
            b'\'' if b.get(i + 2) == Some(&b'\'') => i += 2,
            b'\'' if b.get(i + 1) == Some(&b'\\') => {
                while i + 1 < b.len() && b[i + 1] != b'\'' {
                    i += 1;
                }
                i += 1;
            }
            b'{' => depth += 1,
            b'}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// Every `crate::<layer>::<module>` path in `src`, with its line.
fn imports(src: &str) -> Vec<(usize, String, Option<String>)> {
    let mut found = Vec::new();
    for (n, line) in src.lines().enumerate() {
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            let before = &rest[..at];
            let path = &rest[at + "crate::".len()..];
            rest = path;
            // `kvtier_daemon::` is this crate too; `other_crate::` is not.
            if before.ends_with(|c: char| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let mut segs = path.split("::").map(|s| {
                s.chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect::<String>()
            });
            let Some(top) = segs.next() else { continue };
            let second = segs.next().filter(|s| !s.is_empty());
            found.push((n + 1, top, second));
        }
    }
    found
}

/// Checks the tree under `src` (a crate's `src/`).
fn check(src_dir: &Path) -> std::io::Result<(Vec<Violation>, usize)> {
    let mut violations = Vec::new();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut seen = 0usize;
    for file in rust_files(src_dir)? {
        let rel = file.strip_prefix(src_dir).unwrap_or(&file).to_path_buf();
        let name = rel.file_name().map(|n| n.to_string_lossy().into_owned());
        let is_test_file = name
            .as_deref()
            .is_some_and(|n| n == "tests.rs" || n.starts_with("tests_"));
        let Some((layer, unit)) = unit_of(&rel) else {
            // Outside the layers: only the crate root, the binary, this
            // check and the test kit; any other module must join a layer.
            let top = rel.iter().next().map(|p| p.to_string_lossy().into_owned());
            let allowed = ["lib.rs", "main.rs", "layering.rs", "testkit"];
            if !top.as_deref().is_some_and(|t| allowed.contains(&t)) {
                violations.push(Violation {
                    file: rel.display().to_string(),
                    line: 0,
                    what: format!("a module outside the layers ({})", LAYERS.join(", ")),
                });
            }
            continue;
        };
        if is_test_file {
            continue;
        }
        let text = strip_tests(&std::fs::read_to_string(&file)?);
        let rank = layer_rank(&layer).unwrap_or(0);
        for (line, top, second) in imports(&text) {
            seen += 1;
            let file = rel.display().to_string();
            if top == "testkit" {
                violations.push(Violation {
                    file,
                    line,
                    what: format!(
                        "product code in `{unit}` imports the test scaffolding `testkit`"
                    ),
                });
                continue;
            }
            let Some(dep_rank) = layer_rank(&top) else {
                continue;
            };
            if dep_rank > rank {
                violations.push(Violation {
                    file,
                    line,
                    what: format!("`{unit}` (layer {layer}) imports `{top}`, a layer above it"),
                });
                continue;
            }
            let dep_unit = match second {
                Some(m) if top != "node" && dep_rank == rank => format!("{top}::{m}"),
                _ => top.clone(),
            };
            if dep_unit != unit {
                edges.entry(unit.clone()).or_default().insert(dep_unit);
            }
        }
    }
    for cycle in cycles(&edges) {
        violations.push(Violation {
            file: String::new(),
            line: 0,
            what: format!("import cycle: {}", cycle.join(" -> ")),
        });
    }
    violations.sort();
    Ok((violations, seen))
}

/// One cycle per strongly connected set of more than one module (as a path
/// that returns to its start).
fn cycles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut reported: BTreeSet<String> = BTreeSet::new();
    for start in edges.keys() {
        if reported.contains(start) {
            continue;
        }
        // Depth-first search for a path from `start` back to itself.
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        let mut visited = BTreeSet::new();
        while let Some((at, path)) = stack.pop() {
            for next in edges.get(&at).into_iter().flatten() {
                if next == start {
                    let mut cycle = path.clone();
                    cycle.push(start.clone());
                    reported.extend(path.iter().cloned());
                    out.push(cycle);
                    stack.clear();
                    break;
                }
                if visited.insert(next.clone()) {
                    let mut p = path.clone();
                    p.push(next.clone());
                    stack.push((next.clone(), p));
                }
            }
        }
    }
    out
}

fn rust_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(v: &[Violation]) -> String {
        v.iter()
            .map(|v| format!("  {}:{}: {}", v.file, v.line, v.what))
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn the_daemon_layers_point_down_and_have_no_cycles() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let (violations, seen) = check(&src).unwrap();
        // The scan must see the imports it checks (a scanner that finds
        // nothing passes everything).
        assert!(
            seen > 200,
            "only {seen} crate:: imports found under {src:?}"
        );
        assert!(
            violations.is_empty(),
            "the daemon's layers (base < tiers < node < edges < app) are broken:\n{}",
            report(&violations)
        );
    }

    fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let p = d.path().join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        d
    }

    #[test]
    fn an_upward_import_is_found() {
        let d = tree(&[
            ("base/error.rs", "pub enum Error {}\n"),
            (
                "tiers/g3/write.rs",
                "use crate::base::error::Error;\nuse crate::edges::server::Server;\n",
            ),
            ("edges/server/mod.rs", "use crate::tiers::g3::G3Store;\n"),
        ]);
        let (v, _) = check(d.path()).unwrap();
        assert_eq!(v.len(), 1, "{}", report(&v));
        assert_eq!(v[0].file, "tiers/g3/write.rs");
        assert_eq!(v[0].line, 2);
    }

    #[test]
    fn a_module_outside_the_layers_is_found() {
        let d = tree(&[
            ("lib.rs", "pub mod base;\npub mod id_floor;\n"),
            ("base/error.rs", "pub enum Error {}\n"),
            ("id_floor.rs", "use crate::base::error::Error;\n"),
        ]);
        let (v, _) = check(d.path()).unwrap();
        assert_eq!(v.len(), 1, "{}", report(&v));
        assert_eq!(v[0].file, "id_floor.rs");
    }

    #[test]
    fn a_cycle_inside_a_layer_is_found() {
        let d = tree(&[
            (
                "edges/server/mod.rs",
                "use crate::edges::metrics::Metrics;\n",
            ),
            (
                "edges/metrics.rs",
                "fn f() { crate::edges::server::serve(); }\n",
            ),
        ]);
        let (v, _) = check(d.path()).unwrap();
        assert_eq!(v.len(), 1, "{}", report(&v));
        assert!(v[0].what.contains("import cycle"), "{}", report(&v));
    }

    #[test]
    fn test_code_and_scaffolding_are_told_apart() {
        let d = tree(&[
            (
                "base/tier.rs",
                "pub trait T {}\n#[cfg(test)]\nmod tests {\n    use crate::app::config::Config;\n    fn s() { let _ = \"}\"; }\n}\n",
            ),
            ("tiers/g3/tests.rs", "use crate::app::config::Config;\n"),
            ("node/mod.rs", "use crate::testkit::s3::S3Server;\n"),
        ]);
        let (v, _) = check(d.path()).unwrap();
        assert_eq!(v.len(), 1, "{}", report(&v));
        assert!(v[0].what.contains("testkit"), "{}", report(&v));
    }
}
