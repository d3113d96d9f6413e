//! `cargo xtask ci --stress [RUNS]`: every test of the workspace, RUNS times
//! (3 by default), with every CPU kept busy by a spinning thread of this
//! process, so that a test leaning on how fast or warm the machine is (a
//! server used before it reported ready, a timeout that holds only on an idle
//! machine) fails here rather than in CI.
//!
//! The tests are built first, unloaded; each run's output goes to
//! `target/stress/run-N.log`, and a failed run's failing lines are printed.
//! Ends with `stress: N passed, M failed` (runs).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use idem_testkit::shell::{self, target_dir};

use crate::ci::test;

/// Runs the suite `runs` times under load.
pub(crate) fn run(runs: Option<&str>) -> Result<(), String> {
    let runs: usize = match runs {
        None => 3,
        Some(runs) => runs
            .parse()
            .ok()
            .filter(|runs| *runs > 0)
            .ok_or_else(|| format!("--stress takes a number of runs, not {runs}"))?,
    };
    shell::run("cargo test --no-run (unloaded)", test().arg("--no-run"))?;
    let logs = target_dir().join("stress");
    std::fs::create_dir_all(&logs).map_err(|e| format!("{}: {e}", logs.display()))?;
    let cpus = std::thread::available_parallelism().map_or(2, usize::from);
    let load = Load::start(cpus);
    let mut passed = 0;
    for run in 1..=runs {
        let log = logs.join(format!("run-{run}.log"));
        let file = File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = file
            .try_clone()
            .map_err(|e| format!("{}: {e}", log.display()))?;
        eprintln!(
            "\n==> stress run {run}/{runs}: cargo test, {cpus} CPUs loaded ({})",
            log.display()
        );
        let started = Instant::now();
        let status = test()
            .stdout(Stdio::from(file))
            .stderr(Stdio::from(err))
            .status()
            .map_err(|e| format!("cargo test: could not start: {e}"))?;
        let took = started.elapsed().as_secs_f64();
        if status.success() {
            passed += 1;
            eprintln!("==> stress run {run}/{runs}: passed in {took:.0} s");
        } else {
            eprintln!("==> stress run {run}/{runs}: FAILED ({status}) after {took:.0} s:");
            for line in failing_lines(&log) {
                eprintln!("    {line}");
            }
        }
    }
    drop(load);
    let failed = runs - passed;
    println!("stress: {passed} passed, {failed} failed");
    if failed == 0 {
        Ok(())
    } else {
        Err(format!(
            "{failed} of {runs} stress runs failed; logs in {}",
            logs.display()
        ))
    }
}

/// The lines of a test log that say what failed.
fn failing_lines(log: &std::path::Path) -> Vec<String> {
    let Ok(file) = File::open(log) else {
        return Vec::new();
    };
    BufReader::new(file)
        .lines()
        .map_while(Result::ok)
        .filter(|line| {
            line.contains("FAILED")
                || line.contains("panicked")
                || line.starts_with("error")
                || line.contains("test result: FAILED")
        })
        .take(40)
        .collect()
}

/// Spinning threads, one per CPU, until dropped.
struct Load {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Load {
    fn start(threads: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..threads)
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut spin: u64 = 0;
                    while !stop.load(Ordering::Relaxed) {
                        spin = std::hint::black_box(spin.wrapping_mul(31).wrapping_add(7));
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}
