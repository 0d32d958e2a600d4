//! The layering of `src/` holds: every `crate::` path points down the layers of docs/DESIGN.md,
//! never up and never sideways between two modules of one layer (two jobs, say).
//!
//! The layer table is read from docs/DESIGN.md's "Layering" section, so the document and the
//! check cannot drift apart: a module missing from the table, or an import against it, fails here
//! with the file, the line and the rule it breaks.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Module name -> layer number, from the table in docs/DESIGN.md.
fn layers() -> BTreeMap<String, u32> {
    let design = std::fs::read_to_string(root().join("docs/DESIGN.md")).expect("docs/DESIGN.md");
    let section = design
        .split("\n## ")
        .find(|s| s.starts_with("Layering"))
        .expect("docs/DESIGN.md has a '## Layering' section");
    let mut out = BTreeMap::new();
    for line in section.lines() {
        // | 2 | `storage`, `gateway` | … |
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let (Some(layer), Some(modules)) = (cells.get(1), cells.get(2)) else {
            continue;
        };
        let Ok(layer) = layer.parse::<u32>() else {
            continue;
        };
        for module in modules.split(',') {
            let name = module.trim().trim_matches('`');
            assert!(!name.is_empty(), "empty module name in layer {layer}");
            let before = out.insert(name.to_owned(), layer);
            assert!(
                before.is_none(),
                "{name} is listed twice in the layer table"
            );
        }
    }
    assert!(
        out.len() > 5,
        "the layer table in docs/DESIGN.md looks empty: {out:?}"
    );
    out
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file of `src/` belongs to (`None` for the crate roots and binaries).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).expect("under src");
    let first = rel.components().next()?.as_os_str().to_str()?.to_owned();
    if rel.components().count() == 1 {
        let stem = first.trim_end_matches(".rs");
        return (!matches!(stem, "lib" | "main")).then(|| stem.to_owned());
    }
    (first != "bin").then_some(first)
}

/// Every top-level module named by a `crate::` path on one line of code, with `use crate::{a,
/// b::c}` groups expanded (a group may span lines: `open_group` carries it).
fn targets(line: &str, open_group: &mut bool) -> Vec<String> {
    let mut out = Vec::new();
    let code = line.split("//").next().unwrap_or("");
    if *open_group {
        out.extend(group_heads(code));
        if code.contains("};") {
            *open_group = false;
        }
        return out;
    }
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = &rest[..at];
        let is_path_start = before
            .chars()
            .last()
            .is_none_or(|c| !(c.is_alphanumeric() || c == '_' || c == ':'));
        let after = &rest[at + "crate::".len()..];
        if is_path_start {
            if let Some(group) = after.strip_prefix('{') {
                out.extend(group_heads(group));
                if !group.contains('}') {
                    *open_group = true;
                }
            } else {
                let head: String = after
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !head.is_empty() {
                    out.push(head);
                }
            }
        }
        rest = after;
    }
    out
}

/// The first path segment of each item of a `{…}` group (`a`, `b` of `a::x, b::{y, z}`).
fn group_heads(group: &str) -> Vec<String> {
    let mut items = vec![String::new()];
    let mut depth = 0;
    for c in group.chars() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => items.push(String::new()),
            c if depth == 0 => items.last_mut().expect("one item").push(c),
            _ => {}
        }
    }
    items
        .iter()
        .map(|item| {
            item.trim()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect::<String>()
        })
        .filter(|head| !head.is_empty() && head != "self")
        .collect()
}

#[test]
fn every_import_in_src_points_down_the_layers_of_the_design_document() {
    let layers = layers();
    let src = root().join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut problems = Vec::new();
    for file in &files {
        let Some(module) = module_of(&src, file) else {
            continue;
        };
        let shown = file.strip_prefix(root()).unwrap_or(file).display();
        let Some(&own) = layers.get(&module) else {
            problems.push(format!(
                "{shown}: module `{module}` is not in docs/DESIGN.md's layer table"
            ));
            continue;
        };
        let text = std::fs::read_to_string(file).expect("read");
        let mut open_group = false;
        for (n, line) in text.lines().enumerate() {
            for target in targets(line, &mut open_group) {
                if target == module {
                    continue;
                }
                let Some(&theirs) = layers.get(&target) else {
                    problems.push(format!(
                        "{shown}:{}: `crate::{target}` is not in docs/DESIGN.md's layer table",
                        n + 1
                    ));
                    continue;
                };
                let rule = if theirs > own {
                    "points up"
                } else if theirs == own {
                    "points sideways"
                } else {
                    continue;
                };
                problems.push(format!(
                    "{shown}:{}: `{module}` (layer {own}) imports `crate::{target}` (layer {theirs}): {rule}",
                    n + 1
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "imports against the layering:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_import_scanner_sees_plain_paths_groups_and_multi_line_groups() {
    let mut open = false;
    assert_eq!(targets("use crate::config::Task;", &mut open), ["config"]);
    assert_eq!(
        targets("let x = crate::storage::connect(&c).await?;", &mut open),
        ["storage"]
    );
    assert_eq!(
        targets("use crate::{app, telemetry::{self, http}};", &mut open),
        ["app", "telemetry"]
    );
    assert!(!open);
    assert_eq!(targets("use crate::{", &mut open), Vec::<String>::new());
    assert!(open);
    assert_eq!(
        targets("    budget::Budget, polling::chain,", &mut open),
        ["budget", "polling"]
    );
    assert_eq!(targets("};", &mut open), Vec::<String>::new());
    assert!(!open);
    assert!(targets("// see crate::workers", &mut open).is_empty());
    assert!(targets("use cardworker_jobs::Job;", &mut open).is_empty());
    assert!(targets("use my_crate::x;", &mut open).is_empty());
}
