//! `cargo xtask ci`: everything CI checks, in the order that fails fastest.

use crate::shell::{self, cargo};

/// Runs formatting, clippy, docs, every test, the end-to-end run of both examples
/// on every store, and the benchmarks' quick mode; stops at the first failure.
pub(crate) fn run(_args: &[String]) -> Result<(), String> {
    shell::run(
        "cargo fmt --check",
        &mut cargo(&["fmt", "--all", "--", "--check"]),
    )?;
    shell::run(
        "cargo clippy (warnings denied)",
        &mut cargo(&[
            "clippy",
            "--workspace",
            "--all-targets",
            "--all-features",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    shell::run(
        "cargo doc (warnings denied)",
        cargo(&["doc", "--workspace", "--no-deps", "--all-features"])
            .env("RUSTDOCFLAGS", "-D warnings"),
    )?;
    // `cargo test`, not nextest: the database tests start one PostgreSQL cluster per
    // test binary, which nextest's process-per-test would multiply.
    shell::run(
        "cargo test",
        &mut cargo(&["test", "--workspace", "--all-features"]),
    )?;
    eprintln!("\n==> cargo xtask e2e");
    crate::e2e::run(&[])?;
    eprintln!("\n==> cargo xtask bench --quick");
    crate::bench::run(&["--quick".to_owned()])?;
    Ok(())
}
