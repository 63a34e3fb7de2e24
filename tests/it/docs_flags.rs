//! docs/operations.md's flag reference lists every flag of every command, as
//! the binary's own parser reports them (`<command> --help`).

use std::process::Command;

const COMMANDS: &[&[&str]] = &[
    &["publish"],
    &["publisher"],
    &["subscribe"],
    &["status"],
    &["gc"],
    &["demo"],
    &["diff"],
    &["apply"],
    &["inspect"],
    &["bench", "codec"],
    &["bench", "anchors"],
];

/// The long flags a command's help lists (`--help` itself excluded).
fn flags(command: &[&str]) -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_weightcast"))
        .args(command)
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success(), "{command:?} --help");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l
                .strip_prefix("-")
                .and_then(|r| r.split_once(", "))
                .map_or(l, |(_, r)| r);
            let flag: String = l
                .strip_prefix("--")?
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            (flag != "help").then(|| format!("--{flag}"))
        })
        .collect()
}

/// The reference rows of `command` in the flag table: rows from the one that
/// names the command up to the next row that names another.
fn documented(doc: &str, command: &str) -> String {
    let mut rows = String::new();
    let mut inside = false;
    for line in doc.lines().filter(|l| l.starts_with("| ")) {
        let first = line.split('|').nth(1).unwrap_or("").trim();
        if !first.is_empty() {
            inside = first.split(", ").any(|c| c.trim_matches('`') == command);
        }
        if inside {
            rows.push_str(line);
            rows.push('\n');
        }
    }
    rows
}

#[test]
fn every_flag_is_documented() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    let mut missing = Vec::new();
    for command in COMMANDS {
        let name = command.join(" ");
        let rows = documented(&doc, &name);
        for flag in flags(command) {
            if !rows.contains(&format!("`{flag}")) {
                missing.push(format!("{name} {flag}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "not in docs/operations.md's flag reference: {missing:?}"
    );
}

#[test]
fn the_checker_sees_flags_and_misses() {
    let f = flags(&["gc"]);
    assert!(
        f.contains(&"--dry-run".to_string()) && f.contains(&"--store".to_string()),
        "{f:?}"
    );
    let doc = "| `gc` | `--store URL` | x |\n| | `--dry-run` | y |\n| `demo` | `--dir` | z |\n";
    let rows = documented(doc, "gc");
    assert!(rows.contains("`--dry-run") && !rows.contains("`--dir"));
    assert!(documented(doc, "publish").is_empty());
}
