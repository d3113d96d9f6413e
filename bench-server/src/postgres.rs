//! PostgreSQL: a throwaway cluster, records to measure against, the store's own
//! statements for pgbench, and a timed cleanup sweep.

use std::io::Write;
use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel::sql_types::Text;
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use idem_core::store::{ClaimOutcome, ClaimRequest, OwnerToken};
use idem_core::{Fingerprint, IdempotencyKey, Scope, Store};
use idem_diesel::{PgStore, SweepReport};
use idem_testkit::TestPostgres;

use crate::BoxError;
use crate::handler;

/// `cluster`: which databases to create.
#[derive(Debug, clap::Args)]
pub(crate) struct ClusterOptions {
    /// Databases to create, comma-separated.
    #[arg(long, value_delimiter = ',')]
    databases: Vec<String>,
}

/// A database URL.
#[derive(Debug, clap::Args)]
pub(crate) struct UrlOptions {
    /// `postgres://…`
    #[arg(long)]
    url: String,
}

/// `pg-fill`: how many completed records, live and expired.
#[derive(Debug, clap::Args)]
pub(crate) struct FillOptions {
    /// `postgres://…`
    #[arg(long)]
    url: String,
    /// Records that expire in a day.
    #[arg(long, default_value_t = 0)]
    live: u64,
    /// Records that expired an hour ago.
    #[arg(long, default_value_t = 0)]
    expired: u64,
}

/// `cleanup`: the job's settings.
#[derive(Debug, clap::Args)]
pub(crate) struct CleanupOptions {
    /// `postgres://…`
    #[arg(long)]
    url: String,
    /// Records per delete statement.
    #[arg(long, default_value_t = 1_000)]
    batch: usize,
    /// The shortest pause between two batches, in milliseconds (the job's
    /// default, 1).
    #[arg(long, default_value_t = 1)]
    pause_ms: u64,
    /// The job's duty cycle (its default, 0.5; 1 pauses only `pause_ms`).
    #[arg(long, default_value_t = 0.5)]
    duty: f64,
}

/// The body size of filled records.
const FILL_BODY: usize = 200;

/// Starts a cluster, creates the databases, prints `cluster 127.0.0.1 PORT`, and
/// keeps the cluster until stdin closes or SIGTERM / SIGINT arrives; then stops
/// and deletes it.
pub(crate) fn cluster(options: &ClusterOptions) -> Result<(), BoxError> {
    let cluster = TestPostgres::start()?;
    // `pg_stat_statements` counts the statements each request runs (the bench
    // prints them per request); it is loaded at server start.
    cluster.psql(
        idem_testkit::postgres::DEFAULT_DATABASE,
        "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'",
    )?;
    cluster.stop()?;
    cluster.resume()?;
    for database in &options.databases {
        cluster.create_database(database)?;
        cluster.psql(database, "CREATE EXTENSION pg_stat_statements")?;
    }
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "cluster 127.0.0.1 {}", cluster.port())?;
        stdout.flush()?;
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let waited: Result<(), BoxError> = runtime.block_on(async {
        use tokio::io::AsyncReadExt;
        use tokio::signal::unix::{SignalKind, signal};
        let mut terminate = signal(SignalKind::terminate())?;
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut stdin = tokio::io::stdin();
        let mut sink = Vec::new();
        tokio::select! {
            _ = stdin.read_to_end(&mut sink) => {}
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
        Ok(())
    });
    drop(cluster);
    // The stdin reader may still be blocked in its thread.
    runtime.shutdown_background();
    waited
}

/// Inserts completed records (200-byte bodies), live and expired, then analyzes.
pub(crate) async fn fill(options: FillOptions) -> Result<(), BoxError> {
    let store = PgStore::connect(&options.url).await?;
    store.migrate().await?;
    let mut connection = store.pool().get().await.map_err(|e| e.to_string())?;
    let response = handler::recorded(FILL_BODY);
    let body = "x".repeat(FILL_BODY);
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    for (count, tag, lifetime) in [
        (options.live, "live", "1 day"),
        (options.expired, "expired", "-1 hour"),
    ] {
        if count == 0 {
            continue;
        }
        let sql = format!(
            "INSERT INTO idem_records
                 (scope, key, fingerprint, state, status, headers, body, replayable, expires_at, created_at)
             SELECT 'tenant-' || (g % 100), '{tag}-{nonce}-' || g, '\\x{fingerprint}'::bytea,
                    'completed', {status}, '\\x{headers}'::bytea, '\\x{body}'::bytea, true,
                    now() + interval '{lifetime}', now()
             FROM generate_series(1, {count}) AS g",
            fingerprint = hex(&[1; 32]),
            status = handler::STATUS,
            headers = hex(&response.encode_headers()),
            body = hex(body.as_bytes()),
        );
        connection.batch_execute(&sql).await?;
    }
    connection.batch_execute("ANALYZE idem_records").await?;
    println!(
        "{}",
        serde_json::json!({"live": options.live, "expired": options.expired})
    );
    Ok(())
}

#[derive(QueryableByName)]
struct PreparedRow {
    #[diesel(sql_type = Text)]
    statement: String,
    #[diesel(sql_type = Text)]
    types: String,
}

/// Runs a claim, its completion and a replay through a one-connection `PgStore`,
/// then prints the claim and complete statements exactly as that connection
/// prepared them (`pg_prepared_statements`), with their parameter types and the
/// values a layered request binds.
pub(crate) async fn statements(options: UrlOptions) -> Result<(), BoxError> {
    let store = PgStore::builder()
        .max_connections(1)
        .connect(&options.url)
        .await?;
    store.migrate().await?;
    let fingerprint = Fingerprint::from_bytes([7; 32]);
    let request = ClaimRequest {
        scope: Scope::new(handler::SCOPE),
        key: IdempotencyKey::new(&format!("probe-{}", uuid::Uuid::new_v4()))?,
        fingerprint,
        owner: OwnerToken::random(),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(24 * 3600),
    };
    let ClaimOutcome::Claimed(claim) = store.claim(&request).await? else {
        return Err("the probe's fresh key was not claimed".into());
    };
    let response = handler::recorded(1024);
    store.complete(&claim, &response, request.retention).await?;
    let again = ClaimRequest {
        owner: OwnerToken::random(),
        ..request.clone()
    };
    let ClaimOutcome::Completed { .. } = store.claim(&again).await? else {
        return Err("the probe's completed key did not replay".into());
    };
    let mut connection = store.pool().get().await.map_err(|e| e.to_string())?;
    let rows: Vec<PreparedRow> = diesel::sql_query(
        "SELECT statement, parameter_types::text AS types FROM pg_prepared_statements",
    )
    .load(&mut *connection)
    .await?;
    let find = |is: &dyn Fn(&str) -> bool, what: &str| {
        rows.iter()
            .find(|row| is(&row.statement))
            .map(|row| {
                let types: Vec<&str> = row
                    .types
                    .trim_matches(|c| c == '{' || c == '}')
                    .split(',')
                    .collect();
                serde_json::json!({"sql": row.statement, "types": types})
            })
            .ok_or_else(|| format!("no prepared {what} statement"))
    };
    let claim_sql = find(
        &|sql| sql.contains("INSERT INTO") && sql.contains("ON CONFLICT"),
        "claim",
    )?;
    let complete_sql = find(
        &|sql| sql.trim_start().starts_with("UPDATE") && sql.contains("body ="),
        "complete",
    )?;
    let answer = serde_json::json!({
        "claim": claim_sql,
        "complete": complete_sql,
        "values": {
            "scope": handler::SCOPE,
            "fingerprint": format!("\\x{}", hex(fingerprint.as_bytes())),
            "owner": OwnerToken::random().as_uuid().to_string(),
            "lease": request.lease.as_micros().to_string(),
            "retention": request.retention.as_micros().to_string(),
            "status": response.status.to_string(),
            "headers": format!("\\x{}", hex(&response.encode_headers())),
            "body": format!("\\x{}", hex(&response.body)),
            "replayable": "true",
        },
    });
    println!("{answer}");
    Ok(())
}

/// One sweep of the store's cleanup job; prints what it deleted and how long it took.
pub(crate) async fn cleanup(options: CleanupOptions) -> Result<(), BoxError> {
    let store = PgStore::connect(&options.url).await?;
    let cleanup = store
        .cleanup()
        .batch_size(options.batch)
        .pause(Duration::from_millis(options.pause_ms))
        .duty_cycle(options.duty);
    let started = Instant::now();
    let report = cleanup.sweep().await;
    let seconds = started.elapsed().as_secs_f64();
    match report {
        SweepReport::Swept(sweep) => {
            println!(
                "{}",
                serde_json::json!({
                    "deleted": sweep.deleted,
                    "batches": sweep.batches,
                    "seconds": seconds,
                })
            );
            Ok(())
        }
        SweepReport::Skipped => Err("another runner holds the sweep lock".into()),
        SweepReport::Failed { error, .. } => Err(error.into()),
        other => Err(format!("unexpected sweep report {other:?}").into()),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
