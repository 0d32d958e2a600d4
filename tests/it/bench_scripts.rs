//! The Redis benches written as shell scripts (`make bench-lua`, `make bench-due-layouts`), run
//! small. Each starts and removes a redis-server of its own. The layout prototypes of bench-lua
//! run after the due queue script's own prologue, so a change to that script that breaks them
//! shows here, not at the next benchmark run.

use std::path::Path;
use std::process::Command;

/// Runs `script` (a path from the package's root) with `args` and `env`, and returns its output;
/// the test fails with the script's stderr when it does not end with status 0.
fn run(script: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("bash")
        .arg(root.join(script))
        .args(args)
        .envs(env.iter().copied())
        .current_dir(root)
        .output()
        .expect("run bash");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("the script's output is UTF-8")
}

/// The rows of the table under the line that starts with `title`: its lines after the column
/// header, up to the first blank one.
fn table<'a>(text: &'a str, title: &str) -> Vec<&'a str> {
    text.lines()
        .skip_while(|line| !line.starts_with(title))
        .skip(2)
        .take_while(|line| !line.trim().is_empty())
        .collect()
}

/// Column `column` (from 0) of each row, split at whitespace.
fn column<'a>(rows: &[&'a str], column: usize) -> Vec<&'a str> {
    rows.iter()
        .map(|row| row.split_whitespace().nth(column).unwrap_or(""))
        .collect()
}

/// Whether `figure` (digits, maybe with thousands' commas and a decimal point) is above zero.
fn positive(figure: &str) -> bool {
    figure
        .replace(',', "")
        .parse::<f64>()
        .is_ok_and(|value| value > 0.0)
}

#[test]
fn bench_lua_measures_the_due_queue_and_both_layout_prototypes_on_a_few_polls() {
    let text = run(
        "benches/lua_cost.sh",
        &["jobs/src/due_queue.lua", "64"],
        &[],
    );

    let due_queue = table(&text, "due queue: fetch");
    assert_eq!(column(&due_queue, 0)[..4], ["1", "4", "16", "32"], "{text}");
    // One row per bucket count and per slot width, each with its cost per poll (the script
    // checked every round's fetch and batch as they ran).
    let buckets = table(&text, "bucketed layout");
    assert_eq!(
        column(&buckets, 0),
        ["1", "8", "32", "128", "512"],
        "{text}"
    );
    assert!(
        column(&buckets, 2).iter().all(|cost| positive(cost)),
        "{text}"
    );
    let wheel = table(&text, "timing wheel");
    assert_eq!(column(&wheel, 0), ["1000", "5000"], "{text}");
    assert!(
        column(&wheel, 1).iter().all(|cost| positive(cost)),
        "{text}"
    );
}

#[test]
fn bench_due_layouts_measures_every_layout_on_a_few_cards() {
    let text = run("benches/due_layouts.sh", &[], &[("BENCH_CARDS", "400")]);

    // The table's rows, past its header and the separator under it.
    let rows: Vec<&str> = text
        .lines()
        .filter(|line| line.starts_with("| "))
        .skip(2)
        .collect();
    let names: Vec<&str> = rows
        .iter()
        .map(|row| row.split('|').nth(1).unwrap_or("").trim())
        .collect();
    assert_eq!(names.len(), 11, "{text}");
    assert_eq!(names[0], "today");
    // Rows per layout: three slot widths or bucket sizes each, one for the wheel as planned.
    let rows_of = |layout: &str| names.iter().filter(|name| name.starts_with(layout)).count();
    assert_eq!(
        [
            rows_of("wheel with a hash"),
            rows_of("wheel, entries"),
            rows_of("wheel as planned"),
            rows_of("card-hashed"),
        ],
        [3, 3, 1, 3],
        "{text}"
    );
    // Each layout's records took memory: bytes per card, the row's last column.
    for row in rows {
        let bytes: u64 = row
            .rsplit('|')
            .nth(1)
            .and_then(|bytes| bytes.trim().parse().ok())
            .unwrap_or(0);
        assert!(bytes > 0, "{row}");
    }
}
