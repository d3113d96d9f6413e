//! `payments-consumer run --sqs` (CONTRACT §12) against moto's SQS server,
//! on SQLite and on PostgreSQL: the binary as a process, driven through the
//! queue, read back with `balance`, `dead-letters` and `redrive`.
//!
//! One row per database: 30 payments over 3 accounts, 10 of them sent twice,
//! one to the `--fail-account`, on a queue whose visibility timeout (1 s) is
//! shorter than the handler (`--handler-latency-ms 1500`): exact balances, no
//! duplicate outcome (the lease held), the failing payment in `<queue>-dlq`
//! after exactly 3 attempts with its reason, then re-driven and applied once.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use idem_sqs::aws_sdk_sqs::types::QueueAttributeName;
use idem_sqs::{ClientConfig, Outgoing, Publisher};
use idem_testkit::{TestPostgres, TestSqs};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const BINARY: &str = env!("CARGO_BIN_EXE_payments-consumer");

/// The environment the binary reads its credentials and region from.
const AWS_ENV: [(&str, &str); 3] = [
    ("AWS_ACCESS_KEY_ID", "test"),
    ("AWS_SECRET_ACCESS_KEY", "test"),
    ("AWS_REGION", "us-east-1"),
];

#[test]
fn run_sqs_on_sqlite_applies_each_payment_once_and_dead_letters_after_three() {
    let dir = std::env::temp_dir().join(format!("idem-sqs-consumer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let database = format!("sqlite://{}", dir.join("consumer.db").display());
    let figure = runtime().block_on(row(&database, "sqlite", &dir));
    println!(
        "run --sqs on SQLite: {}",
        figure.unwrap_or_else(|e| panic!("{e}"))
    );
}

#[test]
fn run_sqs_on_postgres_applies_each_payment_once_and_dead_letters_after_three() {
    let cluster = TestPostgres::shared().unwrap_or_else(|e| panic!("PostgreSQL: {e}"));
    let name = cluster.fresh_database("sqs_consumer").unwrap();
    let database = cluster.url(&name);
    let dir = std::env::temp_dir().join(format!("idem-sqs-consumer-pg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let figure = runtime().block_on(row(&database, "postgres", &dir));
    println!(
        "run --sqs on PostgreSQL: {}",
        figure.unwrap_or_else(|e| panic!("{e}"))
    );
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn row(database: &str, store: &str, dir: &std::path::Path) -> Result<String, String> {
    let sqs = TestSqs::shared();
    let client = ClientConfig::from_env()
        .endpoint(sqs.endpoint())
        .region("us-east-1")
        .credentials("test", "test")
        .build()
        .map_err(|e| e.to_string())?;
    let queue = sqs.fresh_name(&format!("payments-{store}"));
    let url = client
        .create_queue()
        .queue_name(&queue)
        .attributes(QueueAttributeName::VisibilityTimeout, "1")
        .send()
        .await
        .map_err(|e| format!("{e:?}"))?
        .queue_url()
        .unwrap_or_default()
        .to_owned();
    let publisher = Publisher::new(client.clone(), &url).map_err(|e| e.to_string())?;
    let mut expected: HashMap<String, i64> = HashMap::new();
    for i in 0..30i64 {
        let account = format!("acc-{}", i % 3);
        *expected.entry(account.clone()).or_default() += i + 1;
        let body = format!(r#"{{"account_id":"{account}","amount":{}}}"#, i + 1);
        let id = format!("{queue}-pay-{i}");
        let times = if i % 3 == 0 { 2 } else { 1 };
        for _ in 0..times {
            publisher
                .send(&Outgoing::new(body.as_str()).message_id(id.as_str()))
                .await
                .map_err(|e| e.to_string())?;
        }
    }
    let failing_id = format!("{queue}-broken");
    publisher
        .send(
            &Outgoing::new(r#"{"account_id":"acc-broken","amount":5}"#)
                .message_id(failing_id.as_str()),
        )
        .await
        .map_err(|e| e.to_string())?;

    let log = dir.join(format!("{queue}.log"));
    let endpoint = sqs.endpoint();
    let args = [
        "run",
        "--sqs",
        &url,
        "--sqs-endpoint",
        &endpoint,
        "--database",
        database,
        "--retry-base-ms",
        "500",
        "--concurrency",
        "4",
        "--fail-account",
        "acc-broken",
        "--handler-latency-ms",
        "1500",
    ];
    let started = Instant::now();
    let mut consumer = spawn(&args, &log, &queue).await?;
    let dlq = idem_sqs::dead_letter_queue_name(&queue);
    let drained = until(Duration::from_secs(120), || async {
        let balances = balances(database, &expected).await?;
        let letters =
            command(&["dead-letters", "--sqs", &url, "--sqs-endpoint", &endpoint]).await?;
        if balances == expected && letters.lines().count() == 1 {
            Ok(())
        } else {
            Err(format!("balances {balances:?}, dead letters {letters}"))
        }
    })
    .await;
    let took = started.elapsed();
    drained.map_err(|e| format!("{e}\n{}", std::fs::read_to_string(&log).unwrap_or_default()))?;
    let letters = command(&["dead-letters", "--sqs", &url, "--sqs-endpoint", &endpoint]).await?;
    let letter: serde_json::Value =
        serde_json::from_str(letters.trim()).map_err(|e| e.to_string())?;
    let attempts = letter["attempts"].as_array().map_or(0, Vec::len);
    if letter["queue"] != queue.as_str()
        || letter["message_id"] != failing_id.as_str()
        || attempts != 3
        || letter["reason"] != "payments to the account of --fail-account fail on purpose"
    {
        return Err(format!("the dead letter {letter} (in {dlq})"));
    }
    terminate(&mut consumer).await?;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let duplicates = text.matches("outcome=\"duplicate\"").count();
    let processed = text.matches("outcome=\"processed\"").count();
    if processed != 30 || duplicates != 10 {
        return Err(format!(
            "{processed} processed and {duplicates} duplicates (30 and 10 expected):\n{text}"
        ));
    }

    // The cause fixed: redrive, applied once.
    let mut fixed = spawn(&args[..args.len() - 4], &log, &queue).await?;
    let moved = command(&["redrive", "--sqs", &url, "--sqs-endpoint", &endpoint]).await?;
    if moved.trim() != "re-drove 1 dead letters" {
        return Err(format!("redrive printed {moved:?}"));
    }
    until(Duration::from_secs(60), || async {
        let account = command(&["balance", "acc-broken", "--database", database]).await?;
        if account.contains("\"balance\":5") && account.contains("\"operations\":1") {
            Ok(())
        } else {
            Err(account)
        }
    })
    .await?;
    terminate(&mut fixed).await?;
    Ok(format!(
        "31 payments + 10 duplicates with a 1.5 s handler on a 1 s visibility timeout: 30 processed, 10 duplicates (the producer's, none from a lapsed lease), exact balances in {:.1} s; the failing one dead-lettered after 3 attempts with its reason, re-driven and applied once",
        took.as_secs_f64()
    ))
}

async fn spawn(args: &[&str], log: &PathBuf, queue: &str) -> Result<Child, String> {
    let stderr = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| e.to_string())?;
    let mut child = Command::new(BINARY)
        .args(args)
        .envs(AWS_ENV)
        .env("RUST_LOG", "info,idem=debug")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(stderr))
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| e.to_string())?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let first = tokio::time::timeout(Duration::from_secs(60), lines.next_line()).await;
    let expected = format!("consuming from {queue}");
    match first {
        Ok(Ok(Some(line))) if line == expected => {}
        other => {
            return Err(format!(
                "the first line was {other:?}, not {expected:?}:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            ));
        }
    }
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(child)
}

/// SIGTERM, then the exit status 0.
async fn terminate(child: &mut Child) -> Result<(), String> {
    let pid = child.id().ok_or("the consumer already exited")?;
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .map_err(|e| e.to_string())?;
    if !killed.success() {
        return Err("kill -TERM failed".to_owned());
    }
    match tokio::time::timeout(Duration::from_secs(60), child.wait()).await {
        Ok(Ok(status)) if status.success() => Ok(()),
        other => Err(format!("the consumer's exit after SIGTERM: {other:?}")),
    }
}

async fn command(args: &[&str]) -> Result<String, String> {
    let output = Command::new(BINARY)
        .args(args)
        .envs(AWS_ENV)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| e.to_string())?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "{args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

async fn balances(
    database: &str,
    expected: &HashMap<String, i64>,
) -> Result<HashMap<String, i64>, String> {
    let mut balances = HashMap::new();
    for account in expected.keys() {
        let line = command(&["balance", account, "--database", database]).await?;
        let value: serde_json::Value =
            serde_json::from_str(line.trim()).map_err(|e| e.to_string())?;
        balances.insert(account.clone(), value["balance"].as_i64().unwrap_or(0));
    }
    Ok(balances)
}

/// Polls `probe` every 200 ms until it answers `Ok`, for at most `limit`.
async fn until<F, Fut>(limit: Duration, mut probe: F) -> Result<(), String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let started = Instant::now();
    loop {
        match probe().await {
            Ok(()) => return Ok(()),
            Err(last) if started.elapsed() > limit => {
                return Err(format!("waited {limit:?}; last seen: {last}"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}
