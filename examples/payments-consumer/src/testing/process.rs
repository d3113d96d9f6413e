//! The pieces a scenario drives: consumer processes, the other commands, a
//! broker client, the database.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Text};
use diesel_async::RunQueryDsl;
use idem_diesel::{PgPool, PgStore};
use lapin::message::BasicGetMessage;
use lapin::options::{BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::ledger::Account;
use crate::message::PERSISTENT;
use crate::topology::Topology;

/// What a scenario runs on: one queue and one database of its own.
#[derive(Clone, Debug)]
pub struct Case {
    /// The `payments-consumer` binary.
    pub binary: PathBuf,
    /// The broker.
    pub amqp: String,
    /// A fresh database.
    pub database: String,
    /// The work queue, the scenario's own.
    pub queue: String,
    /// Where the consumers' logs go.
    pub dir: PathBuf,
    started: Arc<AtomicUsize>,
}

/// A `payments-consumer run` process; killed when dropped.
#[derive(Debug)]
pub struct ConsumerProcess {
    child: Child,
    /// Its stderr.
    pub log: PathBuf,
}

/// A broker client on the case's queue: publishes with confirmations, counts
/// queues, peeks at dead letters.
pub struct Client {
    connection: Connection,
    channel: Channel,
    /// The case's queues.
    pub topology: Topology,
}

/// How long a scenario waits for what it expects before it fails.
pub(crate) const PATIENCE: Duration = Duration::from_secs(60);

impl Case {
    /// A case; `dir` is created if missing.
    pub fn new(
        binary: impl Into<PathBuf>,
        amqp: impl Into<String>,
        database: impl Into<String>,
        queue: impl Into<String>,
        dir: impl Into<PathBuf>,
    ) -> Self {
        Self {
            binary: binary.into(),
            amqp: amqp.into(),
            database: database.into(),
            queue: queue.into(),
            dir: dir.into(),
            started: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Starts `payments-consumer run` on the case (with `--retry-base-ms 20`
    /// unless `extra` says otherwise) and waits for its `consuming from` line.
    pub async fn consumer(&self, extra: &[&str]) -> Result<ConsumerProcess, String> {
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("{}: {e}", self.dir.display()))?;
        let n = self.started.fetch_add(1, Ordering::Relaxed) + 1;
        let log = self.dir.join(format!("{}-consumer-{n}.log", self.queue));
        let stderr = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let mut command = Command::new(&self.binary);
        command
            .args(["run", "--amqp", &self.amqp, "--database", &self.database])
            .args(["--queue", &self.queue]);
        if !extra.contains(&"--retry-base-ms") {
            command.args(["--retry-base-ms", "20"]);
        }
        let mut child = command
            .args(extra)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("could not start {}: {e}", self.binary.display()))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await;
        let expected = format!("consuming from {}", self.queue);
        match first {
            Ok(Ok(Some(line))) if line == expected => {}
            other => {
                return Err(format!(
                    "the consumer's first line was {other:?}, not {expected:?}; its log:\n{}",
                    read_log(&log)
                ));
            }
        }
        // Keep reading, so that it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(ConsumerProcess { child, log })
    }

    /// Runs another command of the binary (`balance`, `dead-letters`,
    /// `redrive`) and answers its stdout.
    pub async fn command(&self, args: &[&str]) -> Result<String, String> {
        let output = Command::new(&self.binary)
            .args(args)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| format!("could not run {args:?}: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "payments-consumer {args:?} failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        String::from_utf8(output.stdout).map_err(|e| e.to_string())
    }

    /// `payments-consumer balance ACCOUNT`, parsed.
    pub async fn balance(&self, account: &str) -> Result<Account, String> {
        let out = self
            .command(&["balance", account, "--database", &self.database])
            .await?;
        let value: serde_json::Value = serde_json::from_str(out.trim())
            .map_err(|e| format!("`balance` printed {out:?}: {e}"))?;
        let field = |name: &str| {
            value[name]
                .as_i64()
                .ok_or(format!("`balance` printed {out:?}"))
        };
        Ok(Account {
            account_id: value["account_id"].as_str().unwrap_or_default().to_owned(),
            balance: field("balance")?,
            operations: field("operations")?,
        })
    }

    /// `payments-consumer dead-letters`, one JSON value per line.
    pub async fn dead_letters(&self) -> Result<Vec<serde_json::Value>, String> {
        let out = self
            .command(&["dead-letters", "--amqp", &self.amqp, "--queue", &self.queue])
            .await?;
        out.lines()
            .map(|line| serde_json::from_str(line).map_err(|e| format!("{line:?}: {e}")))
            .collect()
    }

    /// The inbox's consumer name for the case's queue.
    pub fn inbox_consumer(&self) -> String {
        format!("payments-consumer/{}", self.queue)
    }

    /// A pool on the case's database.
    pub async fn pool(&self) -> Result<PgPool, String> {
        PgStore::connect(&self.database)
            .await
            .map(|store| store.pool().clone())
            .map_err(|e| format!("the database: {e}"))
    }
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// How many messages the case's consumer processed (its inbox rows).
pub(crate) async fn processed(pool: &PgPool, consumer: &str) -> Result<i64, String> {
    let mut connection = pool.get().await.map_err(|e| e.to_string())?;
    diesel::sql_query("SELECT count(*) AS n FROM idem_inbox WHERE consumer = $1")
        .bind::<Text, _>(consumer)
        .get_result::<Count>(&mut *connection)
        .await
        .map(|row| row.n)
        .map_err(|e| e.to_string())
}

/// Every account, by id.
pub(crate) async fn accounts(pool: &PgPool) -> Result<Vec<Account>, String> {
    let mut connection = pool.get().await.map_err(|e| e.to_string())?;
    diesel::sql_query(
        "SELECT account_id, balance, operations FROM payments_consumer_accounts ORDER BY account_id",
    )
    .get_results::<Account>(&mut *connection)
    .await
    .map_err(|e| e.to_string())
}

impl ConsumerProcess {
    /// Kills it with `SIGKILL`: no acknowledgement, no cleanup.
    pub async fn kill(mut self) {
        let _ = self.child.kill().await;
    }

    /// Stops it with `SIGTERM`, as a supervisor would; kills it if it is
    /// still running after 10 s.
    pub async fn terminate(mut self) -> Result<(), String> {
        if let Some(pid) = self.child.id() {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
        }
        match tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await {
            Ok(Ok(status)) if status.success() => Ok(()),
            Ok(Ok(status)) => Err(format!(
                "the consumer exited with {status} on SIGTERM; its log:\n{}",
                read_log(&self.log)
            )),
            _ => Err("the consumer did not stop within 10 s of SIGTERM".to_owned()),
        }
    }

    /// Its log lines that contain `text`.
    pub fn log_lines(&self, text: &str) -> Vec<String> {
        read_log(&self.log)
            .lines()
            .filter(|line| line.contains(text))
            .map(str::to_owned)
            .collect()
    }
}

impl Client {
    /// Connects, declares the case's queues, and turns confirmations on.
    pub async fn connect(case: &Case) -> Result<Self, String> {
        let connection = Connection::connect(&case.amqp, ConnectionProperties::default())
            .await
            .map_err(|e| format!("the broker: {e}"))?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| e.to_string())?;
        let topology = Topology::new(case.queue.clone());
        topology
            .declare(&channel)
            .await
            .map_err(|e| e.to_string())?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok(Self {
            connection,
            channel,
            topology,
        })
    }

    /// Publishes `body` to the work queue with `message_id` (if any),
    /// persistent, and waits for the broker's confirmation.
    pub async fn publish(&self, message_id: Option<&str>, body: &[u8]) -> Result<(), String> {
        let mut properties = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(PERSISTENT);
        if let Some(id) = message_id {
            properties = properties.with_message_id(id.into());
        }
        let confirmation = self
            .channel
            .basic_publish(
                "".into(),
                self.topology.queue().into(),
                BasicPublishOptions::default(),
                body,
                properties,
            )
            .await
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())?;
        match confirmation {
            Confirmation::Ack(_) => Ok(()),
            other => Err(format!("the broker did not take a message: {other:?}")),
        }
    }

    /// The client's channel (in confirm mode).
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// How many messages are ready in `queue`.
    pub async fn ready(&self, queue: &str) -> Result<u32, String> {
        Topology::ready(&self.channel, queue)
            .await
            .map_err(|e| e.to_string())
    }

    /// Waits until `queue` holds `count` ready messages.
    pub async fn wait_ready(&self, queue: &str, count: u32) -> Result<(), String> {
        let started = Instant::now();
        loop {
            let ready = self.ready(queue).await?;
            if ready == count {
                return Ok(());
            }
            if started.elapsed() > PATIENCE {
                return Err(format!(
                    "{queue} held {ready} messages after {PATIENCE:?}, not {count}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The `x-death` entries of every dead letter (fetched on a channel of
    /// their own and handed back), as (queue, reason, count) triples.
    pub async fn x_deaths(&self) -> Result<Vec<Vec<(String, String, i64)>>, String> {
        let channel = self
            .connection
            .create_channel()
            .await
            .map_err(|e| e.to_string())?;
        let mut letters = Vec::new();
        while let Some(got) = channel
            .basic_get(
                self.topology.dead_letter_queue().into(),
                BasicGetOptions::default(),
            )
            .await
            .map_err(|e| e.to_string())?
        {
            letters.push(x_death(&got));
        }
        channel
            .close(200, "peeked".into())
            .await
            .map_err(|e| e.to_string())?;
        Ok(letters)
    }
}

fn x_death(got: &BasicGetMessage) -> Vec<(String, String, i64)> {
    let Some(AMQPValue::FieldArray(deaths)) = got
        .delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|headers| headers.inner().get("x-death"))
    else {
        return Vec::new();
    };
    deaths
        .as_slice()
        .iter()
        .filter_map(|death| match death {
            AMQPValue::FieldTable(table) => Some(entry(table)),
            _ => None,
        })
        .collect()
}

fn entry(table: &FieldTable) -> (String, String, i64) {
    let text = |name: &str| match table.inner().get(name) {
        Some(AMQPValue::LongString(value)) => String::from_utf8_lossy(value.as_bytes()).into(),
        Some(AMQPValue::ShortString(value)) => value.as_str().to_owned(),
        _ => String::new(),
    };
    let count = match table.inner().get("count") {
        Some(AMQPValue::LongLongInt(n)) => *n,
        Some(AMQPValue::LongInt(n)) => i64::from(*n),
        _ => -1,
    };
    (text("queue"), text("reason"), count)
}

/// The file's text, or why it could not be read.
pub(crate) fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| format!("({}: {e})", path.display()))
}
