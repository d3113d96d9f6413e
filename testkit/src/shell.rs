//! Running commands from the workspace root, loudly: what `cargo xtask` and
//! the runners it dispatches to (`idem-e2e`, `idem-bench`) share.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Instant;

/// The workspace root, found at run time: the nearest directory holding
/// `Cargo.lock`, from the package directory cargo gives the process
/// (`CARGO_MANIFEST_DIR`, set by `cargo run` and `cargo test`), else from the
/// current directory. Not this crate's compile-time directory: a build kept
/// in the cache ([`use_cache_target`]) serves every checkout of the same
/// sources, and the checkout that compiled it may be gone.
pub fn workspace_root() -> PathBuf {
    let start = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::current_dir().ok())
        .unwrap_or_else(|| PathBuf::from("."));
    start
        .ancestors()
        .find(|dir| dir.join("Cargo.lock").is_file())
        .map_or(start.clone(), PathBuf::from)
}

/// Where what outlives a checkout is kept: cargo's target directory for
/// `cargo xtask` and CI ([`use_cache_target`]), the Kafka broker's build
/// ([`crate::kafka::install_root`]) and the stamps of steps that run once per
/// change. `IDEM_CI_CACHE` when set, else `$HOME/.cache/idem` (else
/// `target/idem-cache` in the workspace, for a process without a home).
/// `rm -rf ~/.cache/idem` clears it.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("IDEM_CI_CACHE").filter(|dir| !dir.is_empty()) {
        return absolute(PathBuf::from(dir));
    }
    match std::env::var_os("HOME").filter(|home| !home.is_empty()) {
        Some(home) => PathBuf::from(home).join(".cache").join("idem"),
        None => workspace_root().join("target").join("idem-cache"),
    }
}

/// The target directory chosen by [`use_cache_target`], if it was called.
static CHOSEN_TARGET: OnceLock<PathBuf> = OnceLock::new();

/// Makes this process and every `cargo` it starts through [`cargo`] build in
/// the cache's target directory (`cache_dir()/target`), unless the caller set
/// `CARGO_TARGET_DIR`, which wins. A fresh checkout then reuses what an
/// earlier one built: `cargo xtask ci` in a working checkout leaves CI's
/// `.ci/run`, in a clean clone of the same commit, a warm build.
pub fn use_cache_target() -> PathBuf {
    CHOSEN_TARGET
        .get_or_init(|| caller_target_dir().unwrap_or_else(|| cache_dir().join("target")))
        .clone()
}

/// The workspace's target directory: [`use_cache_target`]'s choice when it
/// was made, else `CARGO_TARGET_DIR`, else `target/`.
pub fn target_dir() -> PathBuf {
    if let Some(chosen) = CHOSEN_TARGET.get() {
        return chosen.clone();
    }
    caller_target_dir().unwrap_or_else(|| workspace_root().join("target"))
}

/// `CARGO_TARGET_DIR`, made absolute against the workspace root.
fn caller_target_dir() -> Option<PathBuf> {
    std::env::var_os("CARGO_TARGET_DIR")
        .filter(|dir| !dir.is_empty())
        .map(|dir| absolute(PathBuf::from(dir)))
}

fn absolute(dir: PathBuf) -> PathBuf {
    if dir.is_absolute() {
        dir
    } else {
        workspace_root().join(dir)
    }
}

/// A `cargo` command run from the workspace root, in [`target_dir`] when
/// [`use_cache_target`] chose it.
pub fn cargo(args: &[&str]) -> Command {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut command = Command::new(cargo);
    command.args(args).current_dir(workspace_root());
    // What `cargo run` set for this process describes this process's package,
    // not the build: a build script that reruns when such a variable changes
    // (ring's reads CARGO_MANIFEST_DIR, CARGO_PKG_NAME…) would be run again,
    // and what depends on it rebuilt, whenever the caller changes.
    without_cargo_run_variables(&mut command);
    if let Some(chosen) = CHOSEN_TARGET.get() {
        command.env("CARGO_TARGET_DIR", chosen);
    }
    command
}

/// Removes from `command`'s environment the variables `cargo run` (or
/// `cargo test`) set for this process's package: `CARGO_PKG_*`,
/// `CARGO_MANIFEST_*`, `CARGO_CRATE_NAME` and the like.
pub fn without_cargo_run_variables(command: &mut Command) -> &mut Command {
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if set_by_cargo_run(&name) {
            command.env_remove(name.as_ref());
        }
    }
    command
}

/// Whether `name` is one of the variables `cargo run` and `cargo test` set
/// for the package they run.
fn set_by_cargo_run(name: &str) -> bool {
    name.starts_with("CARGO_PKG_")
        || name.starts_with("CARGO_MANIFEST_")
        || matches!(
            name,
            "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_PRIMARY_PACKAGE"
                | "CARGO_RUSTC_CURRENT_DIR"
        )
}

/// Runs `command`, echoing the step first and its time after; an error names
/// the step that failed.
pub fn run(step: &str, command: &mut Command) -> Result<(), String> {
    eprintln!("\n==> {step}");
    let started = Instant::now();
    let status = command
        .status()
        .map_err(|e| format!("{step}: could not start: {e}"))?;
    let took = started.elapsed().as_secs_f64();
    if status.success() {
        eprintln!("==> {step}: ok in {took:.0} s");
        Ok(())
    } else {
        Err(format!("{step} failed ({status}) after {took:.0} s"))
    }
}

/// The workspace's dev build, after `cargo build`: every binary and every
/// test binary, the libraries compiled with the features the tests'
/// dev-dependencies take part in choosing. The test suite builds with it
/// (its test binaries are those `cargo test --workspace --all-features
/// --no-run` builds), and so do the runners ([`Profile::Dev`]): one build
/// for both, nothing compiled again between the tests and the e2e run.
pub const DEV_BUILD: [&str; 4] = ["--workspace", "--all-features", "--bins", "--tests"];

/// How the runners build the binaries they start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    /// `cargo build` with [`DEV_BUILD`]'s arguments: every binary, with the
    /// features `cargo test --workspace --all-features` compiles the
    /// libraries with, so after the tests' build (CI's order) it compiles
    /// nothing. Unoptimized, as `cargo run -p …` runs them.
    Dev,
    /// `cargo build --release -p …`: optimized, for measurements and for a run
    /// as a deployment would build it.
    Release,
}

impl Profile {
    /// `Dev` when `args` holds `--dev` (and removes it), else `default`.
    pub fn take_from(args: &mut Vec<String>, default: Self) -> Self {
        match args.iter().position(|arg| arg == "--dev") {
            Some(at) => {
                args.remove(at);
                Self::Dev
            }
            None => default,
        }
    }

    /// Builds the binaries of `packages` and answers the directory they are in.
    pub fn build(self, packages: &[&str]) -> Result<PathBuf, String> {
        let mut args = vec!["build", "-q"];
        match self {
            Self::Dev => args.extend(DEV_BUILD),
            Self::Release => {
                args.push("--release");
                for package in packages {
                    args.extend(["-p", package]);
                }
            }
        }
        run(&format!("cargo {}", args.join(" ")), &mut cargo(&args))?;
        Ok(target_dir().join(match self {
            Self::Dev => "debug",
            Self::Release => "release",
        }))
    }
}

/// The first line a child prints on `stdout` (its readiness line: `listening
/// on …`), sent once it is printed; the rest is read and dropped, so the child
/// never blocks on a full pipe.
pub fn first_line(stdout: std::process::ChildStdout) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = std::io::BufReader::new(stdout).lines();
        if let Some(Ok(first)) = lines.next() {
            let _ = tx.send(first);
        }
        for _ in lines {}
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::set_by_cargo_run;

    #[test]
    fn only_the_run_packages_variables_are_dropped() {
        for name in [
            "CARGO_MANIFEST_DIR",
            "CARGO_MANIFEST_PATH",
            "CARGO_PKG_NAME",
            "CARGO_CRATE_NAME",
        ] {
            assert!(set_by_cargo_run(name), "{name}");
        }
        for name in ["CARGO", "CARGO_HOME", "CARGO_TARGET_DIR", "RUSTFLAGS"] {
            assert!(!set_by_cargo_run(name), "{name}");
        }
    }
}
