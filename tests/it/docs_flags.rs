//! The docs against the binary's own parser: docs/operations.md's flag
//! reference lists every flag of every command, and README.md's commands use
//! only real commands and flags and name every command there is. Commands and
//! flags come from `weightcast [COMMAND...] --help`; a concrete command line is
//! parsed by the binary itself (its arguments followed by `--help`: clap
//! checks every argument before it, values included, and prints the help only
//! if all are valid). `deploy_files.rs` checks the deploy files the same way.

use std::process::{Command, Output};

/// `weightcast ARGS` with an empty environment (no `WEIGHTCAST_*` from the
/// test's own environment can stand in for a flag).
pub(crate) fn weightcast<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_weightcast"))
        .args(args)
        .env_clear()
        .output()
        .expect("running the weightcast binary")
}

/// `weightcast PATH --help`, which must succeed.
pub(crate) fn help_text(path: &[String]) -> String {
    let out = weightcast(&[path, &["--help".to_string()][..]].concat());
    assert!(out.status.success(), "weightcast {path:?} --help failed");
    String::from_utf8(out.stdout).unwrap()
}

/// Whether the binary's parser accepts `weightcast ARGV` (ARGV + `--help`).
pub(crate) fn parses(argv: &[String]) -> Result<(), String> {
    let out = weightcast(&[argv, &["--help".to_string()][..]].concat());
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    Err(format!(
        "weightcast rejects `{}`: {}",
        argv.join(" "),
        err.lines().next().unwrap_or("").trim()
    ))
}

/// Every command the binary has, as the word paths that run it (`publish`,
/// `bench codec`): the leaves of the `Commands:` sections of the help.
pub(crate) fn command_paths() -> Vec<Vec<String>> {
    fn walk(path: Vec<String>, out: &mut Vec<Vec<String>>) {
        let help = help_text(&path);
        let subs: Vec<String> = help
            .lines()
            .skip_while(|l| !l.starts_with("Commands:"))
            .skip(1)
            .take_while(|l| l.starts_with("  "))
            .filter(|l| !l.starts_with("   "))
            .filter_map(|l| l.split_whitespace().next().map(str::to_string))
            .filter(|c| c != "help")
            .collect();
        if subs.is_empty() {
            out.push(path.clone());
        }
        for s in subs {
            walk([path.clone(), vec![s]].concat(), out);
        }
    }
    let mut out = Vec::new();
    walk(Vec::new(), &mut out);
    out
}

/// The flags (`--long` and `-s`) a command's help lists, `--help` excluded.
pub(crate) fn flags(path: &[String]) -> Vec<String> {
    help_text(path)
        .lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with('-'))
        .flat_map(|l| {
            l.split([' ', ','])
                .take_while(|w| w.starts_with('-') || w.is_empty())
                .filter(|w| !w.is_empty())
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .filter(|f| f != "--help" && f != "-h")
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
            // "every command" rows document the global flags.
            inside = first == "every command"
                || first.split(", ").any(|c| c.trim_matches('`') == command);
        }
        if inside {
            rows.push_str(line);
            rows.push('\n');
        }
    }
    rows
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel))
        .unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

#[test]
fn every_flag_is_documented() {
    let doc = read("docs/operations.md");
    let mut missing = Vec::new();
    for path in command_paths() {
        let name = path.join(" ");
        let rows = documented(&doc, &name);
        for flag in flags(&path) {
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
    let f = flags(&["gc".to_string()]);
    assert!(
        f.contains(&"--dry-run".to_string()) && f.contains(&"--store".to_string()),
        "{f:?}"
    );
    assert!(flags(&["publish".to_string()]).contains(&"-q".to_string()));
    let paths = command_paths();
    assert!(paths.contains(&vec!["bench".to_string(), "codec".to_string()]));
    assert!(paths.contains(&vec!["subscribe".to_string()]));
    assert!(!paths.contains(&vec!["bench".to_string()]));
    let doc = "| `gc` | `--store URL` | x |\n| | `--dry-run` | y |\n| `demo` | `--dir` | z |\n";
    let rows = documented(doc, "gc");
    assert!(rows.contains("`--dry-run") && !rows.contains("`--dir"));
    assert!(documented(doc, "publish").is_empty());
}

// ---------------------------------------------------------------------------
// README.md

/// `(line, words after "weightcast")` of every command line in the markdown's
/// shell blocks (a `# comment` dropped), and the lines of the first block after
/// the heading `list_heading` (the command list).
fn readme_commands(md: &str, list_heading: &str) -> (Vec<(String, Vec<String>)>, Vec<String>) {
    let (mut lines, mut list) = (Vec::new(), Vec::new());
    let (mut in_block, mut after_heading, mut list_done) = (false, false, false);
    for line in md.lines() {
        if line.starts_with("```") {
            in_block = !in_block && line.trim_start_matches('`').starts_with("sh");
            if !in_block && after_heading {
                list_done = true;
            }
            continue;
        }
        if line.starts_with('#') && !in_block {
            after_heading = line.trim_start_matches('#').trim() == list_heading;
            continue;
        }
        if !in_block {
            continue;
        }
        let code = line.split(" #").next().unwrap_or("");
        let words: Vec<&str> = code.split_whitespace().collect();
        if let Some(i) = words.iter().position(|w| *w == "weightcast") {
            let rest = words[i + 1..].iter().map(|w| w.to_string()).collect();
            lines.push((code.trim().to_string(), rest));
            if after_heading && !list_done {
                list.push(code.trim().to_string());
            }
        }
    }
    (lines, list)
}

/// Checks one README command line (`words` after `weightcast`): its command
/// exists, every flag it shows is one the command has, and a concrete line
/// (no `[…]`, `a|b`, `...` or UPPERCASE placeholder) parses as written.
fn check_readme_line(words: &[String], paths: &[Vec<String>]) -> Result<(), String> {
    let path = paths
        .iter()
        .filter(|p| words.starts_with(p.as_slice()))
        .max_by_key(|p| p.len())
        .ok_or_else(|| format!("`{}` is not a weightcast command", words.join(" ")))?;
    let known = flags(path);
    for w in &words[path.len()..] {
        let flag = w.trim_start_matches('[').trim_end_matches(['.', ']']);
        let flag = flag.split(['=', '|']).next().unwrap_or(flag);
        if flag.starts_with('-') && !known.iter().any(|k| k == flag) {
            return Err(format!("`weightcast {}` has no {flag}", path.join(" ")));
        }
    }
    let placeholder = |w: &String| {
        w.chars().any(|c| c.is_ascii_uppercase()) && !w.chars().any(|c| c.is_ascii_lowercase())
    };
    let synopsis = words
        .iter()
        .any(|w| w.contains(['[', ']', '|']) || w.contains("...") || placeholder(w));
    if synopsis { Ok(()) } else { parses(words) }
}

const COMMAND_LIST: &str = "Commands today";

/// Problems of a README: lines with unknown commands or flags, and commands
/// the binary has that its command list lacks.
fn readme_problems(md: &str) -> Vec<String> {
    let paths = command_paths();
    let (lines, list) = readme_commands(md, COMMAND_LIST);
    let mut problems: Vec<String> = lines
        .iter()
        .filter_map(|(line, words)| {
            check_readme_line(words, &paths)
                .err()
                .map(|e| format!("{line}: {e}"))
        })
        .collect();
    for p in &paths {
        let cmd = format!("weightcast {} ", p.join(" "));
        if !list.iter().any(|l| format!("{l} ").contains(&cmd)) {
            problems.push(format!(
                "`{}` is missing from \"{COMMAND_LIST}\"",
                cmd.trim()
            ));
        }
    }
    problems
}

#[test]
fn readme_commands_match_the_binary() {
    let md = read("README.md");
    let (lines, list) = readme_commands(&md, COMMAND_LIST);
    assert!(
        list.len() >= command_paths().len() && lines.len() > list.len(),
        "{lines:?}"
    );
    let problems = readme_problems(&md);
    assert!(problems.is_empty(), "README.md:\n{}", problems.join("\n"));
}

#[test]
fn the_readme_checker_catches_mistakes() {
    let md = read("README.md");
    let line =
        "weightcast gc --store URL [--keep-anchors K] [--registration-max-age S] [--dry-run]";
    assert!(md.contains(line), "README.md no longer has `{line}`");
    for (broken, want) in [
        (
            md.replacen("[--dry-run]", "[--dry-rum]", 1),
            "has no --dry-rum",
        ),
        (
            md.replacen("weightcast gc ", "weightcast gcc ", 1),
            "`gcc --store",
        ),
        (md.replacen(line, "", 1), "`weightcast gc` is missing"),
        (
            md.replacen("--once\n", "--once --poll-interval soon\n", 1),
            "rejects `subscribe",
        ),
    ] {
        let problems = readme_problems(&broken);
        assert!(
            problems.iter().any(|p| p.contains(want)),
            "expected `{want}` in {problems:#?}"
        );
    }
    // A concrete line is parsed by the binary; a synopsis only by its words.
    let paths = command_paths();
    let words = |s: &str| s.split_whitespace().map(str::to_string).collect::<Vec<_>>();
    check_readme_line(&words("demo --steps 6 --json"), &paths).unwrap();
    check_readme_line(&words("demo [--steps N]"), &paths).unwrap();
    assert!(check_readme_line(&words("demo --steps six"), &paths).is_err());
    assert!(check_readme_line(&words("bench codex [--steps N]"), &paths).is_err());
}
