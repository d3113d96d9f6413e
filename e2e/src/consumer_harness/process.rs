//! The pieces a scenario drives: consumer processes, the other commands, a
//! broker client, the database.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem_diesel::diesel::{self, QueryableByName, sql_types::BigInt};
use idem_diesel::diesel_async::RunQueryDsl;
use idem_rabbitmq::lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use idem_rabbitmq::lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties,
};
use idem_rabbitmq::{DeadLetterMessage, Topology};
use idem_testkit::fault::Proxy;
use idem_testkit::{TestRabbitMq, TestSqs};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use payments_consumer::ConsumerError;
use payments_consumer::consume::inbox_name;
use payments_consumer::database::Database;
use payments_consumer::ledger::Account;
use payments_consumer::with_connection;

/// What a scenario runs on: one queue and one database of its own.
#[derive(Clone, Debug)]
pub(crate) struct Case {
    /// The `payments-consumer` binary.
    pub(crate) binary: PathBuf,
    /// The broker.
    pub(crate) amqp: String,
    /// A fresh database: `postgres://…` or `sqlite://PATH`.
    pub(crate) database: String,
    /// The work queue, the scenario's own.
    pub(crate) queue: String,
    /// Where the consumers' logs go.
    pub(crate) dir: PathBuf,
    /// The broker's node, for the scenarios that stop and start it.
    broker: Option<Arc<TestRabbitMq>>,
    /// On Kafka: the bootstrap servers (the queue's name is the topic's and
    /// the group's).
    pub(crate) kafka: Option<String>,
    /// On SQS: moto's server (the queue's name is the SQS queue's, its URL
    /// [`TestSqs::queue_url`]).
    pub(crate) sqs: Option<Arc<TestSqs>>,
    /// The database URL the consumers are given when it is not `database`:
    /// a fault proxy's ([`Case::proxy_database`]). The scenario's own reads
    /// go to `database`, past the proxy.
    consumer_database: Option<String>,
    /// The SQS endpoint the consumers are given when it is not the
    /// server's: a fault proxy's ([`Case::proxy_sqs`]).
    consumer_sqs_endpoint: Option<String>,
    started: Arc<AtomicUsize>,
}

/// A `payments-consumer run` process; killed when dropped.
#[derive(Debug)]
pub(crate) struct ConsumerProcess {
    child: Child,
    /// Its stderr.
    pub(crate) log: PathBuf,
}

/// A broker client on the case's queue: publishes with confirmations and
/// counts queues.
pub(crate) struct Client {
    connection: Connection,
    channel: Channel,
    /// The case's queues.
    pub(crate) topology: Topology,
}

/// How long a scenario waits for what it expects before it fails.
pub(crate) const PATIENCE: Duration = Duration::from_secs(60);

/// AMQP's delivery mode for messages that survive a broker restart.
const PERSISTENT: u8 = 2;

impl Case {
    /// A case; `dir` is created if missing.
    pub(crate) fn new(
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
            broker: None,
            kafka: None,
            sqs: None,
            consumer_database: None,
            consumer_sqs_endpoint: None,
            started: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Puts a fault proxy ([`Proxy::postgres`]) between the consumers
    /// started from now on and the case's PostgreSQL database, and answers
    /// it; the scenario's own reads (`balance`, the inbox's rows) go to the
    /// database directly. Fails on a case on SQLite.
    pub(crate) fn proxy_database(&mut self) -> Result<Proxy, String> {
        let (user, rest) = self
            .database
            .strip_prefix("postgres://")
            .and_then(|rest| rest.split_once('@'))
            .ok_or_else(|| format!("a fault proxy needs PostgreSQL, not {}", self.database))?;
        let (address, name) = rest
            .split_once('/')
            .ok_or_else(|| format!("no database name in {}", self.database))?;
        let address: std::net::SocketAddr = address
            .parse()
            .map_err(|e| format!("the database's address {address:?}: {e}"))?;
        let proxy = Proxy::postgres(address).map_err(|e| format!("the fault proxy: {e}"))?;
        self.consumer_database = Some(format!("postgres://{user}@{}/{name}", proxy.addr()));
        Ok(proxy)
    }

    /// Puts a fault proxy ([`Proxy::tcp`]) between the consumers started
    /// from now on and the case's SQS server (their `--sqs-endpoint`), and
    /// answers it; the scenario's own calls go to the server directly.
    pub(crate) fn proxy_sqs(&mut self) -> Result<Proxy, String> {
        let sqs = self
            .sqs
            .as_ref()
            .ok_or("an SQS case needs Case::with_sqs")?;
        let proxy = Proxy::tcp(([127, 0, 0, 1], sqs.port()).into())
            .map_err(|e| format!("the fault proxy: {e}"))?;
        self.consumer_sqs_endpoint = Some(format!("http://{}", proxy.addr()));
        Ok(proxy)
    }

    /// The case with the broker's node, which the scenarios that restart the
    /// broker need (the others do without). Such a scenario runs while no
    /// other on the node does ([`Scenario::stops_broker`](super::Scenario::stops_broker)):
    /// every client of the node loses its connection.
    #[must_use]
    pub(crate) fn with_broker(mut self, broker: Arc<TestRabbitMq>) -> Self {
        self.broker = Some(broker);
        self
    }

    /// The case on Kafka (`run --kafka SERVERS --topic QUEUE --group
    /// QUEUE`) instead of RabbitMQ.
    #[must_use]
    pub(crate) fn with_kafka(mut self, servers: impl Into<String>) -> Self {
        self.kafka = Some(servers.into());
        self
    }

    /// The case on SQS (`run --sqs URL --sqs-endpoint ENDPOINT`, the queue
    /// created by the scenario) instead of RabbitMQ.
    #[must_use]
    pub(crate) fn with_sqs(mut self, sqs: Arc<TestSqs>) -> Self {
        self.sqs = Some(sqs);
        self
    }

    /// Starts `payments-consumer run` on the case (with `--retry-base-ms 20`
    /// unless `extra` says otherwise) and waits for its `consuming from` line.
    pub(crate) async fn consumer(&self, extra: &[&str]) -> Result<ConsumerProcess, String> {
        self.consumer_with_env(&[], extra).await
    }

    /// [`consumer`](Self::consumer), with environment variables set (as
    /// `RUST_LOG`).
    pub(crate) async fn consumer_with_env(
        &self,
        env: &[(&str, &str)],
        extra: &[&str],
    ) -> Result<ConsumerProcess, String> {
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("{}: {e}", self.dir.display()))?;
        let n = self.started.fetch_add(1, Ordering::Relaxed) + 1;
        let log = self.dir.join(format!("{}-consumer-{n}.log", self.queue));
        let stderr = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let mut command = Command::new(&self.binary);
        let database = self.consumer_database.as_deref().unwrap_or(&self.database);
        command.args(["run", "--database", database]);
        match &self.kafka {
            Some(servers) => {
                command.args(["--kafka", servers, "--topic", &self.queue]);
                if !extra.contains(&"--group") {
                    command.args(["--group", &self.queue]);
                }
                &mut command
            }
            None => match &self.sqs {
                Some(sqs) => command.args(["--sqs", &sqs.queue_url(&self.queue)]).args([
                    "--sqs-endpoint",
                    &self
                        .consumer_sqs_endpoint
                        .clone()
                        .unwrap_or_else(|| sqs.endpoint()),
                ]),
                None => command.args(["--amqp", &self.amqp, "--queue", &self.queue]),
            },
        };
        if self.sqs.is_some() {
            command.envs(super::sqs::AWS_ENV);
        }
        if !extra.contains(&"--retry-base-ms") {
            command.args(["--retry-base-ms", "20"]);
        }
        let mut child = command
            .args(extra)
            .envs(env.iter().copied())
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
    pub(crate) async fn command(&self, args: &[&str]) -> Result<String, String> {
        let mut command = Command::new(&self.binary);
        if self.sqs.is_some() {
            command.envs(super::sqs::AWS_ENV);
        }
        let output = command
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
    pub(crate) async fn balance(&self, account: &str) -> Result<Account, String> {
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
    pub(crate) async fn dead_letters(&self) -> Result<Vec<serde_json::Value>, String> {
        let out = self
            .command(&["dead-letters", "--amqp", &self.amqp, "--queue", &self.queue])
            .await?;
        out.lines()
            .map(|line| serde_json::from_str(line).map_err(|e| format!("{line:?}: {e}")))
            .collect()
    }

    /// The dead letters as idem-rabbitmq reads them (with their `x-death`).
    pub(crate) async fn dead_letter_messages(&self) -> Result<Vec<DeadLetterMessage>, String> {
        idem_rabbitmq::dead_letters(&self.amqp, &self.queue)
            .await
            .map_err(|e| e.to_string())
    }

    /// The inbox's consumer name for the case's queue.
    pub(crate) fn inbox_consumer(&self) -> String {
        inbox_name(&self.queue)
    }

    /// The case's database (migrated).
    pub(crate) async fn database(&self) -> Result<Database, String> {
        Database::open(&self.database, 2)
            .await
            .map_err(|e| format!("the database: {e}"))
    }

    /// Stops the broker (`rabbitmqctl stop_app`: every connection closed,
    /// the port refusing new ones, durable queues and persistent messages
    /// kept), waits `down`, and starts it again.
    pub(crate) async fn restart_broker(&self, down: Duration) -> Result<(), String> {
        let broker = self
            .broker
            .clone()
            .ok_or("the case has no broker to restart (Case::with_broker)")?;
        let ctl = |command: &'static str| {
            let broker = broker.clone();
            async move {
                tokio::task::spawn_blocking(move || broker.ctl(&[command]).map(drop))
                    .await
                    .map_err(|e| e.to_string())?
                    .map_err(|e| format!("rabbitmqctl {command}: {e}"))
            }
        };
        ctl("stop_app").await?;
        tokio::time::sleep(down).await;
        ctl("start_app").await
    }
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// How many messages `consumer` processed (its inbox rows).
pub(crate) async fn processed(database: &Database, consumer: &str) -> Result<i64, String> {
    // The name is the scenario's own (letters, digits, `_`, `/`, `-`).
    let query =
        format!("SELECT count(*) AS n FROM idem_consumer_inbox WHERE consumer = '{consumer}'");
    count(database, &query).await.map_err(|e| e.to_string())
}

async fn count(database: &Database, query: &str) -> Result<i64, ConsumerError> {
    Ok(with_connection!(database, connection => {
        diesel::sql_query(query).get_result::<Count>(connection).await?.n
    }))
}

/// Every account, by id.
pub(crate) async fn accounts(database: &Database) -> Result<Vec<Account>, String> {
    database.accounts().await.map_err(|e| e.to_string())
}

impl ConsumerProcess {
    /// Kills it with `SIGKILL`: no acknowledgement, no cleanup.
    pub(crate) async fn kill(mut self) {
        let _ = self.child.kill().await;
    }

    /// Stops it with `SIGTERM`, as a supervisor would; fails unless it exits
    /// 0 within 10 s.
    pub(crate) async fn terminate(mut self) -> Result<(), String> {
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

    /// Whether it is still running.
    pub(crate) fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The most memory it has held so far (`VmHWM`, its peak resident set),
    /// in KiB; `None` once it has exited.
    pub(crate) fn peak_rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()?)).ok()?;
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmHWM:"))
            .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
    }

    /// Its log.
    pub(crate) fn log_text(&self) -> String {
        read_log(&self.log)
    }

    /// Its log lines that contain `text`.
    pub(crate) fn log_lines(&self, text: &str) -> Vec<String> {
        read_log(&self.log)
            .lines()
            .filter(|line| line.contains(text))
            .map(str::to_owned)
            .collect()
    }
}

impl Client {
    /// Connects, declares the case's queues, and turns confirmations on.
    pub(crate) async fn connect(case: &Case) -> Result<Self, String> {
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
    pub(crate) async fn publish(
        &self,
        message_id: Option<&str>,
        body: &[u8],
    ) -> Result<(), String> {
        publish(&self.channel, self.topology.queue(), message_id, body).await
    }

    /// The client's channel (in confirm mode).
    pub(crate) fn channel(&self) -> &Channel {
        &self.channel
    }

    /// How many messages are ready in `queue`.
    pub(crate) async fn ready(&self, queue: &str) -> Result<u32, String> {
        idem_rabbitmq::ready(&self.channel, queue)
            .await
            .map_err(|e| e.to_string())
    }

    /// Waits until `queue` holds `count` ready messages.
    pub(crate) async fn wait_ready(&self, queue: &str, count: u32) -> Result<(), String> {
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

    /// Closes the connection.
    pub(crate) async fn close(self) {
        let _ = self.connection.close(200, "bye".into()).await;
    }
}

/// Publishes `body` to `queue` with `message_id` (if any), persistent, and
/// waits for the broker's confirmation (`channel` in confirm mode).
pub(crate) async fn publish(
    channel: &Channel,
    queue: &str,
    message_id: Option<&str>,
    body: &[u8],
) -> Result<(), String> {
    let mut properties = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(PERSISTENT);
    if let Some(id) = message_id {
        properties = properties.with_message_id(id.into());
    }
    let confirmation = channel
        .basic_publish(
            "".into(),
            queue.into(),
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

/// The file's text, or why it could not be read.
pub(crate) fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| format!("({}: {e})", path.display()))
}
