//! CPU time from `/proc`: what a process has used, and what a PostgreSQL
//! server has (its postmaster, its backends, and the children it reaped).
//! The benchmarks read it before and after a measured window; the bench
//! runner and its helper processes share these readings.

use std::process::Command;
use std::sync::OnceLock;

/// CPU time (user + system) `pid` has used so far, in seconds.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields = stat_fields(&stat)?;
    Some((fields[11] + fields[12]) as f64 / clock_ticks())
}

/// The CPU time, in seconds, of the PostgreSQL server listening on `port`:
/// the postmaster, its live children (backends, background workers) and the
/// children it has reaped (connections that closed).
pub fn postgres_cpu_seconds(port: u16) -> Option<f64> {
    let port = port.to_string();
    let mut postmaster = None;
    let mut parents = Vec::new();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(fields) = stat_fields(&stat) else {
            continue;
        };
        parents.push((pid, fields));
        if postmaster.is_none()
            && let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline"))
        {
            let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
            let is_postgres = args
                .first()
                .is_some_and(|program| program.ends_with(b"postgres"));
            let on_port = args
                .windows(2)
                .any(|pair| pair[0] == b"-p" && pair[1] == port.as_bytes());
            if is_postgres && on_port {
                postmaster = Some(pid);
            }
        }
    }
    let postmaster = postmaster?;
    let ticks: u64 = parents
        .iter()
        .map(|(pid, fields)| {
            if *pid == postmaster {
                // utime, stime, cutime, cstime
                fields[11] + fields[12] + fields[13] + fields[14]
            } else if fields[1] == u64::from(postmaster) {
                fields[11] + fields[12]
            } else {
                0
            }
        })
        .sum();
    Some(ticks as f64 / clock_ticks())
}

/// The numeric fields of `/proc/PID/stat` after the command name (index 0 is
/// the state, shown as 0): ppid at 1, utime at 11, stime 12, cutime 13, cstime 14.
fn stat_fields(stat: &str) -> Option<Vec<u64>> {
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let fields: Vec<u64> = rest
        .split(' ')
        .take(15)
        .map(|field| field.parse().unwrap_or(0))
        .collect();
    (fields.len() == 15).then_some(fields)
}

/// Clock ticks per second (`getconf CLK_TCK`; 100 on Linux), asked once.
fn clock_ticks() -> f64 {
    static TICKS: OnceLock<f64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|out| String::from_utf8(out.stdout).ok())
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_a_cpu_time() {
        let seconds = cpu_seconds(std::process::id()).unwrap();
        assert!(seconds >= 0.0);
        assert_eq!(stat_fields("1 (a b) S 0"), None, "too few fields");
    }
}
