//! `cargo xtask check [--since REV]`: the fast loop for a change.
//!
//! `cargo fmt --check`, then clippy (warnings denied) and the tests of the
//! workspace crates that changed and of every crate that depends on them,
//! directly or not. What changed is what git sees between `REV` (default
//! `HEAD`: the change not committed yet) and the work tree, untracked files
//! included. A change outside every crate (the workspace's manifest, the lock
//! file, cargo's configuration) checks every crate. The docs, the store
//! feature sets, the packages, the e2e run and the bench are `cargo xtask
//! ci`'s.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::process::Command;

use idem_testkit::shell;

use crate::steps::Steps;

/// A workspace member: its directory (from the root) and package name, and
/// the other members it depends on (any kind of dependency).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Member {
    pub(crate) dir: String,
    pub(crate) name: String,
    pub(crate) depends_on: Vec<String>,
}

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let since = match args {
        [] => "HEAD".to_owned(),
        [flag, rev] if flag == "--since" => rev.clone(),
        _ => return Err(format!("check takes [--since REV], not {}", args.join(" "))),
    };
    let mut steps = Steps::new("check");
    let result = every_step(&mut steps, &since);
    eprint!("{}", steps.table(result.is_ok()));
    result
}

fn every_step(steps: &mut Steps, since: &str) -> Result<(), String> {
    crate::ci::fmt(steps)?;
    let root = shell::workspace_root();
    let members = members(&root)?;
    let changed = changed_files(&root, since)?;
    let selected = affected(&members, &changed);
    if selected.is_empty() {
        eprintln!("\n==> check: no crate changed since {since}");
        return Ok(());
    }
    eprintln!(
        "\n==> check: {} crate(s) changed since {since} or depend on one: {}",
        selected.len(),
        selected.iter().cloned().collect::<Vec<_>>().join(", ")
    );
    // Clippy and the test build over the whole workspace: what did not change
    // is up to date already, and the dependencies keep the features the
    // workspace's build gives them (a `-p` selection resolves them anew, and
    // builds them again).
    crate::ci::clippy(steps, &["--workspace"])?;
    let packages: Vec<String> = selected.into_iter().collect();
    let counts = steps.time("tests", || crate::suite::run(&packages, || Ok(())))?;
    steps.total(counts.line("tests"));
    Ok(())
}

/// The workspace's members, read from the manifests.
pub(crate) fn members(root: &Path) -> Result<Vec<Member>, String> {
    member_dirs(root)?
        .into_iter()
        .map(|dir| member(&dir, &read(&root.join(&dir).join("Cargo.toml"))?))
        .collect()
}

/// The workspace's member directories, as its manifest lists them.
pub(crate) fn member_dirs(root: &Path) -> Result<Vec<String>, String> {
    let workspace = read(&root.join("Cargo.toml"))?;
    let dirs = workspace
        .split_once("members = [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| list)
        .ok_or("no `members = [...]` in the workspace's Cargo.toml")?;
    Ok(dirs
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
        .map(str::to_owned)
        .collect())
}

/// A file's text, or an error naming it.
pub(crate) fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// One member from its manifest: its name, and every key of a dependency
/// table (`[dependencies]`, `[dev-dependencies]`, `[build-dependencies]`,
/// and their `[target.….…]` forms). Which of those are members is decided
/// by [`affected`].
pub(crate) fn member(dir: &str, manifest: &str) -> Result<Member, String> {
    let mut name = None;
    let mut depends_on = Vec::new();
    let mut section = String::new();
    for line in manifest.lines().map(str::trim) {
        if let Some(header) = line.strip_prefix('[') {
            section = header.trim_end_matches(']').to_owned();
            continue;
        }
        let Some((key, _)) = line.split_once('=') else {
            continue;
        };
        let key = key.trim();
        if section == "package" && key == "name" {
            name = line
                .split_once('=')
                .map(|(_, value)| value.trim().trim_matches('"').to_owned());
        } else if section.ends_with("dependencies") && !key.starts_with('#') {
            let key = key.split('.').next().unwrap_or(key).trim_matches('"');
            depends_on.push(key.to_owned());
        }
    }
    Ok(Member {
        dir: dir.to_owned(),
        name: name.ok_or(format!("{dir}/Cargo.toml names no package"))?,
        depends_on,
    })
}

/// The files changed between `since` and the work tree, untracked ones too.
fn changed_files(root: &Path, since: &str) -> Result<Vec<String>, String> {
    let git = |args: &[&str]| -> Result<Vec<String>, String> {
        let output = Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .map_err(|e| format!("git {}: {e}", args.join(" ")))?;
        if !output.status.success() {
            return Err(format!(
                "git {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(str::to_owned)
            .collect())
    };
    let mut changed = git(&["diff", "--name-only", since, "--"])?;
    changed.extend(git(&["ls-files", "--others", "--exclude-standard"])?);
    Ok(changed)
}

/// The names of the members that `changed` files belong to, and of every
/// member that depends on one of them, directly or not; every member when a
/// file belongs to none (a workspace-wide file).
pub(crate) fn affected(members: &[Member], changed: &[String]) -> BTreeSet<String> {
    let mut selected = BTreeSet::new();
    for file in changed {
        // The deepest member directory holding the file.
        let owner = members
            .iter()
            .filter(|m| file.starts_with(&format!("{}/", m.dir)))
            .max_by_key(|m| m.dir.len());
        match owner {
            Some(member) => {
                selected.insert(member.name.clone());
            }
            None => return members.iter().map(|m| m.name.clone()).collect(),
        }
    }
    let names: BTreeSet<&str> = members.iter().map(|m| m.name.as_str()).collect();
    let mut dependents: HashMap<&str, Vec<&str>> = HashMap::new();
    for member in members {
        for dependency in member
            .depends_on
            .iter()
            .filter(|d| names.contains(d.as_str()))
        {
            dependents
                .entry(dependency.as_str())
                .or_default()
                .push(member.name.as_str());
        }
    }
    let mut queue: Vec<String> = selected.iter().cloned().collect();
    while let Some(name) = queue.pop() {
        for dependent in dependents.get(name.as_str()).into_iter().flatten() {
            if selected.insert((*dependent).to_owned()) {
                queue.push((*dependent).to_owned());
            }
        }
    }
    selected
}

#[cfg(test)]
mod tests {
    use super::{affected, member};

    #[test]
    fn a_change_checks_its_crate_and_every_crate_that_depends_on_it() -> Result<(), String> {
        let core = member(
            "idem-core",
            "[package]\nname = \"idem-core\"\n[dependencies]\nhttp.workspace = true\n",
        )?;
        let axum = member(
            "idem-axum",
            "[package]\nname = \"idem-axum\"\n\n[dependencies]\nidem-core.workspace = true\n\
             # idem-redis = { path = \"x\" }\n",
        )?;
        let example = member(
            "examples/payments-axum",
            "[package]\nname = \"payments-axum\"\n[dev-dependencies]\nidem-axum = { workspace = true }\n\
             [target.'cfg(unix)'.dependencies]\nlibc = \"0.2\"\n",
        )?;
        let redis = member(
            "idem-redis",
            "[package]\nname = \"idem-redis\"\n[dependencies]\nredis = \"1\"\n",
        )?;
        assert_eq!(axum.depends_on, vec!["idem-core".to_owned()]);
        assert_eq!(
            example.depends_on,
            vec!["idem-axum".to_owned(), "libc".to_owned()]
        );
        let members = [core, axum, example, redis];
        let names = |files: &[&str]| -> Vec<String> {
            let files: Vec<String> = files.iter().map(|f| (*f).to_owned()).collect();
            affected(&members, &files).into_iter().collect()
        };
        assert_eq!(
            names(&["idem-core/src/lib.rs"]),
            ["idem-axum", "idem-core", "payments-axum"]
        );
        assert_eq!(
            names(&["examples/payments-axum/src/main.rs"]),
            ["payments-axum"]
        );
        assert_eq!(names(&["idem-redis/README.md"]), ["idem-redis"]);
        assert_eq!(names(&[]), Vec::<String>::new());
        assert_eq!(
            names(&["Cargo.lock"]),
            ["idem-axum", "idem-core", "idem-redis", "payments-axum"]
        );
        Ok(())
    }
}
