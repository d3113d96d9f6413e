//! Running commands from the workspace root, loudly: what `cargo xtask` and
//! the runners it dispatches to (`idem-e2e`, `idem-bench`) share.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

/// The workspace root (the parent of this crate's directory).
pub fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

/// The workspace's target directory (`CARGO_TARGET_DIR`, else `target/`).
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|dir| {
            if dir.is_absolute() {
                dir
            } else {
                workspace_root().join(dir)
            }
        })
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// A `cargo` command run from the workspace root.
pub fn cargo(args: &[&str]) -> Command {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut command = Command::new(cargo);
    command.args(args).current_dir(workspace_root());
    command
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

/// How the runners build the binaries they start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    /// `cargo build --workspace --all-features --bins --tests`: every binary,
    /// with the features `cargo test --workspace --all-features` compiles the
    /// libraries with (the tests' dev-dependencies take part in choosing
    /// them), so after that step (CI's order) it compiles nothing but the
    /// binaries' own crates. Unoptimized, as `cargo run -p …` runs them.
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
            Self::Dev => args.extend(["--workspace", "--all-features", "--bins", "--tests"]),
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
