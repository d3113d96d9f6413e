//! The steps of a task, each timed, and the table of their seconds printed
//! when the task ends (passed or not): where a run spends its time.

use std::process::Command;
use std::time::{Duration, Instant};

use idem_testkit::shell;

/// How a step ended.
#[derive(Debug)]
enum Outcome {
    Passed,
    Failed,
    /// Not run, and why (its inputs did not change since it last passed).
    Skipped(String),
}

/// The steps run so far, in order.
#[derive(Debug)]
pub(crate) struct Steps {
    task: &'static str,
    started: Instant,
    rows: Vec<(String, Duration, Outcome)>,
    /// Lines printed under the table (the counts of tests and rows).
    totals: Vec<String>,
}

impl Steps {
    pub(crate) fn new(task: &'static str) -> Self {
        Self {
            task,
            started: Instant::now(),
            rows: Vec::new(),
            totals: Vec::new(),
        }
    }

    /// Runs `command` as the step `name` ([`shell::run`]).
    pub(crate) fn run(&mut self, name: &str, command: &mut Command) -> Result<(), String> {
        self.time(name, || shell::run(name, command))
    }

    /// Runs `step` as the step `name`, timed.
    pub(crate) fn time<T>(
        &mut self,
        name: &str,
        step: impl FnOnce() -> Result<T, String>,
    ) -> Result<T, String> {
        let started = Instant::now();
        let result = step();
        let outcome = match result {
            Ok(_) => Outcome::Passed,
            Err(_) => Outcome::Failed,
        };
        self.rows
            .push((name.to_owned(), started.elapsed(), outcome));
        result
    }

    /// Records the step `name` as not run, for `why`.
    pub(crate) fn skip(&mut self, name: &str, why: &str) {
        eprintln!("\n==> {name}: skipped, {why}");
        self.rows.push((
            name.to_owned(),
            Duration::ZERO,
            Outcome::Skipped(why.to_owned()),
        ));
    }

    /// A line printed under the table, such as `tests: N passed, M failed`.
    pub(crate) fn total(&mut self, line: String) {
        self.totals.push(line);
    }

    /// The table: one line per step with its seconds, then the whole run's.
    pub(crate) fn table(&self, passed: bool) -> String {
        let width = self
            .rows
            .iter()
            .map(|(name, ..)| name.chars().count())
            .max()
            .unwrap_or(0)
            .max(5);
        let mut table = format!("\n==> cargo xtask {}: seconds per step\n", self.task);
        for (name, took, outcome) in &self.rows {
            let (secs, note) = match outcome {
                Outcome::Passed => (format!("{:.0}", took.as_secs_f64()), String::new()),
                Outcome::Failed => (format!("{:.0}", took.as_secs_f64()), "FAILED".to_owned()),
                Outcome::Skipped(why) => ("-".to_owned(), format!("skipped: {why}")),
            };
            table.push_str(&format!("  {name:<width$}  {secs:>5}  {note}\n"));
        }
        let verdict = if passed { "passed" } else { "FAILED" };
        table.push_str(&format!(
            "  {:<width$}  {:>5}  {verdict}\n",
            "total",
            format!("{:.0}", self.started.elapsed().as_secs_f64()),
        ));
        for line in &self.totals {
            table.push_str(line);
            table.push('\n');
        }
        table
    }
}

#[cfg(test)]
mod tests {
    use super::Steps;

    #[test]
    fn the_table_lists_each_step_with_its_outcome() {
        let mut steps = Steps::new("ci");
        assert_eq!(steps.time("fmt", || Ok::<_, String>(())), Ok(()));
        assert_eq!(
            steps.time("a longer step", || Err::<(), _>("no".to_owned())),
            Err("no".to_owned())
        );
        steps.skip("package", "sources unchanged");
        steps.total("tests: 3 passed, 0 failed".to_owned());
        let table = steps.table(false);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines[1], "==> cargo xtask ci: seconds per step");
        assert_eq!(lines[2], "  fmt                0  ");
        assert_eq!(lines[3], "  a longer step      0  FAILED");
        assert_eq!(
            lines[4],
            "  package            -  skipped: sources unchanged"
        );
        assert_eq!(lines[5], "  total              0  FAILED");
        assert_eq!(lines[6], "tests: 3 passed, 0 failed");
    }
}
