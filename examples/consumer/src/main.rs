//! `consumer`: the inbox demo. Reads an at-least-once stream of balance changes
//! twice, without and with idem-diesel's inbox, and prints both balances
//! against the exact one.
//!
//! `--database-url postgres://…` (or `DATABASE_URL`) names the database; without
//! one, the demo runs on a throwaway PostgreSQL cluster (feature
//! `demo-cluster`, on by default; it needs the PostgreSQL server binaries).

use std::process::ExitCode;

use clap::Parser;
use idem_core::retry::Backoff;

/// Shows that a consumer without an inbox gets balances wrong on an
/// at-least-once stream, and that idem-diesel's inbox makes them exact.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The PostgreSQL database to run in (its tables are created if missing).
    /// Without one, a throwaway cluster is started.
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    // Kept to the end of `main`: the throwaway cluster is stopped and deleted
    // when it drops, whatever happened.
    let (url, _cluster) = match args.database_url {
        Some(url) => (url, None),
        None => match throwaway_cluster() {
            Ok((url, cluster)) => (url, Some(cluster)),
            Err(message) => {
                eprintln!("error: {message}");
                return ExitCode::FAILURE;
            }
        },
    };
    run_and_report(&url)
}

/// Runs the demo on its own runtime and prints its report.
fn run_and_report(url: &str) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: no Tokio runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(consumer::run(url, Backoff::for_consumers())) {
        Ok(report) => {
            for line in report.lines() {
                println!("{line}");
            }
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {}", error_chain(&error));
            ExitCode::FAILURE
        }
    }
}

#[cfg(feature = "demo-cluster")]
type Cluster = idem_testkit::TestPostgres;
/// Without the feature there is no cluster to keep.
#[cfg(not(feature = "demo-cluster"))]
struct Cluster;

#[cfg(feature = "demo-cluster")]
fn throwaway_cluster() -> Result<(String, Cluster), String> {
    eprintln!("no --database-url: starting a throwaway PostgreSQL cluster");
    let cluster = Cluster::start().map_err(|error| error_chain(&error))?;
    cluster
        .create_database("consumer_demo")
        .map_err(|error| error_chain(&error))?;
    Ok((cluster.url("consumer_demo"), cluster))
}

#[cfg(not(feature = "demo-cluster"))]
fn throwaway_cluster() -> Result<(String, Cluster), String> {
    Err(
        "no database: pass --database-url postgres://… (or set DATABASE_URL); \
         this build has no throwaway cluster (feature `demo-cluster`)"
            .to_owned(),
    )
}

fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
