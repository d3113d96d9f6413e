//! `memory`: what one record of the in-memory store costs in resident memory.

use idem_core::MemoryStore;

use crate::BoxError;

/// How many records, and how large their bodies.
#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    /// Records to complete.
    #[arg(long, default_value_t = 1_000_000)]
    records: usize,
}

/// Completes `records` records (200-byte bodies, a UUID key, one of 100 scopes,
/// one header) in a store with room for all of them, and prints the growth of
/// the resident set per record next to what the store counts per record.
pub(crate) fn run(options: &Options) -> Result<(), BoxError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let store = MemoryStore::builder()
        .max_records(options.records.max(1) * 2)
        .max_bytes(usize::MAX / 2)
        .build();
    let before = resident_bytes()?;
    runtime.block_on(crate::serve::prefill(&store, options.records))?;
    let after = resident_bytes()?;
    let records = store.len().max(1);
    let growth = after.saturating_sub(before);
    let answer = serde_json::json!({
        "records": store.len(),
        "body_bytes": 200,
        "rss_before": before,
        "rss_after": after,
        "rss_bytes_per_record": growth as f64 / records as f64,
        "counted_bytes_per_record": store.used_bytes() as f64 / records as f64,
    });
    println!("{answer}");
    Ok(())
}

/// This process's resident set (`VmRSS`), in bytes.
pub(crate) fn resident_bytes() -> Result<u64, BoxError> {
    status_bytes("VmRSS:")
}

/// This process's peak resident set so far (`VmHWM`), in bytes.
pub(crate) fn peak_resident_bytes() -> Result<u64, BoxError> {
    status_bytes("VmHWM:")
}

/// A size field of `/proc/self/status` (`VmRSS:`, `VmHWM:`), in bytes.
fn status_bytes(field: &str) -> Result<u64, BoxError> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map(|kib| kib * 1024)
        .ok_or_else(|| format!("no {field} in /proc/self/status").into())
}
