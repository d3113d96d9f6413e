//! Running commands from the workspace root, loudly.

use std::path::PathBuf;
use std::process::Command;

/// The workspace root (the parent of xtask's manifest directory).
pub(crate) fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

/// A `cargo` command run from the workspace root.
pub(crate) fn cargo(args: &[&str]) -> Command {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut command = Command::new(cargo);
    command.args(args).current_dir(workspace_root());
    command
}

/// Runs `command`, echoing it first; an error names the step that failed.
pub(crate) fn run(step: &str, command: &mut Command) -> Result<(), String> {
    eprintln!("\n==> {step}");
    let status = command
        .status()
        .map_err(|e| format!("{step}: could not start: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{step} failed ({status})"))
    }
}
