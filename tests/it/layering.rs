//! The house has no circles: `scripts/check_imports.py` builds the file-level
//! import graph of `crates/core/src` and `src/` from the code's own imports
//! and finds no circle of files and no arrow back up its layer table. Known
//! violations in `src/` being fixed on other branches are listed, as
//! pending, in `scripts/check_imports.allow` (none in `crates/core`, which
//! takes no allowance). The checker's own self-test runs first, so a checker
//! that cannot fail cannot pass.
//!
//! Runs `$WEIGHTCAST_PYTHON` when set, else `python3` from `PATH` (the
//! script needs only the standard library).

use std::path::Path;
use std::process::Command;

fn python() -> String {
    std::env::var("WEIGHTCAST_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// `check_imports.py ARGS`: its exit status and everything it printed.
fn check_imports(args: &[&str]) -> (bool, String) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let script = root.join("scripts/check_imports.py");
    let out = Command::new(python())
        .arg(&script)
        .args(args)
        .current_dir(root)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `{} {}`: {e} (set WEIGHTCAST_PYTHON to a Python 3.11)",
                python(),
                script.display()
            )
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The checker reports a circle and an arrow back up in a synthetic tree
/// (and ignores facades, tests, comments and strings).
#[test]
fn the_checker_finds_circles_and_arrows_back_up() {
    let (ok, text) = check_imports(&["--self-test"]);
    assert!(ok, "the import checker's self-test failed:\n{text}");
}

/// No circle of files and no arrow back up in `crates/core/src` and `src/`,
/// but the pending ones the allowance file names.
#[test]
fn no_circle_and_no_arrow_back_up() {
    let (ok, text) = check_imports(&["--allow", "scripts/check_imports.allow"]);
    assert!(ok, "import violations (scripts/check_imports.py):\n{text}");
}
