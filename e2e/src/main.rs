//! The end-to-end runner (`idem-e2e e2e …`, behind `cargo xtask e2e`) and the
//! demo (`idem-e2e demo …`, behind `cargo xtask demo`): the examples as real
//! processes, on throwaway servers from `idem_testkit`; payments-consumer
//! through [`consumer_harness`].

use std::process::ExitCode;

mod consumer_harness;
mod demo;
mod e2e;
mod example;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("e2e") => e2e::run(&args[1..]),
        Some("demo") => demo::run(&args[1..]),
        _ => Err("usage: idem-e2e e2e|demo [OPTIONS] (through `cargo xtask e2e|demo`)".to_owned()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("idem-e2e: {message}");
            ExitCode::FAILURE
        }
    }
}
