//! The benchmark (`idem-bench [--quick] [--only SECTION] [--out PATH]`,
//! behind `cargo xtask bench`).

use std::process::ExitCode;

mod bench;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match bench::run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("idem-bench: {message}");
            ExitCode::FAILURE
        }
    }
}
