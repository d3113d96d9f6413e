//! Project tasks: `cargo xtask ci | e2e | bench | demo`.
//!
//! A dispatcher, after rust-analyzer's xtask: `ci` runs the checks in the
//! order that fails fastest; `e2e` and `demo` run the `idem-e2e` crate, `bench`
//! the `idem-bench` crate, each compiled only when its task (or CI step) comes.

use std::process::ExitCode;

use idem_testkit::shell::{self, cargo};

mod ci;
mod readme;
mod stress;

const USAGE: &str = "\
usage: cargo xtask <task>

tasks:
  bench   what idem costs per request, against the bare handler and pgbench (--quick: seconds)
  ci      fmt, clippy and docs (warnings denied), every test, e2e, bench --quick
          (--stress [RUNS]: instead, every test RUNS times (3) with the CPUs loaded)
  demo    the experiment that motivates idem, against payments-axum
  e2e     both examples on every store as real processes, every scenario; a table
  kafka-broker  builds the Kafka-compatible broker the tests start (tansu, once)
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rest = args.get(1..).unwrap_or_default();
    let result = match args.first().map(String::as_str) {
        Some("bench") => bench(rest),
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
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::FAILURE
        }
    }
}

/// `cargo run -p idem-e2e -- TASK ARGS…`
fn e2e(task: &str, args: &[String]) -> Result<(), String> {
    let mut command = cargo(&["run", "-q", "-p", "idem-e2e", "--", task]);
    command.args(args);
    shell::run(
        &format!("cargo xtask {task} {}", args.join(" ")),
        &mut command,
    )
}

/// `cargo run -p idem-bench -- ARGS…`
fn bench(args: &[String]) -> Result<(), String> {
    let mut command = cargo(&["run", "-q", "-p", "idem-bench", "--"]);
    command.args(args);
    shell::run(
        &format!("cargo xtask bench {}", args.join(" ")),
        &mut command,
    )
}
