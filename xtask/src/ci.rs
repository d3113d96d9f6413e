//! `cargo xtask ci`: everything CI checks, in the order that fails fastest.

use std::path::Path;

use idem_testkit::shell::{self, cargo};

use crate::steps::Steps;

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

/// The crates published to crates.io (every other workspace member has
/// `publish = false`), in no particular order: cargo orders them.
const PUBLISHED: &[&str] = &[
    "idem",
    "idem-core",
    "idem-axum",
    "idem-actix",
    "idem-diesel",
    "idem-redis",
    "idem-rabbitmq",
    "idem-kafka",
    "idem-sqs",
    "idem-client",
];

/// Runs formatting, clippy, each store feature set alone, docs, the published
/// crates' packages, every test, the end-to-end run of both examples on every
/// store, and the benchmarks' smoke run; stops at the first failure, and
/// prints each step's seconds either way. `--stress [RUNS]` runs the tests
/// under load instead ([`crate::stress`]).
pub(crate) fn run(args: &[String]) -> Result<(), String> {
    match args.first().map(String::as_str) {
        None => {}
        Some("--stress") => return crate::stress::run(args.get(1).map(String::as_str)),
        Some(other) => return Err(format!("ci takes --stress [RUNS], not {other}")),
    }
    let mut steps = Steps::new("ci");
    let result = every_step(&mut steps);
    eprint!("{}", steps.table(result.is_ok()));
    result
}

fn every_step(steps: &mut Steps) -> Result<(), String> {
    // The Kafka broker's build, once per machine (minutes), runs beside the
    // steps before the tests at their priority; the tests run once it is
    // done. (Under nice 19 until the tests' build, as it once ran, it took
    // only the cores those steps left idle, which is little: its last
    // crates, one at a time, were then left to compile after the tests'
    // build, and the tests waited for them, one core idle, 75 s of a cold
    // run. At their priority those crates compile beside the clippy and
    // doc builds, which keep the other core busy.)
    let mut broker = BrokerBuild::start()?;
    fmt(steps)?;
    clippy(steps, &["--workspace"])?;
    store_feature_sets(steps)?;
    steps.run("cargo doc (warnings denied)", &mut doc()?)?;
    packages(steps)?;
    // The benchmarks' smoke run measures nothing: it runs beside the tests
    // and the e2e run, at the lowest priority, from the moment the tests'
    // build (which builds what it runs) is done. (Side by side with the e2e
    // run alone they took 222 and 243 s, one after the other about 260
    // (167 + 89); started once the e2e rows that need the machine alone
    // were done, 303: the rows that share it are slowed by any load beside
    // them. Once the e2e run took 163 s, the smoke run, 202 s, ended the
    // step 16 s after it: started with the tests, it is done before. No
    // e2e row or test may depend on a quiet machine for its outcome: the
    // client-disconnect row, which gave up after a fixed 300 ms, failed
    // under this load until it waited for the provider's call instead.)
    let mut smoke = None;
    let counts = steps.time("tests", || {
        crate::suite::run(&[], || {
            broker.finish()?;
            smoke = Some(bench_smoke()?);
            Ok(())
        })
    })?;
    let smoke = smoke.ok_or("the benchmarks' smoke run did not start")?;
    let tests = counts.line("tests");
    let mut rows = None;
    let e2e = steps.time("e2e (--dev)", || {
        crate::e2e_counted(&["e2e", "--dev"], &mut rows)
    });
    // The table ends with the counts, each `WORD: N passed, M failed`.
    if let Some(rows) = rows {
        steps.total(format!("e2e: {rows}"));
    }
    steps.total(tests);
    e2e?;
    steps.time("bench --smoke (beside the tests and the e2e run)", || {
        smoke.finish().map(|_| ())
    })?;
    Ok(())
}

/// `cargo xtask bench --smoke --dev` in the background, its output in
/// `bench/smoke.log` in the target directory.
fn bench_smoke() -> Result<Background, String> {
    Background::start(
        "cargo xtask bench --smoke --dev",
        crate::runner("idem-bench", &["--smoke", "--dev"])?,
        &shell::target_dir().join("bench").join("smoke.log"),
        Priority::Lowest,
    )
}

/// `cargo doc` of every library, command and example of the workspace,
/// warnings denied. Its targets are named (`--lib`, each command without a
/// library, `--examples`) because `--examples` is what makes it share the
/// clippy step's compiled dependencies: a build with an example in it
/// resolves the dev-dependencies' features too, as `--all-targets` does,
/// where a plain `cargo doc` resolves other features for tokio, serde and
/// about 80 crates built on them, and checked them again (72 s of a cold
/// run, 33 s without). A command whose crate has a library is left out, as
/// a plain `cargo doc` leaves it out: its docs would overwrite the
/// library's (`--bins` takes it).
fn doc() -> Result<std::process::Command, String> {
    let mut args: Vec<String> = [
        "doc",
        "--workspace",
        "--no-deps",
        "--all-features",
        "--lib",
        "--examples",
    ]
    .map(str::to_owned)
    .to_vec();
    for command in commands_without_library(&shell::workspace_root())? {
        args.extend(["--bin".to_owned(), command]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut doc = cargo(&args);
    doc.env("RUSTDOCFLAGS", "-D warnings");
    Ok(doc)
}

/// The members that are a command alone (`src/main.rs`, no `src/lib.rs`):
/// their binaries, named after their packages.
fn commands_without_library(root: &Path) -> Result<Vec<String>, String> {
    Ok(crate::check::members(root)?
        .into_iter()
        .filter(|member| {
            let src = root.join(&member.dir).join("src");
            src.join("main.rs").is_file() && !src.join("lib.rs").is_file()
        })
        .map(|member| member.name)
        .collect())
}

/// `cargo fmt --check`.
pub(crate) fn fmt(steps: &mut Steps) -> Result<(), String> {
    steps.run(
        "cargo fmt --check",
        &mut cargo(&["fmt", "--all", "--", "--check"]),
    )
}

/// Clippy on every target and feature of `selection` (`--workspace`, or
/// `-p NAME`…), warnings denied.
pub(crate) fn clippy(steps: &mut Steps, selection: &[&str]) -> Result<(), String> {
    let mut args = vec!["clippy"];
    args.extend_from_slice(selection);
    args.extend(["--all-targets", "--all-features", "--", "-D", "warnings"]);
    steps.run("cargo clippy (warnings denied)", &mut cargo(&args))
}

/// The published crates packed, then checked from their `.crate` files; both
/// only when their sources (or the lock file, or the toolchain) changed
/// since they last passed, as recorded in the target directory: the same
/// sources pack to the same packages.
fn packages(steps: &mut Steps) -> Result<(), String> {
    let pack = "cargo package --no-verify";
    let build = "cargo check (the packed crates, unpacked)";
    let stamp = shell::target_dir().join("idem-packaged.stamp");
    let mut paths = vec!["Cargo.lock", "Cargo.toml", ".cargo"];
    paths.extend(PUBLISHED);
    let sources = sources_stamp(&paths)?;
    if let Some(sources) = &sources
        && std::fs::read_to_string(&stamp).is_ok_and(|passed| passed == *sources)
    {
        let why = "the same sources passed it before";
        steps.skip(pack, why);
        steps.skip(build, why);
        return Ok(());
    }
    let _ = std::fs::remove_file(&stamp);
    steps.run(pack, &mut package_all())?;
    steps.run(build, &mut package_check()?)?;
    if let Some(sources) = sources {
        let _ = std::fs::write(&stamp, sources);
    }
    Ok(())
}

/// What a step that depends on `paths` alone (and the toolchain) saw: the
/// toolchain, then each file under `paths` with git's hash of its content.
/// `None` outside a git checkout, or when a file under `paths` differs from
/// git's index (the step then always runs). The packages' check depends on
/// the published crates, the lock file and the workspace's manifest.
fn sources_stamp(paths: &[&str]) -> Result<Option<String>, String> {
    let root = shell::workspace_root();
    let rustc = std::process::Command::new(std::env::var("RUSTC").unwrap_or("rustc".to_owned()))
        .arg("-vV")
        .output()
        .map_err(|e| format!("rustc -vV: {e}"))?;
    let mut args = vec!["ls-files", "-s", "--"];
    args.extend(paths);
    let Ok(listed) = std::process::Command::new("git")
        .args(&args)
        .current_dir(&root)
        .output()
    else {
        return Ok(None);
    };
    if !listed.status.success() {
        return Ok(None);
    }
    // The index's hashes, and whether the work tree differs from the index:
    // a change not yet added is a change too.
    let changed = std::process::Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=all", "--"])
        .args(&args[3..])
        .current_dir(&root)
        .output()
        .map_err(|e| format!("git status: {e}"))?;
    if !changed.stdout.is_empty() {
        return Ok(None);
    }
    Ok(Some(format!(
        "{}{}",
        String::from_utf8_lossy(&rustc.stdout),
        String::from_utf8_lossy(&listed.stdout)
    )))
}

/// Builds the Kafka-compatible broker the tests start (`tansu`, pinned) into
/// the cache outside the checkout ([`kafka::install_root`]), unless it is
/// there already (or `IDEM_TANSU` names one): about 400 crates, once per
/// machine. Its build directory is deleted once it is installed.
///
/// [`kafka::install_root`]: idem_testkit::kafka::install_root
pub(crate) fn kafka_broker() -> Result<(), String> {
    use idem_testkit::kafka;
    if let Ok(tansu) = kafka::binary() {
        eprintln!("==> kafka broker: {}", tansu.display());
        return Ok(());
    }
    shell::run(&broker_step(), &mut broker_install())?;
    let _ = std::fs::remove_dir_all(broker_build_dir());
    Ok(())
}

fn broker_step() -> String {
    let version = idem_testkit::kafka::TANSU_VERSION;
    format!("kafka broker: cargo install tansu {version}")
}

/// `cargo install` of the broker ([`kafka_broker`]), into the cache.
fn broker_install() -> std::process::Command {
    use idem_testkit::kafka;
    let args = kafka::install_command();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut install = cargo(&args);
    install
        .arg("--target-dir")
        .arg(broker_build_dir())
        .envs(kafka::INSTALL_ENV.iter().copied());
    install
}

fn broker_build_dir() -> std::path::PathBuf {
    shell::cache_dir().join("tansu-build")
}

/// [`kafka_broker`]'s build in the background ([`Background`]); nothing
/// when the broker is there already.
struct BrokerBuild(Option<Background>);

impl BrokerBuild {
    fn start() -> Result<Self, String> {
        if idem_testkit::kafka::binary().is_ok() {
            return Ok(Self(None));
        }
        let log = shell::cache_dir().join("tansu-build.log");
        Background::start(&broker_step(), broker_install(), &log, Priority::Same)
            .map(|build| Self(Some(build)))
    }

    /// Waits for the build, then removes its build directory.
    fn finish(&mut self) -> Result<(), String> {
        let Some(build) = self.0.take() else {
            return kafka_broker();
        };
        let waited = build.finish()?;
        let _ = std::fs::remove_dir_all(broker_build_dir());
        eprintln!(
            "==> {}: ok (the tests waited {:.0} s for it)",
            broker_step(),
            waited.as_secs_f64()
        );
        Ok(())
    }
}

/// How a [`Background`] step shares the cores with the steps it runs beside.
#[derive(Clone, Copy, Debug)]
enum Priority {
    /// As theirs (nice 0).
    Same,
    /// Only what they leave idle (nice 19).
    Lowest,
}

impl Priority {
    fn niceness(self) -> &'static str {
        match self {
            Self::Same => "0",
            Self::Lowest => "19",
        }
    }
}

/// A step run beside others: its command at a [`Priority`], in a process
/// group of its own, its output in a log file. Dropped before it is finished
/// (a step before failed), it is stopped: its whole process group (cargo and
/// the compilers it started, a runner and the servers it started).
struct Background {
    name: String,
    child: Option<std::process::Child>,
    log: std::path::PathBuf,
}

impl Background {
    fn start(
        name: &str,
        command: std::process::Command,
        log: &Path,
        priority: Priority,
    ) -> Result<Self, String> {
        use std::os::unix::process::CommandExt;
        if let Some(dir) = log.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let output = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
        let errors = output
            .try_clone()
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let mut nice = std::process::Command::new("nice");
        nice.args(["-n", priority.niceness()])
            .arg(command.get_program())
            .args(command.get_args())
            .current_dir(
                command
                    .get_current_dir()
                    .map_or_else(shell::workspace_root, Path::to_path_buf),
            )
            .stdin(std::process::Stdio::null())
            .stdout(output)
            .stderr(errors)
            .process_group(0);
        for (variable, value) in command.get_envs() {
            match value {
                Some(value) => nice.env(variable, value),
                None => nice.env_remove(variable),
            };
        }
        let child = nice
            .spawn()
            .map_err(|e| format!("{name}: could not start: {e}"))?;
        eprintln!(
            "\n==> {name} (beside the next steps; its output in {})",
            log.display()
        );
        Ok(Self {
            name: name.to_owned(),
            child: Some(child),
            log: log.to_path_buf(),
        })
    }

    /// Waits for it to end; answers how long that took, or its failure
    /// with the end of its log.
    fn finish(mut self) -> Result<std::time::Duration, String> {
        let Some(mut child) = self.child.take() else {
            return Ok(std::time::Duration::ZERO);
        };
        let waiting = std::time::Instant::now();
        let status = child.wait().map_err(|e| format!("{}: {e}", self.name))?;
        if status.success() {
            return Ok(waiting.elapsed());
        }
        let output = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut tail: Vec<&str> = output.lines().rev().take(60).collect();
        tail.reverse();
        Err(format!(
            "{} failed ({status}); the end of {}:\n{}",
            self.name,
            self.log.display(),
            tail.join("\n")
        ))
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.wait();
        }
    }
}

/// Every test of the workspace, one binary after another (the stress run's;
/// CI runs them side by side: [`crate::suite`]).
pub(crate) fn test() -> std::process::Command {
    cargo(&["test", "--workspace", "--all-features"])
}

/// Every published crate packed (manifest, file list, dependencies
/// resolvable among the packages), without a build: the `.crate` files land
/// in `package/` in the target directory.
fn package_all() -> std::process::Command {
    let mut args = vec!["package", "--allow-dirty", "--no-verify"];
    for name in PUBLISHED {
        args.extend(["-p", name]);
    }
    cargo(&args)
}

/// The published crates as packed, checked as a workspace of their own:
/// each `.crate` file unpacked into `package-check/` in the target
/// directory, the idem dependencies patched to the unpacked copies (so none
/// is looked up on crates.io, where they are not yet), the workspace's lock
/// file and profiles, and `cargo check --workspace --all-features` into the
/// workspace's target directory. That proves what a crate's users need of
/// its package: a manifest without path-only dependencies, every source file
/// packed, code that compiles against its dependencies as published. It
/// replaced `cargo package`'s verifying build, which built every dependency
/// a second time with code generation (158 s of a cold CI run for seven of
/// the ten crates; idem-kafka and idem-sqs were left out, since they would
/// have compiled librdkafka and the AWS SDK again): a check shares the
/// clippy step's compiled dependencies where their features agree, and
/// takes all ten.
fn package_check() -> Result<std::process::Command, String> {
    let target = shell::target_dir();
    let packed = target.join("package");
    let dir = target.join("package-check");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let version = workspace_version()?;
    let mut members = String::new();
    let mut patches = String::new();
    for name in PUBLISHED {
        let unpacked = format!("{name}-{version}");
        let crate_file = packed.join(format!("{unpacked}.crate"));
        let status = std::process::Command::new("tar")
            .arg("-xzf")
            .arg(&crate_file)
            .arg("-C")
            .arg(&dir)
            .status()
            .map_err(|e| format!("tar -xzf {}: {e}", crate_file.display()))?;
        if !status.success() {
            return Err(format!("tar -xzf {}: {status}", crate_file.display()));
        }
        members.push_str(&format!("    \"{unpacked}\",\n"));
        patches.push_str(&format!("{name} = {{ path = \"{unpacked}\" }}\n"));
    }
    let root = shell::workspace_root();
    let manifest = crate::check::read(&root.join("Cargo.toml"))?;
    let manifest = format!(
        "# Written by `cargo xtask ci`: the published crates as packed.\n\
         [workspace]\nresolver = \"3\"\nmembers = [\n{members}]\n\n\
         [patch.crates-io]\n{patches}\n{}",
        profiles(&manifest)
    );
    let written = dir.join("Cargo.toml");
    std::fs::write(&written, manifest).map_err(|e| format!("{}: {e}", written.display()))?;
    std::fs::copy(root.join("Cargo.lock"), dir.join("Cargo.lock"))
        .map_err(|e| format!("Cargo.lock: {e}"))?;
    let mut command = cargo(&["check", "--workspace", "--all-features"]);
    command.current_dir(&dir).env("CARGO_TARGET_DIR", &target);
    Ok(command)
}

/// The workspace's version (`[workspace.package] version`), every published
/// crate's.
fn workspace_version() -> Result<String, String> {
    let manifest = crate::check::read(&shell::workspace_root().join("Cargo.toml"))?;
    let mut in_package = false;
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_package = line == "[workspace.package]";
        } else if in_package
            && let Some(value) = line.strip_prefix("version")
            && let Some(value) = value.trim_start().strip_prefix('=')
        {
            return Ok(value.trim().trim_matches('"').to_owned());
        }
    }
    Err("Cargo.toml: no version in [workspace.package]".to_owned())
}

/// The `[profile.*]` tables of a manifest, as written: the packed crates are
/// checked with the workspace's profiles, so the dependencies the clippy
/// step compiled are the same units.
fn profiles(manifest: &str) -> String {
    let mut kept = String::new();
    let mut in_profile = false;
    for line in manifest.lines() {
        if line.starts_with('[') {
            in_profile = line.starts_with("[profile.");
        }
        if in_profile {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    kept
}

/// Checks idem-diesel under each feature set alone (so a backend's code does not
/// lean on the other's), and proves with `cargo tree` that a SQLite-only build
/// compiles no PostgreSQL client and a PostgreSQL-only build no SQLite.
fn store_feature_sets(steps: &mut Steps) -> Result<(), String> {
    for (features, absent) in STORE_FEATURE_SETS {
        let flags = features.join(" ");
        let mut check = vec!["check", "-p", "idem-diesel"];
        check.extend_from_slice(features);
        steps.run(
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
    use super::{PUBLISHED, commands_without_library, depends_on, profiles, workspace_version};
    use crate::check::{member_dirs, read};

    /// Every workspace member is either in [`PUBLISHED`] (and so packed by
    /// `cargo xtask ci`, with the metadata crates.io shows) or says
    /// `publish = false`: a new example or tool is never published by mistake.
    #[test]
    fn every_member_is_published_or_says_publish_false() -> Result<(), String> {
        let root = idem_testkit::shell::workspace_root();
        let mut published = Vec::new();
        for member in member_dirs(&root)? {
            let manifest = read(&root.join(&member).join("Cargo.toml"))?;
            let name = manifest
                .lines()
                .find_map(|line| line.strip_prefix("name = "))
                .map(|name| name.trim_matches('"'))
                .ok_or(format!("{member}/Cargo.toml names no package"))?;
            let unpublished = manifest
                .lines()
                .any(|line| line.trim() == "publish = false");
            match (PUBLISHED.contains(&name), unpublished) {
                (true, false) => published.push(name.to_owned()),
                (false, true) => {}
                (true, true) => {
                    return Err(format!("{name} is in PUBLISHED but says publish = false"));
                }
                (false, false) => {
                    return Err(format!(
                        "{member}/Cargo.toml: add `publish = false`, or {name} to PUBLISHED in xtask/src/ci.rs"
                    ));
                }
            }
            for field in [
                "description",
                "documentation",
                "readme",
                "keywords",
                "categories",
            ] {
                if !unpublished
                    && !manifest
                        .lines()
                        .any(|line| line.starts_with(&format!("{field} =")))
                {
                    return Err(format!("{name} is published without `{field}`"));
                }
            }
        }
        published.sort();
        let mut expected: Vec<_> = PUBLISHED.iter().map(|name| (*name).to_owned()).collect();
        expected.sort();
        assert_eq!(published, expected, "every published crate is a member");
        Ok(())
    }

    /// The packed crates are checked with the workspace's profiles and
    /// version, read from its manifest.
    #[test]
    fn the_packed_crates_take_the_workspaces_profiles_and_version() -> Result<(), String> {
        let manifest = "[workspace]\nmembers = [\"a\"]\n\n\
                        [profile.dev]\ndebug = \"line-tables-only\"\n\n\
                        [workspace.lints.rust]\nmissing_docs = \"warn\"\n\n\
                        [profile.dev.package.\"*\"]\ndebug = false\n";
        assert_eq!(
            profiles(manifest),
            "[profile.dev]\ndebug = \"line-tables-only\"\n\n\
             [profile.dev.package.\"*\"]\ndebug = false\n"
        );
        assert_eq!(workspace_version()?, env!("CARGO_PKG_VERSION"));
        Ok(())
    }

    /// The doc step names the members that are a command alone; the
    /// examples' commands, whose crates have a library, are not among them.
    #[test]
    fn the_doc_step_names_the_commands_without_a_library() -> Result<(), String> {
        let mut commands = commands_without_library(&idem_testkit::shell::workspace_root())?;
        commands.sort();
        assert_eq!(
            commands,
            ["bench-server", "idem-bench", "idem-e2e", "xtask"]
        );
        Ok(())
    }

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
