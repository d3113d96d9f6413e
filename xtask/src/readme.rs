//! Checks of the READMEs (run by `cargo test`, so by `cargo xtask ci`): their
//! Rust snippets hide no line (a reader copies what is shown; the doctests
//! compile the same text), and their relative links name files that exist
//! (intra-doc links are `cargo doc`'s to check).

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    /// Every README.md of the workspace, but `target/`'s.
    fn readmes() -> Vec<PathBuf> {
        fn walk(dir: &Path, found: &mut Vec<PathBuf>) {
            let Ok(entries) = std::fs::read_dir(dir) else {
                return;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                let name = entry.file_name();
                if path.is_dir() {
                    if name != "target" && !name.to_string_lossy().starts_with('.') {
                        walk(&path, found);
                    }
                } else if name == "README.md" {
                    found.push(path);
                }
            }
        }
        let root = idem_testkit::shell::workspace_root();
        let mut found = Vec::new();
        walk(&root, &mut found);
        found.sort();
        found
    }

    /// Whether rustdoc reads a fence with this info string as Rust (and
    /// hides its `# ` lines): when it is empty or names only rustdoc's own
    /// attributes (`no_run`, `ignore`, `edition2021`, …).
    fn is_rust(info: &str) -> bool {
        info.split([',', ' '])
            .filter(|token| !token.is_empty())
            .all(|token| {
                matches!(
                    token,
                    "rust" | "no_run" | "ignore" | "should_panic" | "compile_fail" | "test_harness"
                ) || token.starts_with("edition")
                    || token.starts_with("ignore-")
            })
    }

    #[test]
    fn rustdoc_reads_bare_and_attribute_fences_as_rust() {
        for rust in ["", "rust", "no_run", "rust,no_run", "ignore", "edition2021"] {
            assert!(is_rust(rust), "{rust:?}");
        }
        for other in ["sh", "text", "toml", "console", "json"] {
            assert!(!is_rust(other), "{other:?}");
        }
    }

    #[test]
    fn readme_rust_snippets_hide_no_line() {
        let mut hidden = Vec::new();
        for readme in readmes() {
            let text = std::fs::read_to_string(&readme).unwrap_or_default();
            let mut in_rust = false;
            for (n, line) in text.lines().enumerate() {
                if let Some(fence) = line.strip_prefix("```") {
                    in_rust = !in_rust && is_rust(fence);
                    continue;
                }
                if in_rust && (line == "#" || line.starts_with("# ")) {
                    hidden.push(format!("{}:{}: {line}", readme.display(), n + 1));
                }
            }
        }
        assert!(
            hidden.is_empty(),
            "README snippets must be complete as shown, without hidden lines:\n{}",
            hidden.join("\n")
        );
    }

    #[test]
    fn readme_relative_links_name_files_that_exist() {
        let mut broken = Vec::new();
        for readme in readmes() {
            let text = std::fs::read_to_string(&readme).unwrap_or_default();
            let dir = readme.parent().map(Path::to_path_buf).unwrap_or_default();
            let mut in_code = false;
            for (n, line) in text.lines().enumerate() {
                if line.starts_with("```") {
                    in_code = !in_code;
                    continue;
                }
                if in_code {
                    continue;
                }
                let mut rest = line;
                while let Some(start) = rest.find("](") {
                    let after = &rest[start + 2..];
                    let Some(end) = after.find(')') else { break };
                    let target = &after[..end];
                    rest = &after[end..];
                    // A file: a path with a `/` or an extension; not a URL, an
                    // anchor, or an intra-doc link (`Type`, `module::item`: the
                    // crate READMEs are crate docs, which `cargo doc` checks).
                    let relative = !target.contains("://")
                        && !target.starts_with('#')
                        && !target.starts_with("mailto:")
                        && !target.contains("::")
                        && (target.contains('/') || target.contains('.'));
                    let file = target.split('#').next().unwrap_or_default();
                    if relative && !file.is_empty() && !dir.join(file).exists() {
                        broken.push(format!("{}:{}: {target}", readme.display(), n + 1));
                    }
                }
            }
        }
        assert!(
            broken.is_empty(),
            "README links to files that do not exist:\n{}",
            broken.join("\n")
        );
    }
}
