//! Every test of the workspace, test binaries side by side.
//!
//! `cargo test` runs one test binary at a time, and most of idem's binaries
//! spend their time waiting on servers (a PostgreSQL cluster, a RabbitMQ
//! node, a broker) rather than on a core. A process per test (nextest) would
//! start one server per test instead of one per binary. So the binaries are
//! built by the workspace's dev build (`cargo build --tests`: those `cargo
//! test --no-run` builds), then run here a few at a time, the slowest of the
//! last run first, each as `cargo test` runs it (from its package's
//! directory, with cargo's variables); the doctests run beside them (`cargo
//! test --doc`). Each binary's output is printed whole when it ends, and the
//! run ends with `tests: N passed, M failed` over all of them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use idem_testkit::shell::{self, cargo};

/// Test binaries at once (the doctests take one more place). Two cores; the
/// binaries mostly wait on their servers.
const SLOTS: usize = 3;

/// Where each binary's last time is kept, in the target directory: the
/// slowest start first, so the run ends with short ones filling the gaps.
const TIMES: &str = "idem-test-times.tsv";

/// One test binary, as cargo's JSON messages list it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Binary {
    /// `package::target (kind)`, as the report names it.
    pub(crate) name: String,
    pub(crate) executable: PathBuf,
    /// The package's directory: `cargo test` runs a binary from there.
    pub(crate) package_dir: PathBuf,
    pub(crate) package: String,
}

/// What one binary (or the doctests) printed and counted.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) passed: u64,
    pub(crate) failed: u64,
    pub(crate) ignored: u64,
}

impl Counts {
    /// `WHAT: N passed, M failed, K skipped` (libtest's ignored tests are
    /// the skipped ones).
    pub(crate) fn line(&self, what: &str) -> String {
        format!(
            "{what}: {} passed, {} failed, {} skipped",
            self.passed, self.failed, self.ignored
        )
    }
}

impl std::ops::AddAssign for Counts {
    fn add_assign(&mut self, other: Self) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.ignored += other.ignored;
    }
}

/// Builds every test of the workspace ([`build`]), then, once `ready`
/// answers (what the tests need beside their build: CI's Kafka broker),
/// runs those of `packages` (none: all); answers the counts, or an error
/// naming each binary that failed.
pub(crate) fn run(
    packages: &[String],
    ready: impl FnOnce() -> Result<(), String>,
) -> Result<Counts, String> {
    let built = build()?;
    ready()?;
    let binaries: Vec<Binary> = built
        .into_iter()
        .filter(|binary| packages.is_empty() || packages.contains(&binary.package))
        .collect();
    let times_file = shell::target_dir().join(TIMES);
    let mut times = read_times(&times_file);
    let mut queue: Vec<Job> = binaries.into_iter().map(Job::Binary).collect();
    queue.push(Job::Doc(packages.to_vec()));
    // Slowest first; of those not timed yet (new binaries, or every one on
    // a machine that never ran them), the doctests and the integration
    // tests first of all, the unit tests last: on a cold machine, in the
    // order cargo built them, idem-rabbitmq's broker tests (60 s) and the
    // doctests (26 s) were the last two to start.
    queue.sort_by_key(|job| std::cmp::Reverse(job.expected(&times)));
    let total = queue.len();
    eprintln!("\n==> tests: {total} binaries (doctests included), {SLOTS} at a time");
    let queue = Arc::new(Mutex::new(std::collections::VecDeque::from(queue)));
    let done: Arc<Mutex<Vec<Finished>>> = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..SLOTS)
        .map(|_| {
            let (queue, done) = (queue.clone(), done.clone());
            std::thread::spawn(move || {
                loop {
                    let next = queue
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .pop_front();
                    let Some(job) = next else { break };
                    let finished = job.run();
                    finished.print();
                    done.lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(finished);
                }
            })
        })
        .collect();
    for worker in workers {
        let _ = worker.join();
    }
    let done = std::mem::take(&mut *done.lock().unwrap_or_else(PoisonError::into_inner));
    let mut counts = Counts::default();
    let mut failures = Vec::new();
    for finished in &done {
        counts += finished.counts;
        times.insert(finished.name.clone(), finished.took);
        if !finished.passed {
            failures.push(finished.name.clone());
        }
    }
    if done.len() != total {
        failures.push(format!("{} binaries did not run", total - done.len()));
    }
    write_times(&times_file, &times);
    eprintln!(
        "\n==> tests: {} binaries; {} passed, {} failed, {} ignored",
        done.len(),
        counts.passed,
        counts.failed,
        counts.ignored
    );
    if failures.is_empty() {
        Ok(counts)
    } else {
        Err(format!(
            "tests failed in: {} ({} passed, {} failed)",
            failures.join(", "),
            counts.passed,
            counts.failed
        ))
    }
}

/// The workspace's dev build ([`shell::DEV_BUILD`]: the test binaries of
/// `cargo test --workspace --all-features --no-run`, and the binaries the
/// e2e run and the bench start, in one build, so that its last crates
/// compile beside each other), answering the test binaries it built.
fn build() -> Result<Vec<Binary>, String> {
    let mut args = vec!["build"];
    args.extend(shell::DEV_BUILD);
    args.push("--message-format=json-render-diagnostics");
    let step = format!("cargo {}", args.join(" "));
    eprintln!("\n==> {step}");
    let output = cargo(&args)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("{step}: could not start: {e}"))?;
    if !output.status.success() {
        return Err(format!("{step} failed ({})", output.status));
    }
    let listed = String::from_utf8_lossy(&output.stdout);
    let binaries: Vec<Binary> = listed.lines().filter_map(test_binary).collect();
    if binaries.is_empty() {
        return Err(format!("{step} listed no test binary"));
    }
    Ok(binaries)
}

/// The test binary a line of cargo's JSON messages names, if it names one.
pub(crate) fn test_binary(line: &str) -> Option<Binary> {
    if json_string(line, "reason")? != "compiler-artifact" {
        return None;
    }
    let profile = line.split_once("\"profile\":{")?.1.split_once('}')?.0;
    if !profile.contains("\"test\":true") {
        return None;
    }
    let executable = PathBuf::from(json_string(line, "executable")?);
    let manifest = PathBuf::from(json_string(line, "manifest_path")?);
    let package_dir = manifest.parent()?.to_path_buf();
    let package = package_dir.file_name()?.to_string_lossy().into_owned();
    let target = json_string(line, "name")?;
    let kind = json_string(line, "kind")?;
    let package_name = json_string(line, "package_id")
        .and_then(|id| package_name(&id))
        .unwrap_or(package);
    Some(Binary {
        name: format!("{package_name}::{target} ({kind})"),
        executable,
        package_dir,
        package: package_name,
    })
}

/// The package's name in a cargo package id: `path+file:///w/idem-core#0.1.0`
/// (the directory's name, unless `#name@version` says otherwise).
fn package_name(id: &str) -> Option<String> {
    let (location, version) = id.rsplit_once('#')?;
    if let Some((name, _)) = version.split_once('@') {
        return Some(name.to_owned());
    }
    Some(location.rsplit('/').next()?.to_owned())
}

/// The first string value of `"key":` in a line of JSON, unescaped; the
/// first element when the value is an array of strings. Enough for cargo's
/// messages, whose keys of interest are unique at their first occurrence.
pub(crate) fn json_string(line: &str, key: &str) -> Option<String> {
    let pattern = format!("\"{key}\":");
    let at = line.find(&pattern)? + pattern.len();
    let rest = line[at..].trim_start_matches('[');
    let rest = rest.strip_prefix('"')?;
    let mut value = String::new();
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(value),
            '\\' => match chars.next()? {
                'n' => value.push('\n'),
                't' => value.push('\t'),
                other => value.push(other),
            },
            c => value.push(c),
        }
    }
    None
}

/// A binary to run, or the doctests.
#[derive(Debug)]
enum Job {
    Binary(Binary),
    /// `cargo test --doc` for these packages (none: the workspace).
    Doc(Vec<String>),
}

/// A job that ended: its output and counts.
#[derive(Debug)]
struct Finished {
    name: String,
    passed: bool,
    counts: Counts,
    took: Duration,
    output: String,
}

impl Job {
    /// How long it is expected to take: its last time, else the longest
    /// for the doctests (they compile every crate's examples first), a
    /// second less for an integration test (they start servers), and the
    /// shortest for a crate's unit tests.
    fn expected(&self, times: &HashMap<String, Duration>) -> Duration {
        let name = self.name();
        if let Some(took) = times.get(&name) {
            return *took;
        }
        match self {
            Self::Doc(_) => Duration::MAX,
            Self::Binary(_) if name.ends_with(" (test)") => Duration::MAX - Duration::from_secs(1),
            Self::Binary(_) => Duration::ZERO,
        }
    }

    fn name(&self) -> String {
        match self {
            Self::Binary(binary) => binary.name.clone(),
            Self::Doc(_) => "doctests".to_owned(),
        }
    }

    fn command(&self) -> Command {
        match self {
            Self::Binary(binary) => {
                let mut command = Command::new(&binary.executable);
                // As `cargo test` gives them: this package's, not xtask's.
                shell::without_cargo_run_variables(&mut command)
                    .current_dir(&binary.package_dir)
                    .env("CARGO_MANIFEST_DIR", &binary.package_dir)
                    .env("CARGO_PKG_NAME", &binary.package);
                if let Ok(cargo) = std::env::var("CARGO") {
                    command.env("CARGO", cargo);
                }
                command
            }
            Self::Doc(packages) => {
                let mut args = vec!["test", "--all-features", "--doc"];
                if packages.is_empty() {
                    args.push("--workspace");
                }
                for package in packages {
                    args.extend(["-p", package]);
                }
                cargo(&args)
            }
        }
    }

    fn run(self) -> Finished {
        let name = self.name();
        let started = Instant::now();
        let ran = output_merged(self.command());
        let took = started.elapsed();
        let (passed, output) = ran.unwrap_or_else(|e| (false, format!("could not start: {e}")));
        let counts = counts(&output);
        Finished {
            name,
            // A binary that exits 0 having counted a failure is still failed.
            passed: passed && counts.failed == 0,
            counts,
            took,
            output,
        }
    }
}

/// Runs `command` with its standard error sent to the same pipe as its
/// output, so the two interleave as printed; answers whether it passed and
/// what it printed.
fn output_merged(mut command: Command) -> std::io::Result<(bool, String)> {
    use std::io::Read;
    let (mut reader, writer) = std::io::pipe()?;
    let mut child = command
        .stdin(Stdio::null())
        .stdout(writer.try_clone()?)
        .stderr(writer)
        .spawn()?;
    // The command holds copies of the pipe's writing end until it is dropped.
    drop(command);
    let mut printed = Vec::new();
    let read = reader.read_to_end(&mut printed);
    let status = child.wait()?;
    read?;
    Ok((
        status.success(),
        String::from_utf8_lossy(&printed).into_owned(),
    ))
}

impl Finished {
    fn print(&self) {
        let verdict = if self.passed { "ok" } else { "FAILED" };
        eprintln!(
            "\n==> test binary {}: {verdict} in {:.0} s\n{}",
            self.name,
            self.took.as_secs_f64(),
            self.output.trim_end()
        );
    }
}

/// The sum of libtest's `test result:` lines in an output (the doctests
/// print one per crate).
pub(crate) fn counts(output: &str) -> Counts {
    let mut counts = Counts::default();
    for line in output.lines() {
        let Some(rest) = line.trim().strip_prefix("test result: ") else {
            continue;
        };
        for part in rest.split([';', '.']) {
            let mut words = part.split_whitespace();
            let (Some(number), Some(what)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(number) = number.parse::<u64>() else {
                continue;
            };
            match what {
                "passed" => counts.passed += number,
                "failed" => counts.failed += number,
                "ignored" => counts.ignored += number,
                _ => {}
            }
        }
    }
    counts
}

fn read_times(file: &Path) -> HashMap<String, Duration> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let (secs, name) = line.split_once('\t')?;
            Some((name.to_owned(), Duration::from_secs_f64(secs.parse().ok()?)))
        })
        .collect()
}

fn write_times(file: &Path, times: &HashMap<String, Duration>) {
    let mut lines: Vec<String> = times
        .iter()
        .map(|(name, took)| format!("{:.1}\t{name}", took.as_secs_f64()))
        .collect();
    lines.sort();
    let _ = std::fs::write(file, lines.join("\n") + "\n");
}

#[cfg(test)]
mod tests {
    use super::{Binary, Counts, Job, counts, json_string, test_binary};
    use std::collections::HashMap;
    use std::path::PathBuf;
    use std::time::Duration;

    /// Timed jobs by their last time; of the others, the doctests, then the
    /// integration tests before every timed one, the unit tests after.
    #[test]
    fn jobs_not_timed_yet_are_ordered_by_their_kind() {
        let binary = |name: &str| {
            Job::Binary(Binary {
                name: name.to_owned(),
                executable: PathBuf::from("/t/x"),
                package_dir: PathBuf::from("/w/x"),
                package: "x".to_owned(),
            })
        };
        let times = HashMap::from([("a::stores (test)".to_owned(), Duration::from_secs(20))]);
        let mut queue = [
            binary("a::a (lib)"),
            binary("a::stores (test)"),
            binary("b::b (bin)"),
            binary("b::broker (test)"),
            Job::Doc(Vec::new()),
        ];
        queue.sort_by_key(|job| std::cmp::Reverse(job.expected(&times)));
        let names: Vec<String> = queue.iter().map(Job::name).collect();
        assert_eq!(
            names,
            [
                "doctests",
                "b::broker (test)",
                "a::stores (test)",
                "a::a (lib)",
                "b::b (bin)"
            ]
        );
    }

    #[test]
    fn libtests_result_lines_are_summed() {
        let output = "running 3 tests\n\
            test a ... ok\n\
            test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s\n\
            \n\
            test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.2s\n";
        assert_eq!(
            counts(output),
            Counts {
                passed: 5,
                failed: 1,
                ignored: 1
            }
        );
        assert_eq!(counts("no tests here"), Counts::default());
        assert_eq!(
            counts(output).line("tests"),
            "tests: 5 passed, 1 failed, 1 skipped"
        );
    }

    #[test]
    fn a_test_artifact_is_read_from_cargos_json() -> Result<(), String> {
        let line = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/idem-core#0.1.0","manifest_path":"/w/idem-core/Cargo.toml","target":{"kind":["lib"],"crate_types":["lib"],"name":"idem_core","src_path":"/w/idem-core/src/lib.rs","edition":"2024","doc":true,"doctest":true,"test":true},"profile":{"opt_level":"0","debuginfo":0,"debug_assertions":true,"overflow_checks":true,"test":true},"features":[],"filenames":["/t/debug/deps/idem_core-1"],"executable":"/t/debug/deps/idem_core-1","fresh":true}"#;
        let binary = test_binary(line).ok_or("no test binary read")?;
        assert_eq!(binary.name, "idem-core::idem_core (lib)");
        assert_eq!(
            binary.executable,
            PathBuf::from("/t/debug/deps/idem_core-1")
        );
        assert_eq!(binary.package_dir, PathBuf::from("/w/idem-core"));
        let renamed = line.replace("idem-core#0.1.0", "core#idem-core@0.1.0");
        assert_eq!(
            test_binary(&renamed).map(|b| b.package),
            Some("idem-core".to_owned())
        );
        let not_a_test = line.replace(
            "\"overflow_checks\":true,\"test\":true",
            "\"overflow_checks\":true,\"test\":false",
        );
        assert_eq!(test_binary(&not_a_test), None);
        assert_eq!(
            test_binary(r#"{"reason":"build-finished","success":true}"#),
            None
        );
        assert_eq!(
            json_string(r#"{"a":"x\"y\\z"}"#, "a"),
            Some("x\"y\\z".to_owned())
        );
        Ok(())
    }
}
