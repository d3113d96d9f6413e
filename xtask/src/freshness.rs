//! Makes a build kept in the cache serve a fresh checkout of the same sources.
//!
//! Cargo decides whether a workspace crate is out of date by its files'
//! modification times: a file newer than the crate's last build means a
//! rebuild. A fresh clone gives every file the time of the clone, so a target
//! directory kept outside the checkout ([`shell::use_cache_target`]) would be
//! rebuilt whole for every clone; and a file older than that build, with
//! other content than the build saw (another checkout built into the same
//! cache), would not be rebuilt at all.
//!
//! So, before cargo runs, each file of the checkout (git's list: tracked, and
//! untracked but not ignored) is compared by content (git's blob hash) with
//! the record the last run left beside the target directory:
//!
//! - **same content:** in a checkout whose every build goes to the cache
//!   (`CARGO_TARGET_DIR` set by the caller, as `.ci/run` does), the file gets
//!   back the modification time it had then, so cargo finds the crate up to
//!   date; in a working checkout, whose own `target/` an earlier time could
//!   fool, it is left as it is;
//! - **other content, or a file the record does not have:** a file not newer
//!   than the record is given the current time, so cargo rebuilds what
//!   depends on it.
//!
//! The record is then written for this checkout, marked in progress, before
//! anything is built. When the task ends, a file whose content or time
//! changed while it ran is struck from it (the build may have seen either
//! content), and it is marked with the time the task ended: every build of
//! the task is older, and any file newer than that is newer than every build.
//! A record left in progress (a task killed) gives no times back, and every
//! file is marked changed: safe, at the cost of a rebuild.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_testkit::shell;

/// The record's name, in the target directory.
const RECORD: &str = "idem-sources.tsv";

/// The time a record in progress is marked with: later than any file.
const IN_PROGRESS: Duration = Duration::from_secs(u64::MAX);

/// One file of the checkout: its path from the workspace root, git's hash of
/// its content, its modification time.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Source {
    path: String,
    hash: String,
    modified: Duration,
}

/// The record written for this checkout; checked again when dropped.
#[derive(Debug)]
pub(crate) struct Sources {
    root: PathBuf,
    record: PathBuf,
    written: Vec<Source>,
}

/// Compares the checkout with the record of the target directory `target`,
/// restores or advances modification times as the module says, and writes
/// the record anew. `restore`: whether same-content files get their recorded
/// times back. A checkout git cannot list (no git, not a repository) is left
/// as it is: cargo then rebuilds by its own rules.
pub(crate) fn sync(target: &Path, restore: bool) -> Result<Option<Sources>, String> {
    sync_in(shell::workspace_root(), target, restore)
}

/// [`sync`] for the checkout at `root`.
fn sync_in(root: PathBuf, target: &Path, restore: bool) -> Result<Option<Sources>, String> {
    let Some(current) = list(&root)? else {
        eprintln!("==> sources: not a git checkout; cargo judges freshness by itself");
        return Ok(None);
    };
    let record = target.join(RECORD);
    let (recorded_at, recorded) = read(&record);
    let now_since_epoch = since_epoch(SystemTime::now());
    let (mut restored, mut advanced) = (0, 0);
    let mut written = Vec::with_capacity(current.len());
    for mut source in current {
        let path = root.join(&source.path);
        match recorded.get(&source.path) {
            // A record left in progress says nothing of what was built: the
            // run may have seen other content while it lasted.
            Some(old) if old.hash == source.hash && recorded_at != IN_PROGRESS => {
                if restore && old.modified != source.modified {
                    set_modified(&path, old.modified)?;
                    source.modified = old.modified;
                    restored += 1;
                }
            }
            _ => {
                if source.modified <= recorded_at {
                    set_modified(&path, now_since_epoch)?;
                    source.modified = now_since_epoch;
                    advanced += 1;
                }
            }
        }
        written.push(source);
    }
    std::fs::create_dir_all(target).map_err(|e| format!("{}: {e}", target.display()))?;
    write(&record, IN_PROGRESS, &written)?;
    eprintln!(
        "==> sources: {} files; {restored} given back their recorded times, {advanced} marked changed ({})",
        written.len(),
        record.display()
    );
    Ok(Some(Sources {
        root,
        record,
        written,
    }))
}

impl Drop for Sources {
    /// Strikes from the record every file whose content or time changed
    /// since it was written, and marks it with the time the task ended.
    fn drop(&mut self) {
        let ended = since_epoch(SystemTime::now());
        let Ok(Some(now)) = list(&self.root) else {
            let _ = std::fs::remove_file(&self.record);
            return;
        };
        let now: HashMap<&str, &Source> = now.iter().map(|s| (s.path.as_str(), s)).collect();
        let kept: Vec<Source> = self
            .written
            .iter()
            .filter(|source| now.get(source.path.as_str()) == Some(source))
            .cloned()
            .collect();
        if write(&self.record, ended, &kept).is_err() {
            let _ = std::fs::remove_file(&self.record);
        }
    }
}

/// The checkout's files with their hashes and times; `None` when git cannot
/// list them.
fn list(root: &Path) -> Result<Option<Vec<Source>>, String> {
    let Ok(listed) = Command::new("git")
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .current_dir(root)
        .stderr(Stdio::null())
        .output()
    else {
        return Ok(None);
    };
    if !listed.status.success() {
        return Ok(None);
    }
    let mut paths: Vec<String> = listed
        .stdout
        .split(|b| *b == 0)
        .filter(|p| !p.is_empty())
        .filter_map(|p| std::str::from_utf8(p).ok())
        .filter(|p| root.join(p).is_file())
        .map(str::to_owned)
        .collect();
    paths.sort();
    paths.dedup();
    let hashes = hash_objects(root, &paths)?;
    let mut sources = Vec::with_capacity(paths.len());
    for (path, hash) in paths.into_iter().zip(hashes) {
        let modified = std::fs::metadata(root.join(&path))
            .and_then(|m| m.modified())
            .map(since_epoch)
            .map_err(|e| format!("{path}: {e}"))?;
        sources.push(Source {
            path,
            hash,
            modified,
        });
    }
    Ok(Some(sources))
}

/// `git hash-object --stdin-paths`: one hash per path, in order.
fn hash_objects(root: &Path, paths: &[String]) -> Result<Vec<String>, String> {
    let mut child = Command::new("git")
        .args(["hash-object", "--no-filters", "--stdin-paths"])
        .current_dir(root)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("git hash-object: {e}"))?;
    let mut stdin = child.stdin.take().ok_or("git hash-object: no stdin")?;
    let input = paths.join("\n") + "\n";
    // Written from a thread: git answers while it reads, and both pipes fill.
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let output = child
        .wait_with_output()
        .map_err(|e| format!("git hash-object: {e}"))?;
    let _ = writer.join();
    if !output.status.success() {
        return Err(format!(
            "git hash-object failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let hashes: Vec<String> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    if hashes.len() != paths.len() {
        return Err(format!(
            "git hash-object answered {} hashes for {} files",
            hashes.len(),
            paths.len()
        ));
    }
    Ok(hashes)
}

fn since_epoch(time: SystemTime) -> Duration {
    time.duration_since(UNIX_EPOCH).unwrap_or_default()
}

fn set_modified(path: &Path, since_epoch: Duration) -> Result<(), String> {
    std::fs::File::options()
        .write(true)
        .open(path)
        .and_then(|file| file.set_modified(UNIX_EPOCH + since_epoch))
        .map_err(|e| format!("{}: cannot set its modification time: {e}", path.display()))
}

/// The record: its first line the time it was written, then one line per
/// file, `path TAB hash TAB seconds.nanoseconds`. A missing or unreadable
/// record is an empty one in progress: the target directory may hold builds
/// of any content, so every file is marked changed.
fn read(record: &Path) -> (Duration, HashMap<String, Source>) {
    let Ok(text) = std::fs::read_to_string(record) else {
        return (IN_PROGRESS, HashMap::new());
    };
    let mut lines = text.lines();
    let Some(written) = lines.next().and_then(parse_time) else {
        return (IN_PROGRESS, HashMap::new());
    };
    let sources = lines
        .filter_map(|line| {
            let mut fields = line.split('\t');
            let (path, hash, time) = (fields.next()?, fields.next()?, fields.next()?);
            Some(Source {
                path: path.to_owned(),
                hash: hash.to_owned(),
                modified: parse_time(time)?,
            })
        })
        .map(|source| (source.path.clone(), source))
        .collect();
    (written, sources)
}

fn write(record: &Path, written: Duration, sources: &[Source]) -> Result<(), String> {
    let mut text = format_time(written);
    text.push('\n');
    for source in sources {
        text.push_str(&format!(
            "{}\t{}\t{}\n",
            source.path,
            source.hash,
            format_time(source.modified)
        ));
    }
    let partial = record.with_extension("tsv.partial");
    std::fs::write(&partial, text)
        .and_then(|()| std::fs::rename(&partial, record))
        .map_err(|e| format!("{}: {e}", record.display()))
}

fn format_time(time: Duration) -> String {
    format!("{}.{:09}", time.as_secs(), time.subsec_nanos())
}

fn parse_time(text: &str) -> Option<Duration> {
    let (secs, nanos) = text.split_once('.')?;
    Some(Duration::new(secs.parse().ok()?, nanos.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::{Duration, IN_PROGRESS, format_time, parse_time, read, since_epoch, sync_in};
    use std::path::{Path, PathBuf};
    use std::time::SystemTime;

    /// A git work tree in a fresh temporary directory, with `files`
    /// (untracked: git lists them all the same).
    fn checkout(name: &str, files: &[(&str, &str)]) -> Result<PathBuf, String> {
        let dir = std::env::temp_dir().join(format!(
            "idem-freshness-{}-{name}-{}",
            std::process::id(),
            since_epoch(SystemTime::now()).as_nanos()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let init = std::process::Command::new("git")
            .args(["init", "-q"])
            .current_dir(&dir)
            .status()
            .map_err(|e| format!("git init: {e}"))?;
        if !init.success() {
            return Err("git init failed".to_owned());
        }
        for (path, text) in files {
            std::fs::write(dir.join(path), text).map_err(|e| e.to_string())?;
        }
        Ok(dir)
    }

    fn modified(path: &Path) -> Result<Duration, String> {
        std::fs::metadata(path)
            .and_then(|m| m.modified())
            .map(since_epoch)
            .map_err(|e| e.to_string())
    }

    fn set(path: &Path, secs: u64) -> Result<(), String> {
        super::set_modified(path, Duration::from_secs(secs))
    }

    /// The clean clone's story: a first checkout builds and leaves its
    /// record; a second one, all files new, gets back the recorded time of
    /// every file with the same content, and the file it changed is marked
    /// newer than the first run's end. A run that never ended (killed)
    /// gives nothing back.
    #[test]
    fn a_clean_clone_gets_back_the_times_of_the_same_content_only() -> Result<(), String> {
        let files = [("a.rs", "fn a() {}\n"), ("b.rs", "fn b() {}\n")];
        let first = checkout("first", &files)?;
        let target = checkout("target", &[])?;
        set(&first.join("a.rs"), 1_000_000_000)?;
        set(&first.join("b.rs"), 1_000_000_100)?;
        let run = sync_in(first.clone(), &target, false)?.ok_or("no record")?;
        // No record yet: the target directory may hold anything, so every
        // file is marked changed.
        let a_built = modified(&first.join("a.rs"))?;
        assert!(a_built > Duration::from_secs(1_000_000_100));
        let (written_at, _) = read(&target.join(super::RECORD));
        assert_eq!(written_at, IN_PROGRESS, "in progress while the run lasts");
        drop(run);
        let (ended, recorded) = read(&target.join(super::RECORD));
        assert!(ended < IN_PROGRESS && ended >= a_built);
        assert_eq!(recorded.len(), 2);

        let second = checkout(
            "second",
            &[("a.rs", "fn a() {}\n"), ("b.rs", "fn b() { 1; }\n")],
        )?;
        set(&second.join("b.rs"), 1_000_000_200)?;
        let run = sync_in(second.clone(), &target, true)?.ok_or("no record")?;
        assert_eq!(modified(&second.join("a.rs"))?, a_built);
        assert!(
            modified(&second.join("b.rs"))? >= ended,
            "the changed file is newer than the last run"
        );
        // Killed: the record stays in progress.
        std::mem::forget(run);

        let third = checkout("third", &files)?;
        set(&third.join("a.rs"), 1_000_000_300)?;
        let run = sync_in(third.clone(), &target, true)?.ok_or("no record")?;
        assert!(
            modified(&third.join("a.rs"))? > Duration::from_secs(1_000_000_300),
            "after a killed run nothing is given back, and every file is marked changed"
        );
        drop(run);

        // A working checkout (no restoring) keeps its times when the content matches.
        set(&third.join("a.rs"), 1_000_000_400)?;
        let run = sync_in(third.clone(), &target, false)?.ok_or("no record")?;
        assert_eq!(
            modified(&third.join("a.rs"))?,
            Duration::from_secs(1_000_000_400)
        );
        drop(run);
        for dir in [first, second, third, target] {
            let _ = std::fs::remove_dir_all(dir);
        }
        Ok(())
    }

    #[test]
    fn a_time_reads_back_as_written() {
        let time = Duration::new(1_764_860_000, 123_456_789);
        assert_eq!(format_time(time), "1764860000.123456789");
        assert_eq!(parse_time(&format_time(time)), Some(time));
        assert_eq!(parse_time(&format_time(IN_PROGRESS)), Some(IN_PROGRESS));
        assert_eq!(parse_time("1.000000007"), Some(Duration::new(1, 7)));
        assert_eq!(parse_time("12"), None);
        assert_eq!(parse_time("x.1"), None);
    }
}
