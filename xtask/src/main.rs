//! Project tasks: `cargo xtask ci | e2e | bench | demo`.
//!
//! One binary, a module per task, few dependencies (after rust-analyzer's xtask).

use std::process::ExitCode;

mod bench;
mod ci;
mod demo;
mod e2e;
mod example;
mod shell;

const USAGE: &str = "\
usage: cargo xtask <task>

tasks:
  bench   what idem costs per request, against the bare handler and pgbench (--quick: seconds)
  ci      fmt, clippy and docs (warnings denied), every test, e2e, bench --quick
  demo    the experiment that motivates idem, against payments-axum
  e2e     both examples on every store as real processes, every scenario; a table
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("bench") => bench::run(&args[1..]),
        Some("ci") => ci::run(&args[1..]),
        Some("demo") => demo::run(&args[1..]),
        Some("e2e") => e2e::run(&args[1..]),
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
