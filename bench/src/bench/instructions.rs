//! The `instructions` section: the instructions each consumer executes per
//! message, counted by valgrind's callgrind, which a shared machine does not
//! skew the way it skews time.
//!
//! Each consumer (idem's one at a time, idem's batch handler at 128, the bare
//! consumer; one at a time, c = 1, on PostgreSQL) drains twice under
//! callgrind: a small and a large count of messages, published first by
//! another process (so the publisher's instructions are not counted). The
//! runs' start (connecting, the warm-up) and stop are the same in both, so the
//! difference of their totals over the difference of their messages is what
//! a message costs the consumer process: its own code, its client
//! libraries', the kernel calls it makes (not what they do in the kernel).
//! PostgreSQL's work is not in it: the consumer rows measure that as CPU
//! time.
//!
//! Quick and full runs only: the smoke run builds the dev profile, which
//! callgrind runs about 50 times slower still. Needs `valgrind` (Debian's
//! package).

use std::collections::HashMap;
use std::process::Command;

use super::Bench;
use super::consumer::{Kind, On, Spec, Store, drain_published, on_each_broker};
use super::report::{Figure, Ratio, Report, Target};

/// The batch size of the batch handler's row (the consumer sections'
/// targeted size).
const BATCH: usize = 128;

pub(super) fn instructions(bench: &Bench, report: &mut Report) -> Result<(), String> {
    if bench.settings.mode == "smoke" {
        report.notes.push(
            "instructions: quick and full runs only (callgrind on the dev build takes minutes): \
             cargo xtask bench --quick --only instructions"
                .to_owned(),
        );
        return Ok(());
    }
    let found = Command::new("valgrind").arg("--version").output();
    if !found.is_ok_and(|output| output.status.success()) {
        return Err(
            "the instructions section counts with valgrind's callgrind, which is not installed: \
             apt-get install valgrind"
                .to_owned(),
        );
    }
    let (small, large) = bench.settings.instruction_messages;
    report.notes.push(format!(
        "instructions rows: the consumer process's instructions per message under callgrind, \
         the difference of two drains ({large} and {small} messages, published by another \
         process) over their difference in messages: the consumer's code, its client \
         libraries', its calls into the kernel; not PostgreSQL's nor the broker's; each \
         larger drain's profile is kept for callgrind_annotate: {}/callgrind.*.out",
        bench.logs.display()
    ));
    on_each_broker(bench, report, "instructions", rows)
}

fn rows(
    bench: &Bench,
    report: &mut Report,
    on: &On,
    database: &(Store, String),
) -> Result<(), String> {
    let idem = per_message(bench, on, database, Kind::Idem, None)?;
    let batch = per_message(bench, on, database, Kind::Idem, Some(BATCH))?;
    let bare = per_message(bench, on, database, Kind::Bare, None)?;
    let figure = |what: String, cost: PerMessage| Figure {
        section: "instructions",
        what,
        value: Some(cost.all),
        unit: "instr/msg",
        note: format!(
            "callgrind, c=1, PostgreSQL; {:.0} of them SHA-256, in software under valgrind",
            cost.sha256
        ),
    };
    report
        .figures
        .push(figure(format!("{} + PgInbox", on.idem()), idem));
    report.figures.push(figure(
        format!("{} + PgInbox, batch {BATCH}", on.idem()),
        batch,
    ));
    report.figures.push(figure(
        format!("{} + the same PostgreSQL transaction", on.bare()),
        bare,
    ));
    for (what, cost) in [("", idem), (&*format!(", batch {BATCH}"), batch)] {
        let (value, bare) = (cost.all, bare.all);
        let hashless = cost.all - cost.sha256;
        report.ratios.push(
            Ratio::new(
                format!(
                    "{} + PgInbox{what} / {}, instructions per message (c=1)",
                    on.idem(),
                    on.bare()
                ),
                value / bare,
                Target::None,
            )
            .note(format!(
                "callgrind: idem {value:.0}, bare {bare:.0} instructions a message; without \
                 SHA-256 (software under valgrind) idem {hashless:.0}, {:.2} of bare",
                hashless / bare
            )),
        );
    }
    Ok(())
}

/// What a message costs one consumer, in instructions.
#[derive(Clone, Copy)]
struct PerMessage {
    all: f64,
    /// Those of SHA-256 (idem's fingerprint of each body), which valgrind
    /// runs in software: natively the CPU's SHA extensions take a small
    /// fraction of them.
    sha256: f64,
}

/// The instructions one consumer spends per message: two drains under
/// callgrind, their totals' difference over their messages'.
fn per_message(
    bench: &Bench,
    on: &On,
    database: &(Store, String),
    kind: Kind,
    batch: Option<usize>,
) -> Result<PerMessage, String> {
    let (small, large) = bench.settings.instruction_messages;
    let batched = batch.map_or(String::new(), |size| format!("-batch{size}"));
    let kept = bench.logs.join(format!(
        "callgrind.{}-{}{batched}.out",
        on.section(),
        kind.flag()
    ));
    let mut totals = Vec::new();
    let mut sha256 = Vec::new();
    for messages in [small, large] {
        let spec = Spec {
            kind,
            c: 1,
            batch,
            messages,
            warmup: bench.settings.consumer_warmup,
        };
        let out = bench
            .logs
            .join(format!("callgrind.{}.out", spec.queue(database.0)));
        let runner = [
            "valgrind".to_owned(),
            "--tool=callgrind".to_owned(),
            format!("--callgrind-out-file={}", out.display()),
        ];
        drain_published(bench, on, database, &spec, &runner)?;
        let text = std::fs::read_to_string(&out).map_err(|e| format!("{}: {e}", out.display()))?;
        // The larger drain's profile is kept, for `callgrind_annotate`.
        let _ = if messages == large {
            std::fs::rename(&out, &kept)
        } else {
            std::fs::remove_file(&out)
        };
        totals.push(total(&text).ok_or_else(|| format!("{}: no totals line", out.display()))?);
        sha256.push(own_cost(&text, |name| name.starts_with("sha2::")));
    }
    let extra = large.saturating_sub(small).max(1) as f64;
    Ok(PerMessage {
        all: (totals[1] as f64 - totals[0] as f64) / extra,
        sha256: (sha256[1] as f64 - sha256[0] as f64) / extra,
    })
}

/// The instructions spent in the functions `matches` names, not in what they
/// call: the cost lines of a callgrind output under those functions' `fn=`,
/// the inclusive cost after each `calls=` line left out. Names may be
/// compressed (`fn=(7) name`, or `cfn=(7) name`, the first time; `fn=(7)`
/// after).
fn own_cost(callgrind_out: &str, matches: impl Fn(&str) -> bool) -> u64 {
    let mut names: HashMap<&str, &str> = HashMap::new();
    let (mut counted, mut after_calls, mut sum) = (false, false, 0u64);
    for line in callgrind_out.lines() {
        if let Some(called) = line.strip_prefix("cfn=") {
            // A called function's name may be given first here.
            if let Some((id, name)) = called.split_once(' ') {
                names.insert(id, name);
            }
        } else if let Some(function) = line.strip_prefix("fn=") {
            let name = match function.split_once(' ') {
                Some((id, name)) if id.starts_with('(') => {
                    names.insert(id, name);
                    name
                }
                _ if function.starts_with('(') => names.get(function).copied().unwrap_or(""),
                _ => function,
            };
            counted = matches(name);
            after_calls = false;
        } else if line.starts_with("calls=") {
            after_calls = true;
        } else if line.starts_with(|c: char| c.is_ascii_digit() || "+-*".contains(c)) {
            if counted && !after_calls {
                sum += line
                    .split_whitespace()
                    .last()
                    .and_then(|cost| cost.parse::<u64>().ok())
                    .unwrap_or(0);
            }
            after_calls = false;
        }
    }
    sum
}

/// The instructions a callgrind output counted: its `totals:` line (or,
/// from older versions, `summary:`).
fn total(callgrind_out: &str) -> Option<u64> {
    callgrind_out
        .lines()
        .find_map(|line| {
            line.strip_prefix("totals:")
                .or_else(|| line.strip_prefix("summary:"))
        })
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|count| count.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::{own_cost, total};

    #[test]
    fn the_totals_line_gives_the_instructions() {
        let out = "version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nfn=(1) main\n3 7\n\ntotals: 123456789\n";
        assert_eq!(total(out), Some(123_456_789));
        assert_eq!(total("summary: 42\n"), Some(42));
        assert_eq!(total("events: Ir\n"), None);
    }

    #[test]
    fn a_function_s_own_cost_leaves_its_calls_out() {
        let out = "events: Ir\nfn=(1) sha2::sha256::compress256\n10 300\n+2 50\n\
                   cfn=(2) memcpy\ncalls=1 0\n12 999\n13 7\nfn=(2)\n1 40\n\
                   fn=(1)\n* 3\n";
        assert_eq!(own_cost(out, |name| name.starts_with("sha2::")), 360);
        assert_eq!(own_cost(out, |name| name == "memcpy"), 40);
    }
}
