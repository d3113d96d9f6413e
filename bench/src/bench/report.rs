//! The bench's results: measured rows, single figures and ratios against their
//! targets; printed as tables and written as JSON.

use serde_json::{Value, json};

use super::load::Measured;

/// Everything one bench run found.
#[derive(Default)]
pub(crate) struct Report {
    pub(crate) rows: Vec<Row>,
    pub(crate) figures: Vec<Figure>,
    pub(crate) ratios: Vec<Ratio>,
    /// Sections that failed, with why.
    pub(crate) failures: Vec<String>,
    /// Notes on the conditions (pinning, machine load).
    pub(crate) notes: Vec<String>,
}

/// One measured workload.
pub(crate) struct Row {
    pub(crate) section: &'static str,
    pub(crate) what: String,
    pub(crate) concurrency: usize,
    pub(crate) records: Option<u64>,
    /// Requests (or transactions) per second.
    pub(crate) rate: f64,
    /// Latency quantiles; `None` where a row measures none (a drain).
    pub(crate) p50_ms: Option<f64>,
    pub(crate) p99_ms: Option<f64>,
    /// The server's CPU use while loaded, in % of one core.
    pub(crate) server_cpu: Option<f64>,
    /// The server's CPU time per request, in microseconds.
    pub(crate) server_micros: Option<f64>,
    /// The load generator's CPU use, in % of one core.
    pub(crate) generator_cpu: Option<f64>,
    /// PostgreSQL's CPU time per request (or transaction), in microseconds.
    pub(crate) database_micros: Option<f64>,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<String>,
}

/// One figure that is not a load run (memory, cleanup speed).
pub(crate) struct Figure {
    pub(crate) section: &'static str,
    pub(crate) what: String,
    pub(crate) value: Option<f64>,
    pub(crate) unit: &'static str,
    pub(crate) note: String,
}

/// A ratio of two figures measured in the same run, and its target.
pub(crate) struct Ratio {
    pub(crate) what: String,
    /// `None`: not measured (`note` says why).
    pub(crate) value: Option<f64>,
    pub(crate) target: Target,
    pub(crate) note: String,
}

/// What a ratio should be.
#[derive(Clone, Copy)]
pub(crate) enum Target {
    AtLeast(f64),
    AtMost(f64),
    /// Reported, with no target.
    None,
}

impl Row {
    pub(crate) fn from_load(
        section: &'static str,
        what: impl Into<String>,
        concurrency: usize,
        measured: &Measured,
    ) -> Self {
        Self {
            section,
            what: what.into(),
            concurrency,
            records: None,
            rate: measured.rps(),
            p50_ms: Some(measured.p50_ms),
            p99_ms: Some(measured.p99_ms),
            server_cpu: measured.server_cpu_percent(),
            server_micros: measured.server_micros_per_request(),
            generator_cpu: measured.generator_cpu,
            database_micros: measured.database_micros_per_request(),
            errors: measured.errors,
            first_error: measured.first_error.clone(),
        }
    }

    pub(crate) fn records(mut self, records: u64) -> Self {
        self.records = Some(records);
        self
    }

    /// A row without latencies (a drain measures a rate, not requests).
    pub(crate) fn without_latency(mut self) -> Self {
        self.p50_ms = None;
        self.p99_ms = None;
        self
    }
}

impl Ratio {
    pub(crate) fn new(what: impl Into<String>, value: f64, target: Target) -> Self {
        Self {
            what: what.into(),
            value: Some(value),
            target,
            note: String::new(),
        }
    }

    pub(crate) fn missing(
        what: impl Into<String>,
        target: Target,
        note: impl Into<String>,
    ) -> Self {
        Self {
            what: what.into(),
            value: None,
            target,
            note: note.into(),
        }
    }

    pub(crate) fn note(mut self, note: impl Into<String>) -> Self {
        self.note = note.into();
        self
    }

    /// `Some(true)` when it meets its target; `None` without a target or value.
    pub(crate) fn meets(&self) -> Option<bool> {
        let value = self.value?;
        match self.target {
            Target::AtLeast(target) => Some(value >= target),
            Target::AtMost(target) => Some(value <= target),
            Target::None => None,
        }
    }

    fn target_text(&self) -> String {
        match self.target {
            Target::AtLeast(target) => format!(">= {target:.2}"),
            Target::AtMost(target) => format!("<= {target:.2}"),
            Target::None => "-".to_owned(),
        }
    }

    fn verdict(&self) -> &'static str {
        match (self.value, self.meets()) {
            (None, _) => "not measured",
            (Some(_), Some(true)) => "meets",
            (Some(_), Some(false)) => "MISSES",
            (Some(_), None) => "(reported)",
        }
    }
}

impl Report {
    /// The tables, as printed.
    pub(crate) fn render(&self, title: &str) -> String {
        let mut out = String::new();
        out.push_str(title);
        out.push('\n');
        for note in &self.notes {
            out.push_str(&format!("  {note}\n"));
        }
        out.push('\n');
        let header = [
            "section",
            "what",
            "c",
            "records",
            "req/s",
            "p50 ms",
            "p99 ms",
            "srv CPU",
            "srv us/req",
            "gen CPU",
            "db us/req",
            "errors",
        ];
        let cells: Vec<[String; 12]> = self
            .rows
            .iter()
            .map(|row| {
                [
                    row.section.to_owned(),
                    row.what.clone(),
                    row.concurrency.to_string(),
                    row.records.map(thousands).unwrap_or_default(),
                    thousands(row.rate.round() as u64),
                    row.p50_ms.map(|ms| format!("{ms:.2}")).unwrap_or_default(),
                    row.p99_ms.map(|ms| format!("{ms:.2}")).unwrap_or_default(),
                    row.server_cpu
                        .map(|cpu| format!("{cpu:.0} %"))
                        .unwrap_or_default(),
                    row.server_micros
                        .map(|micros| format!("{micros:.1}"))
                        .unwrap_or_default(),
                    row.generator_cpu
                        .map(|cpu| format!("{cpu:.0} %"))
                        .unwrap_or_default(),
                    row.database_micros
                        .map(|micros| format!("{micros:.1}"))
                        .unwrap_or_default(),
                    row.errors.to_string(),
                ]
            })
            .collect();
        out.push_str(&table(&header, &cells, &[2, 3, 4, 5, 6, 7, 8, 9, 10, 11]));
        if self.rows.iter().any(|row| row.first_error.is_some()) {
            for row in self.rows.iter().filter(|row| row.errors > 0) {
                if let Some(error) = &row.first_error {
                    out.push_str(&format!("  {} {}: {error}\n", row.section, row.what));
                }
            }
        }
        if !self.figures.is_empty() {
            out.push('\n');
            let header = ["section", "figure", "value", "note"];
            let cells: Vec<[String; 4]> = self
                .figures
                .iter()
                .map(|figure| {
                    [
                        figure.section.to_owned(),
                        figure.what.clone(),
                        figure
                            .value
                            .map(|value| {
                                format!("{} {}", thousands(value.round() as u64), figure.unit)
                            })
                            .unwrap_or_else(|| "not measured".to_owned()),
                        figure.note.clone(),
                    ]
                })
                .collect();
            out.push_str(&table(&header, &cells, &[2]));
        }
        if !self.ratios.is_empty() {
            out.push('\n');
            let header = [
                "ratio (measured side by side)",
                "value",
                "target",
                "verdict",
                "note",
            ];
            let cells: Vec<[String; 5]> = self
                .ratios
                .iter()
                .map(|ratio| {
                    [
                        ratio.what.clone(),
                        ratio
                            .value
                            .map(|value| format!("{value:.2}"))
                            .unwrap_or_else(|| "-".to_owned()),
                        ratio.target_text(),
                        ratio.verdict().to_owned(),
                        ratio.note.clone(),
                    ]
                })
                .collect();
            out.push_str(&table(&header, &cells, &[1]));
        }
        for failure in &self.failures {
            out.push_str(&format!("\nFAILED: {failure}\n"));
        }
        out
    }

    /// Everything, as JSON.
    pub(crate) fn to_json(&self, mode: &str) -> Value {
        json!({
            "mode": mode,
            "notes": self.notes,
            "rows": self.rows.iter().map(|row| json!({
                "section": row.section,
                "what": row.what,
                "concurrency": row.concurrency,
                "records": row.records,
                "per_second": row.rate,
                "p50_ms": row.p50_ms,
                "p99_ms": row.p99_ms,
                "server_cpu_percent": row.server_cpu,
                "server_cpu_us_per_request": row.server_micros,
                "generator_cpu_percent": row.generator_cpu,
                "database_cpu_us_per_request": row.database_micros,
                "errors": row.errors,
                "first_error": row.first_error,
            })).collect::<Vec<_>>(),
            "figures": self.figures.iter().map(|figure| json!({
                "section": figure.section,
                "what": figure.what,
                "value": figure.value,
                "unit": figure.unit,
                "note": figure.note,
            })).collect::<Vec<_>>(),
            "ratios": self.ratios.iter().map(|ratio| json!({
                "what": ratio.what,
                "value": ratio.value,
                "target": match ratio.target {
                    Target::AtLeast(target) => json!({"at_least": target}),
                    Target::AtMost(target) => json!({"at_most": target}),
                    Target::None => Value::Null,
                },
                "meets": ratio.meets(),
                "note": ratio.note,
            })).collect::<Vec<_>>(),
            "failures": self.failures,
        })
    }
}

/// `1234567` as `1,234,567`.
pub(crate) fn thousands(value: u64) -> String {
    let digits = value.to_string();
    let mut out = String::new();
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

/// A plain-text table; columns in `right` are right-aligned.
fn table<const N: usize>(header: &[&str; N], rows: &[[String; N]], right: &[usize]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i > 0 {
                out.push_str(" | ");
            }
            let pad = widths[i].saturating_sub(cell.chars().count());
            if right.contains(&i) {
                out.push_str(&" ".repeat(pad));
                out.push_str(cell);
            } else {
                out.push_str(cell);
                if i + 1 < cells.len() {
                    out.push_str(&" ".repeat(pad));
                }
            }
        }
        out.push('\n');
        out
    };
    let mut out = line(header.to_vec());
    out.push_str(
        &widths
            .iter()
            .map(|w| "-".repeat(*w))
            .collect::<Vec<_>>()
            .join("-+-"),
    );
    out.push('\n');
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_are_grouped() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }

    #[test]
    fn verdicts_follow_targets() {
        assert_eq!(
            Ratio::new("a", 0.95, Target::AtLeast(0.9)).verdict(),
            "meets"
        );
        assert_eq!(
            Ratio::new("a", 0.85, Target::AtLeast(0.9)).verdict(),
            "MISSES"
        );
        assert_eq!(
            Ratio::new("a", 2.5, Target::AtMost(2.0)).verdict(),
            "MISSES"
        );
        assert_eq!(Ratio::new("a", 2.5, Target::None).verdict(), "(reported)");
        assert_eq!(
            Ratio::missing("a", Target::AtLeast(1.0), "not built").verdict(),
            "not measured"
        );
    }
}
