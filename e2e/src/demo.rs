//! `cargo xtask demo`: the experiment that motivates idem, for a newcomer.
//!
//! Starts payments-axum (or, with `--actix`, payments-actix) on its embedded
//! default store, then: the same deposit
//! delivered three times without a key and with one; 100 parallel charges with one
//! key; and a simulated retry storm with and without jitter. Then the broker's
//! version: a throwaway RabbitMQ node and PostgreSQL cluster, one deposit
//! published three times with one `message_id`, applied by a consumer without
//! the inbox and by payments-consumer. Then SQS's own deduplication, on a
//! FIFO queue of a local SQS (moto's server): identical messages inside the
//! window, one with a field changed, and the first sent again after the
//! window, with what the inbox adds. Prints what happened as a small table;
//! the servers' logs go to files, named under the table.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use idem_testkit::{TestPostgres, TestRabbitMq, TestSqs};
use serde_json::{Value, json};

use crate::consumer_harness::{Case, Exercise, fifo_exercise};
use crate::example::{Example, Server};

use self::broker::delivered_three_times;

mod broker;

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let example = match args.first().map(String::as_str) {
        None | Some("--axum") => Example::Axum,
        Some("--actix") => Example::Actix,
        Some(other) => {
            return Err(format!(
                "demo takes --axum (default) or --actix, not {other}"
            ));
        }
    };
    let built = Example::build_dev(&[example, Example::Consumer])?;
    let (binary, consumer) = (example.binary(&built), Example::Consumer.binary(&built));
    let dir = std::env::temp_dir().join(format!("idem-demo-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // RabbitMQ and PostgreSQL start (seconds) while the HTTP part runs.
    let starting = std::thread::spawn(start_broker_and_database);
    let log = dir.join(format!("{}.log", example.package()));
    let server = Server::start_logged(&binary, &dir, &[], &[], &log)?;
    let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    let rows = runtime.block_on(experiment(&server.base));
    drop(server);
    let mut rows = rows?;
    rows.push(retry_storm());
    let servers = starting
        .join()
        .map_err(|_| "starting RabbitMQ and PostgreSQL panicked".to_owned())??;
    rows.extend(runtime.block_on(broker_experiment(&consumer, &servers, &dir))?);
    rows.extend(runtime.block_on(sqs_experiment(&consumer, &servers, &dir))?);
    drop(servers);
    print_table(&rows);
    println!();
    println!(
        "logs of {} and payments-consumer: {}",
        example.package(),
        dir.display()
    );
    Ok(())
}

/// A throwaway RabbitMQ node, SQS (moto) and PostgreSQL cluster, with the
/// demo's databases.
struct Servers {
    broker: TestRabbitMq,
    sqs: Arc<TestSqs>,
    cluster: TestPostgres,
}

fn start_broker_and_database() -> Result<Servers, String> {
    let broker = TestRabbitMq::start().map_err(|e| format!("RabbitMQ: {e}"))?;
    let sqs = TestSqs::start().map_err(|e| format!("SQS (moto): {e}"))?;
    let cluster = TestPostgres::start().map_err(|e| format!("PostgreSQL: {e}"))?;
    for database in ["demo", "demo_sqs"] {
        cluster
            .create_database(database)
            .map_err(|e| format!("PostgreSQL: {e}"))?;
    }
    Ok(Servers {
        broker,
        sqs: Arc::new(sqs),
        cluster,
    })
}

/// SQS's deduplication on a FIFO queue (each message's deduplication id the
/// SHA-256 of its content), and what the inbox adds.
async fn sqs_experiment(
    consumer: &Path,
    servers: &Servers,
    logs: &Path,
) -> Result<Vec<Row>, String> {
    let case = Case::new(
        PathBuf::from(consumer),
        String::new(),
        servers.cluster.url("demo_sqs"),
        "demo_payments",
        logs,
    )
    .with_sqs(Arc::clone(&servers.sqs));
    let Exercise {
        inside,
        after_change,
        after_window,
    } = fifo_exercise(case).await?;
    let shown =
        |(deliveries, effects): (usize, i64)| format!("{deliveries} delivered, {effects} applied");
    Ok(vec![
        Row {
            experiment: "SQS FIFO: 10 identical sends, inside the 5-minute window",
            expected: "1 delivered, 1 applied".into(),
            observed: shown(inside),
        },
        Row {
            experiment: "SQS FIFO: then the same payment with a field changed",
            expected: "2 delivered, 2 applied".into(),
            observed: shown(after_change),
        },
        Row {
            experiment: "SQS FIFO: then the first sent again after the window",
            expected: "3 delivered, 2 applied (the inbox)".into(),
            observed: format!(
                "{} (moto forgets an id at its delete, SQS after 5 minutes)",
                shown(after_window)
            ),
        },
    ])
}

/// One deposit published three times with one `message_id`, consumed without
/// and with the inbox.
async fn broker_experiment(
    consumer: &Path,
    servers: &Servers,
    logs: &Path,
) -> Result<Vec<Row>, String> {
    let case = Case::new(
        PathBuf::from(consumer),
        servers.broker.url(),
        servers.cluster.url("demo"),
        "demo_payments",
        logs,
    );
    let seen = delivered_three_times(&case).await?;
    let shown = |balance: i64, operations: i64| {
        let s = if operations == 1 { "" } else { "s" };
        format!("balance {balance} ({operations} operation{s})")
    };
    Ok(vec![
        Row {
            experiment: "deposit of 100 delivered 3x by RabbitMQ, no inbox",
            expected: "balance 100 (1 operation)".into(),
            observed: shown(seen.without_inbox.balance, seen.without_inbox.operations),
        },
        Row {
            experiment: "deposit of 100 delivered 3x by RabbitMQ, the inbox",
            expected: "balance 100 (1 operation)".into(),
            observed: format!(
                "{} (payments-consumer)",
                shown(seen.with_inbox.balance, seen.with_inbox.operations)
            ),
        },
    ])
}

/// The retry policy's reason to exist, as a model (computed from the backoff's
/// schedule, no server): 100 clients failing together. `cargo xtask storm`
/// measures the same against payments-axum.
fn retry_storm() -> Row {
    use idem_core::retry::{Backoff, Jitter, simulate_storm};
    let outage = std::time::Duration::from_secs(1);
    let plain = simulate_storm(
        Backoff::for_consumers().jitter(Jitter::None),
        100,
        outage,
        1,
    );
    let jittered = simulate_storm(Backoff::for_consumers(), 100, outage, 1);
    Row {
        experiment: "100 clients fail together, then retry (a model; measured: cargo xtask storm)",
        expected: "a flat retry load".into(),
        observed: format!(
            "peak retries per 100 ms: {} without jitter, {} with full jitter ({:.0}x lower)",
            plain.peak_per_100ms,
            jittered.peak_per_100ms,
            plain.peak_per_100ms as f64 / jittered.peak_per_100ms.max(1) as f64
        ),
    }
}

struct Row {
    experiment: &'static str,
    expected: String,
    observed: String,
}

async fn experiment(base: &str) -> Result<Vec<Row>, String> {
    let client = reqwest::Client::new();
    let run = uuid::Uuid::new_v4().simple().to_string();
    let mut rows = Vec::new();

    // 1. One deposit, delivered three times (a broker redelivers), without a key.
    let account = format!("demo-nokey-{run}");
    for _ in 0..3 {
        post(&client, base, &account, "deposits", None).await?;
    }
    let (balance, operations) = account_state(&client, base, &account).await?;
    rows.push(Row {
        experiment: "deposit of 100 delivered 3x, no key",
        expected: "balance 100 (1 operation)".into(),
        observed: format!("balance {balance} ({operations} operations)"),
    });

    // 2. The same, with one Idempotency-Key.
    let account = format!("demo-key-{run}");
    let key = format!("deposit-{run}");
    let mut replays = 0;
    for _ in 0..3 {
        let (_, replayed, _) = post(&client, base, &account, "deposits", Some(&key)).await?;
        replays += usize::from(replayed);
    }
    let (balance, operations) = account_state(&client, base, &account).await?;
    rows.push(Row {
        experiment: "deposit of 100 delivered 3x, one key",
        expected: "balance 100 (1 operation)".into(),
        observed: format!("balance {balance} ({operations} operation, {replays} replays)"),
    });

    // 3. 100 parallel charges with one key.
    let account = format!("demo-storm-{run}");
    let key = format!("charge-{run}");
    let answers = futures_util::future::join_all(
        (0..100).map(|_| post(&client, base, &account, "charges", Some(&key))),
    )
    .await;
    let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
    let mut bodies = std::collections::BTreeSet::new();
    for answer in answers {
        let (status, _, body) = answer?;
        *statuses.entry(status).or_default() += 1;
        if status == 201 {
            bodies.insert(body);
        }
    }
    let (balance, operations) = account_state(&client, base, &account).await?;
    let statuses: Vec<String> = statuses.iter().map(|(s, n)| format!("{n}x {s}")).collect();
    rows.push(Row {
        experiment: "100 parallel charges of 100, one key",
        expected: "balance 100 (1 operation)".into(),
        observed: format!(
            "balance {balance} ({operations} operation); answers {}; {} distinct 201 bodies",
            statuses.join(", "),
            bodies.len()
        ),
    });
    Ok(rows)
}

async fn post(
    client: &reqwest::Client,
    base: &str,
    account: &str,
    what: &str,
    key: Option<&str>,
) -> Result<(u16, bool, String), String> {
    let mut request = client
        .post(format!("{base}/accounts/{account}/{what}"))
        .bearer_auth("demo")
        .json(&json!({"amount": 100, "currency": "EUR"}));
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    let response = request.send().await.map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = response.text().await.map_err(|e| e.to_string())?;
    Ok((status, replayed, body))
}

async fn account_state(
    client: &reqwest::Client,
    base: &str,
    account: &str,
) -> Result<(i64, i64), String> {
    let body: Value = client
        .get(format!("{base}/accounts/{account}"))
        .bearer_auth("demo")
        .send()
        .await
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())?;
    let field = |name: &str| {
        body[name]
            .as_i64()
            .ok_or_else(|| format!("account answer without `{name}`: {body}"))
    };
    Ok((field("balance")?, field("operations")?))
}

fn print_table(rows: &[Row]) {
    let w0 = rows.iter().map(|r| r.experiment.len()).max().unwrap_or(0);
    let w1 = rows.iter().map(|r| r.expected.len()).max().unwrap_or(0);
    println!();
    println!("{:w0$} | {:w1$} | observed", "experiment", "a user expects");
    println!(
        "{}-+-{}-+-{}",
        "-".repeat(w0),
        "-".repeat(w1),
        "-".repeat(40)
    );
    for r in rows {
        println!("{:w0$} | {:w1$} | {}", r.experiment, r.expected, r.observed);
    }
}
