//! Project tasks: `cargo xtask ci | check | e2e | bench | storm | demo`.
//!
//! A dispatcher, after rust-analyzer's xtask: `ci` runs the checks in the
//! order that fails fastest; `check` the fast loop for a change; `e2e` and
//! `demo` run the `idem-e2e` crate, `bench` the `idem-bench` crate, each
//! compiled only when its task (or CI step) comes.
//!
//! Every task builds in the cache outside the checkout
//! ([`shell::use_cache_target`]: `~/.cache/idem/target`, or
//! `$IDEM_CI_CACHE/target`; `CARGO_TARGET_DIR` wins), so a clean clone starts
//! warm; [`freshness`] makes cargo judge a clone's files by their content.

use std::process::ExitCode;

use idem_testkit::shell;

mod check;
mod ci;
mod freshness;
mod readme;
mod steps;
mod stress;
mod suite;

const USAGE: &str = "\
usage: cargo xtask <task>

tasks:
  bench   what idem costs per request, against the bare handler and pgbench
          (--quick: one round, 7 for the consumer rows, minutes; --smoke: each
          section runs, measures nothing)
  check   the fast loop for a change: fmt, clippy, the tests of the crates that
          changed (against HEAD, or --since REV) and of those that depend on them
  ci      fmt, clippy and docs (warnings denied), every test, e2e, bench --smoke --dev
          (--stress [RUNS]: instead, every test RUNS times (3) with the CPUs loaded)
  demo    the experiment that motivates idem, against payments-axum
  e2e     both examples on every store as real processes, every scenario; a table
  kafka-broker  builds the Kafka-compatible broker the tests start (tansu, once)
  storm   100 clients whose charges fail at once, retrying by four strategies
          through idem-client: requests per 10 ms at payments-axum, a chart,
          target/bench/storm.svg (bench --only storm; --dev: unoptimized)
";

/// Set by `.ci/run`: this checkout is a clean clone whose every build goes
/// through `cargo xtask` into the cache, so its files may take back the times
/// recorded for the same content ([`freshness`]).
const CLEAN_CHECKOUT: &str = "IDEM_CLEAN_CHECKOUT";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rest = args.get(1..).unwrap_or_default();
    let task = args.first().map(String::as_str);
    let sources = match task {
        Some("bench" | "check" | "ci" | "demo" | "e2e" | "storm") => {
            let target = shell::use_cache_target();
            let restore = std::env::var_os(CLEAN_CHECKOUT).is_some_and(|v| v == "1");
            match freshness::sync(&target, restore) {
                Ok(sources) => sources,
                Err(message) => {
                    eprintln!("xtask: {message}");
                    return ExitCode::FAILURE;
                }
            }
        }
        _ => None,
    };
    let result = match task {
        Some("bench") => bench(rest),
        Some("storm") => storm(rest),
        Some("check") => check::run(rest),
        Some("ci") => ci::run(rest),
        Some("demo") => e2e("demo", rest),
        Some("e2e") => e2e("e2e", rest),
        Some("kafka-broker") => ci::kafka_broker(),
        Some("-h" | "--help" | "help") => {
            print!("{USAGE}");
            Ok(())
        }
        Some(other) => Err(format!("unknown task `{other}`\n\n{USAGE}")),
        None => Err(USAGE.to_owned()),
    };
    drop(sources);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::FAILURE
        }
    }
}

/// The runner `package` (its binary of the same name) with `args`: built
/// with the workspace's dev build (`cargo build --workspace --all-features
/// --bins --tests`, what `cargo test` and the runners' `--dev` build too), so
/// its dependencies are the ones already built, not built again with the
/// features of a `cargo run -p` of the runner alone; then started from the
/// workspace root.
fn runner(package: &str, args: &[&str]) -> Result<std::process::Command, String> {
    let dir = shell::Profile::Dev.build(&[])?;
    let mut command = std::process::Command::new(dir.join(package));
    command
        .args(args)
        .current_dir(shell::workspace_root())
        .env("CARGO_TARGET_DIR", shell::target_dir());
    Ok(command)
}

/// `idem-e2e TASK ARGS…` ([`runner`]).
fn e2e(task: &str, args: &[String]) -> Result<(), String> {
    let mut all = vec![task];
    all.extend(args.iter().map(String::as_str));
    shell::run(
        &format!("cargo xtask {}", all.join(" ")),
        &mut runner("idem-e2e", &all)?,
    )
}

/// `idem-e2e ARGS…` ([`runner`]), its output passed on line by line;
/// `rows` gets the last line of the form `N passed, M failed` (the runner's
/// closing line).
fn e2e_counted(args: &[&str], rows: &mut Option<String>) -> Result<(), String> {
    use std::io::BufRead;
    let step = format!("cargo xtask {}", args.join(" "));
    let mut command = runner("idem-e2e", args)?;
    eprintln!("\n==> {step}");
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("{step}: could not start: {e}"))?;
    if let Some(stdout) = child.stdout.take() {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            println!("{line}");
            if is_count_line(&line) {
                *rows = Some(line);
            }
        }
    }
    let status = child.wait().map_err(|e| format!("{step}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{step} failed ({status})"))
    }
}

/// `idem-bench ARGS…` ([`runner`]).
fn bench(args: &[String]) -> Result<(), String> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    shell::run(
        &format!("cargo xtask bench {}", args.join(" ")),
        &mut runner("idem-bench", &args)?,
    )
}

/// `cargo xtask storm ARGS…`: the bench's section `storm` alone, its JSON
/// in `target/bench/storm.json` (beside, not over, the whole bench's).
fn storm(args: &[String]) -> Result<(), String> {
    let out = shell::target_dir().join("bench/storm.json");
    let mut all = vec![
        "--only".to_owned(),
        "storm".to_owned(),
        "--out".to_owned(),
        out.display().to_string(),
    ];
    all.extend_from_slice(args);
    bench(&all)
}

/// Whether `line` is exactly `N passed, M failed`.
fn is_count_line(line: &str) -> bool {
    matches!(
        line.split_whitespace().collect::<Vec<_>>()[..],
        [passed, "passed,", failed, "failed"]
            if passed.parse::<u64>().is_ok() && failed.parse::<u64>().is_ok()
    )
}

#[cfg(test)]
mod tests {
    use super::is_count_line;

    #[test]
    fn the_runners_closing_line_is_recognised() {
        assert!(is_count_line("202 passed, 0 failed"));
        assert!(!is_count_line("202 passed, 0 failed, 1 skipped"));
        assert!(!is_count_line("tests: 202 passed, 0 failed"));
        assert!(!is_count_line("x passed, 0 failed"));
    }
}
