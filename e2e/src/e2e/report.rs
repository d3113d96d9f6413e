//! The table: scenario × example × store → result and the figure behind it.

use std::collections::BTreeMap;

use crate::example::Example;

use super::site::StoreKind;

/// One row of the table.
pub(crate) struct Row {
    /// Position in the catalogue, then in the scenario's checks: the table's order.
    pub(crate) order: (usize, usize),
    pub(crate) check: &'static str,
    pub(crate) example: Example,
    pub(crate) store: StoreKind,
    pub(crate) verdict: Verdict,
    pub(crate) figure: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Pass,
    /// With the details: request, expected, got.
    Fail(String),
    /// Listed, not counted.
    NotBuilt,
}

/// The totals, for the exit status.
pub(crate) struct Totals {
    pub(crate) passed: usize,
    pub(crate) failed: usize,
}

/// Prints the table, the details of every failure, `notes` (e.g. where the
/// logs are), the rows not built, and last the line `N passed, M failed`.
pub(crate) fn print(rows: &mut [Row], notes: &[String]) -> Totals {
    rows.sort_by_key(|r| (r.order, r.example.package(), r.store));
    let headers = ["scenario", "example", "store", "result", "figure"];
    let cells: Vec<[String; 5]> = rows
        .iter()
        .map(|r| {
            [
                r.check.to_owned(),
                short(r.example).to_owned(),
                r.store.name().to_owned(),
                match r.verdict {
                    Verdict::Pass => "pass",
                    Verdict::Fail(_) => "FAIL",
                    Verdict::NotBuilt => "not built",
                }
                .to_owned(),
                r.figure.clone(),
            ]
        })
        .collect();
    let mut widths = headers.map(|h| h.chars().count());
    for row in &cells {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let mut text = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                text.push_str(cell);
            } else {
                text.push_str(&format!("{cell:w$} | ", w = widths[i]));
            }
        }
        text
    };
    println!();
    println!("{}", line(&headers.map(str::to_owned)));
    println!(
        "{}",
        widths
            .iter()
            .map(|w| "-".repeat(*w))
            .collect::<Vec<_>>()
            .join("-+-")
    );
    for row in &cells {
        println!("{}", line(row));
    }

    let failures: Vec<&Row> = rows
        .iter()
        .filter(|r| matches!(r.verdict, Verdict::Fail(_)))
        .collect();
    if !failures.is_empty() {
        println!("\nfailures:");
        // One cause often fails many rows (an example that does not start on
        // a store): its details are told once, with the rows it failed.
        let mut causes: Vec<(&str, Vec<String>)> = Vec::new();
        for row in &failures {
            if let Verdict::Fail(details) = &row.verdict {
                let label = format!(
                    "{} · {} · {}",
                    row.check,
                    short(row.example),
                    row.store.name()
                );
                match causes.iter_mut().find(|(d, _)| d == details) {
                    Some((_, labels)) => labels.push(label),
                    None => causes.push((details, vec![label])),
                }
            }
        }
        for (details, labels) in causes {
            let more = match labels.len() {
                1 => String::new(),
                n => format!(" and {} more rows", n - 1),
            };
            println!(
                "\n[{}]{more}\n  {}",
                labels[0],
                details.replace('\n', "\n  ")
            );
        }
    }
    println!();
    for note in notes {
        println!("{note}");
    }
    // Rows not built, named once per check with where and why.
    let mut not_built: BTreeMap<(usize, usize), (&str, Vec<String>, &str)> = BTreeMap::new();
    for row in rows.iter().filter(|r| r.verdict == Verdict::NotBuilt) {
        let entry = not_built
            .entry(row.order)
            .or_insert((row.check, Vec::new(), &row.figure));
        entry
            .1
            .push(format!("{}·{}", short(row.example), row.store.name()));
    }
    if !not_built.is_empty() {
        let named: Vec<String> = not_built
            .values()
            .map(|(check, places, why)| format!("{check} ({}: {why})", places.join(", ")))
            .collect();
        println!("not built: {}", named.join("; "));
    }
    let totals = Totals {
        passed: rows.iter().filter(|r| r.verdict == Verdict::Pass).count(),
        failed: failures.len(),
    };
    println!("{} passed, {} failed", totals.passed, totals.failed);
    totals
}

fn short(example: Example) -> &'static str {
    match example {
        Example::Axum => "axum",
        Example::Actix => "actix",
        Example::Consumer => "consumer",
        Example::OrdersAxum => "orders-axum",
        Example::OrdersActix => "orders-actix",
    }
}
