//! `cargo xtask ci`: everything CI checks, in the order that fails fastest.

use crate::shell::{self, cargo};

/// idem-diesel's feature sets, each checked alone, with the database client that
/// must stay out of the build under it (`None`: nothing to prove).
const STORE_FEATURE_SETS: &[(&[&str], Option<&str>)] = &[
    (
        &["--no-default-features", "--features", "sqlite"],
        Some("tokio-postgres"),
    ),
    (
        &["--no-default-features", "--features", "postgres"],
        Some("libsqlite3-sys"),
    ),
    (&["--no-default-features"], None),
];

/// Runs formatting, clippy, each store feature set alone, docs, every test, the
/// end-to-end run of both examples on every store, and the benchmarks' quick
/// mode; stops at the first failure.
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
    store_feature_sets()?;
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

/// Checks idem-diesel under each feature set alone (so a backend's code does not
/// lean on the other's), and proves with `cargo tree` that a SQLite-only build
/// compiles no PostgreSQL client and a PostgreSQL-only build no SQLite.
fn store_feature_sets() -> Result<(), String> {
    for (features, absent) in STORE_FEATURE_SETS {
        let flags = features.join(" ");
        let mut check = vec!["check", "-p", "idem-diesel"];
        check.extend_from_slice(features);
        shell::run(
            &format!("cargo check -p idem-diesel {flags}"),
            &mut cargo(&check),
        )?;
        let Some(absent) = absent else { continue };
        let mut tree = vec![
            "tree",
            "-p",
            "idem-diesel",
            "-e",
            "normal",
            "--prefix",
            "none",
        ];
        tree.extend_from_slice(features);
        let step = format!("cargo tree -p idem-diesel {flags}: no {absent}");
        eprintln!("\n==> {step}");
        let output = cargo(&tree)
            .output()
            .map_err(|e| format!("{step}: could not start: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "{step} failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        let listed = String::from_utf8_lossy(&output.stdout);
        if depends_on(&listed, absent) {
            return Err(format!(
                "{step}: idem-diesel {flags} still depends on {absent}; \
                 see `cargo tree -p idem-diesel {flags} -e normal -i {absent}`"
            ));
        }
    }
    Ok(())
}

/// Whether `cargo tree --prefix none` output lists the package `name`.
fn depends_on(tree: &str, name: &str) -> bool {
    tree.lines()
        .any(|line| line.split_whitespace().next() == Some(name))
}

#[cfg(test)]
mod tests {
    use super::depends_on;

    #[test]
    fn depends_on_matches_whole_package_names() {
        let tree = "idem-diesel v0.1.0 (/w/idem-diesel)\n\
                    diesel v2.3.14\n\
                    libsqlite3-sys v0.35.0\n\
                    tokio-postgres-extra v1.0.0\n";
        assert!(depends_on(tree, "libsqlite3-sys"));
        assert!(depends_on(tree, "diesel"));
        assert!(!depends_on(tree, "tokio-postgres"));
        assert!(!depends_on(tree, "diesel-async"));
    }
}
