//! What both getting-started examples must do, checked on the binary itself:
//! started as a user starts it, on a fresh SQLite file and a free port, driven
//! over HTTP, then stopped with SIGTERM. orders-actix's test includes this file.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use reqwest::StatusCode;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// The example binary, running.
pub(crate) struct Server {
    child: Child,
    pub(crate) base: String,
    dir: PathBuf,
}

impl Server {
    /// Starts `binary` on 127.0.0.1, port 0, with a new database file, and
    /// waits for its `listening on http://ADDR` line.
    pub(crate) async fn start(binary: &str) -> Self {
        let dir = fresh_dir(binary, "orders");
        Self::start_in(binary, dir, "127.0.0.1:0", &[], &[]).await
    }

    /// Starts `binary` listening on `listen`, on `dir/orders.db`, with extra
    /// arguments and environment variables, and waits for its listening line.
    pub(crate) async fn start_in(
        binary: &str,
        dir: PathBuf,
        listen: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let mut command = Command::new(binary);
        command
            .args(["--listen", listen, "--database"])
            .arg(format!("sqlite://{}", dir.join("orders.db").display()))
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        for (name, value) in env {
            command.env(name, value);
        }
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("could not start {binary}: {e}"));
        let stdout = child.stdout.take().unwrap();
        let mut first = String::new();
        tokio::time::timeout(
            Duration::from_secs(30),
            BufReader::new(stdout).read_line(&mut first),
        )
        .await
        .expect("the listening line within 30 s")
        .unwrap();
        let addr = first
            .trim()
            .strip_prefix("listening on http://")
            .unwrap_or_else(|| panic!("the first line is {first:?}"));
        Self {
            child,
            base: format!("http://{addr}"),
            dir,
        }
    }

    /// Kills the server with SIGKILL and waits for it to be gone; the files
    /// stay.
    pub(crate) async fn kill(mut self) -> PathBuf {
        self.child.kill().await.unwrap();
        std::mem::take(&mut self.dir)
    }

    /// Waits for the server to die by itself (a crash point), and answers
    /// its directory.
    pub(crate) async fn crashed(mut self) -> PathBuf {
        let status = tokio::time::timeout(Duration::from_secs(15), self.child.wait())
            .await
            .expect("the server dies at its crash point")
            .unwrap();
        assert!(
            !status.success(),
            "the crash point ended the server: {status}"
        );
        std::mem::take(&mut self.dir)
    }

    /// Sends SIGTERM and answers whether the server exited cleanly.
    pub(crate) async fn stop(mut self) -> bool {
        let pid = self.child.id().unwrap();
        let killed = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        assert!(killed.success());
        let status = tokio::time::timeout(Duration::from_secs(15), self.child.wait())
            .await
            .expect("the server stops within 15 s of SIGTERM")
            .unwrap();
        if !self.dir.as_os_str().is_empty() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
        status.success()
    }
}

/// A new, empty directory for one check of `binary`.
pub(crate) fn fresh_dir(binary: &str, check: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "idem-{check}-{}-{}",
        std::process::id(),
        binary.rsplit('/').next().unwrap_or("example")
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn order(client: &reqwest::Client, base: &str, key: &str, body: &str) -> reqwest::RequestBuilder {
    client
        .post(format!("{base}/orders"))
        .bearer_auth("alice-token")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
}

/// 401 without a token; an order; its replay; 20 parallel duplicates making
/// one order; a clean stop on SIGTERM.
pub(crate) async fn orders_are_made_once(binary: &str) {
    let server = Server::start(binary).await;
    let base = server.base.clone();
    let client = reqwest::Client::new();

    let anonymous = client
        .post(format!("{base}/orders"))
        .header("idempotency-key", "order-1")
        .body(r#"{"item":"tea","quantity":2}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        anonymous.headers()["content-type"],
        "application/problem+json"
    );
    let problem: serde_json::Value = anonymous.json().await.unwrap();
    assert_eq!(problem["status"], 401);

    let body = r#"{"item":"tea","quantity":2}"#;
    let first = order(&client, &base, "order-1", body).send().await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first_body = first.text().await.unwrap();
    let created: serde_json::Value = serde_json::from_str(&first_body).unwrap();
    assert_eq!(created["item"], "tea");
    assert_eq!(created["quantity"], 2);

    let retry = order(&client, &base, "order-1", body).send().await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.text().await.unwrap(), first_body);

    // 20 duplicates at once: one runs; the others are replayed its answer or,
    // while it runs, told `409` with `Retry-After` (the default policy).
    let body = r#"{"item":"cake","quantity":1}"#;
    let duplicates = (0..20).map(|_| {
        let request = order(&client, &base, "order-2", body);
        tokio::spawn(async move {
            let response = request.send().await.unwrap();
            let status = response.status();
            let replayed = response.headers().contains_key("idempotent-replayed");
            let retry_after = response.headers().contains_key("retry-after");
            (
                status,
                replayed,
                retry_after,
                response.text().await.unwrap(),
            )
        })
    });
    let mut answers = Vec::new();
    for duplicate in duplicates.collect::<Vec<_>>() {
        answers.push(duplicate.await.unwrap());
    }
    let executed: Vec<_> = answers
        .iter()
        .filter(|(status, replayed, _, _)| *status == StatusCode::CREATED && !replayed)
        .collect();
    assert_eq!(executed.len(), 1, "{answers:?}");
    let cake = &executed[0].3;
    for (status, replayed, retry_after, text) in &answers {
        match *status {
            StatusCode::CREATED => assert_eq!(text, cake, "replayed: {replayed}"),
            StatusCode::CONFLICT => assert!(retry_after, "a 409 says when to retry"),
            other => panic!("a duplicate was answered {other}: {text}"),
        }
    }

    let listed: serde_json::Value = client
        .get(format!("{base}/orders"))
        .bearer_auth("alice-token")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let items: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|order| order["item"].as_str().unwrap())
        .collect();
    assert_eq!(items, ["tea", "cake"], "one order per key");

    assert!(server.stop().await, "a clean exit on SIGTERM");
}

/// A free port on 127.0.0.1, for a server restarted on the same address:
/// testkit's, outside the range outgoing connections are given theirs from,
/// so none takes it while the server is down.
fn free_port() -> u16 {
    idem_testkit::free_port().unwrap()
}

/// Sends the order of `key` until it is answered `201` (a `409` while a
/// crashed execution's lease runs, a refused connection while the server is
/// down), and answers whether that `201` was a replay.
async fn order_until_created(client: &reqwest::Client, base: &str, key: &str) -> bool {
    let body = r#"{"item":"crash-proof","quantity":1}"#;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{key} was never ordered"
        );
        if let Ok(response) = order(client, base, key, body).send().await {
            match response.status() {
                StatusCode::CREATED => {
                    return response.headers().contains_key("idempotent-replayed");
                }
                StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE => {}
                other => panic!("{key} was answered {other}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The caller's orders' ids.
async fn order_ids(client: &reqwest::Client, base: &str) -> Vec<i64> {
    let listed: serde_json::Value = client
        .get(format!("{base}/orders"))
        .bearer_auth("alice-token")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    listed
        .as_array()
        .unwrap()
        .iter()
        .map(|order| order["id"].as_i64().unwrap())
        .collect()
}

/// Where `--publish` sends the events in a crash check.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Broker {
    /// A throwaway RabbitMQ node, to a queue.
    RabbitMq,
    /// A throwaway Kafka-compatible broker (tansu), to a topic.
    Kafka,
}

/// A running broker of a crash check.
enum Running {
    RabbitMq(idem_testkit::TestRabbitMq),
    Kafka(idem_testkit::TestKafka),
}

/// The events read back: for each order id, the message ids of its events.
type Events = std::collections::BTreeMap<i64, std::collections::BTreeSet<String>>;

impl Running {
    fn start(broker: Broker) -> Self {
        match broker {
            Broker::RabbitMq => Self::RabbitMq(
                idem_testkit::TestRabbitMq::start().expect("a RabbitMQ node for the check"),
            ),
            Broker::Kafka => Self::Kafka(
                idem_testkit::TestKafka::start().expect("a Kafka broker (tansu) for the check"),
            ),
        }
    }

    fn publish_url(&self) -> String {
        match self {
            Self::RabbitMq(broker) => broker.url(),
            Self::Kafka(broker) => format!("kafka://{}", broker.servers()),
        }
    }

    /// Reads `destination` until `orders` orders have events, within 60 s.
    async fn events(&self, destination: &str, orders: usize) -> Events {
        let mut events = Events::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        match self {
            Self::RabbitMq(broker) => {
                use idem::rabbitmq::lapin::options::BasicGetOptions;
                use idem::rabbitmq::lapin::{Connection, ConnectionProperties};
                let connection =
                    Connection::connect(&broker.url(), ConnectionProperties::default())
                        .await
                        .unwrap();
                let channel = connection.create_channel().await.unwrap();
                loop {
                    let got = channel
                        .basic_get(destination.into(), BasicGetOptions { no_ack: true })
                        .await
                        .unwrap();
                    match got {
                        Some(message) => record(
                            &mut events,
                            &message.delivery.data,
                            message
                                .delivery
                                .properties
                                .message_id()
                                .as_ref()
                                .map(|id| id.to_string()),
                        ),
                        None => {
                            if count(&events) >= orders || tokio::time::Instant::now() > deadline {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
                let _ = connection.close(200, "checked".into()).await;
            }
            Self::Kafka(broker) => {
                use idem::kafka::rdkafka::ClientConfig;
                use idem::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
                use idem::kafka::rdkafka::message::{Headers, Message};
                let consumer: BaseConsumer = ClientConfig::new()
                    .set("bootstrap.servers", broker.servers())
                    .set("group.id", "orders-check")
                    .set("enable.auto.commit", "false")
                    .set("auto.offset.reset", "earliest")
                    .create()
                    .unwrap();
                consumer.subscribe(&[destination]).unwrap();
                while count(&events) < orders && tokio::time::Instant::now() < deadline {
                    let polled = tokio::task::block_in_place(|| {
                        consumer.poll(Duration::from_millis(100)).map(|message| {
                            let message = message.unwrap();
                            let message_id = message.headers().and_then(|headers| {
                                headers
                                    .iter()
                                    .find(|header| header.key == "message_id")
                                    .and_then(|header| header.value)
                                    .map(|value| String::from_utf8_lossy(value).into_owned())
                            });
                            (message.payload().unwrap_or_default().to_vec(), message_id)
                        })
                    });
                    if let Some((payload, message_id)) = polled {
                        record(&mut events, &payload, message_id);
                    }
                }
            }
        }
        events
    }
}

/// Notes an event read back: its order's id and its message id.
fn record(events: &mut Events, payload: &[u8], message_id: Option<String>) {
    let body: serde_json::Value = serde_json::from_slice(payload).unwrap();
    assert_eq!(body["type"], "order.created");
    let id = body["order"]["id"].as_i64().unwrap();
    let message_id = message_id.expect("every event has a message id");
    events.entry(id).or_default().insert(message_id);
}

/// How many orders have an event.
fn count(events: &Events) -> usize {
    events.len()
}

/// Transactional mode across crashes (`docs/contract.md` §7, §13), with
/// `--publish` to a real broker: the server dies at each crash point the
/// test arms (the order written but not committed; committed but not
/// answered), then is SIGKILLed at random instants while 8 clients retry 48
/// keys. Afterwards every key made exactly one order, and each order exactly
/// one `order.created` event (the relay publishes at least once: a resend
/// after a crash carries the same message id).
pub(crate) async fn crashes_leave_one_order_and_one_event(binary: &str, broker: Broker) {
    use rand::Rng;

    let running = tokio::task::spawn_blocking(move || Running::start(broker))
        .await
        .unwrap();
    let url = running.publish_url();
    let destination = "orders-created";
    let listen = format!("127.0.0.1:{}", free_port());
    let publish = [
        "--publish",
        url.as_str(),
        "--publish-to",
        destination,
        "--lease-secs",
        "1",
    ];
    let client = reqwest::Client::new();
    let mut dir = fresh_dir(binary, &format!("crash-{broker:?}"));

    // The armed crash points, one key each.
    for (point, replayed_after) in [("write", false), ("answer", true)] {
        let server = Server::start_in(
            binary,
            dir,
            &listen,
            &publish,
            &[("ORDERS_CRASH_AT", point)],
        )
        .await;
        let key = format!("crash-at-{point}");
        let lost = order(
            &client,
            &server.base,
            &key,
            r#"{"item":"crash-proof","quantity":1}"#,
        )
        .send()
        .await;
        assert!(
            lost.is_err(),
            "{point}: the answer is lost with the server: {lost:?}"
        );
        dir = server.crashed().await;
        let server = Server::start_in(binary, dir, &listen, &publish, &[]).await;
        let replayed = order_until_created(&client, &server.base, &key).await;
        assert_eq!(
            replayed, replayed_after,
            "{point}: the retry replays only what committed"
        );
        dir = server.kill().await;
    }

    // Random kills while 8 clients retry their keys.
    let base = format!("http://{listen}");
    let clients: Vec<_> = (0..8)
        .map(|client_number| {
            let (client, base) = (client.clone(), base.clone());
            tokio::spawn(async move {
                for n in 0..6 {
                    order_until_created(&client, &base, &format!("client-{client_number}-{n}"))
                        .await;
                }
            })
        })
        .collect();
    for _ in 0..5 {
        let server = Server::start_in(binary, dir, &listen, &publish, &[]).await;
        let delay = rand::rng().random_range(50..300);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        dir = server.kill().await;
    }
    let server = Server::start_in(binary, dir, &listen, &publish, &[]).await;
    for client in clients {
        client.await.unwrap();
    }

    let mut ids = order_ids(&client, &server.base).await;
    let keys = 2 + 8 * 6;
    assert_eq!(ids.len(), keys, "one order per key: {ids:?}");
    ids.sort_unstable();

    // Every order's event, once the relay has drained.
    let events = running.events(destination, keys).await;
    assert_eq!(
        events.keys().copied().collect::<Vec<_>>(),
        ids,
        "an event for every order, and none for an order that does not exist"
    );
    for (id, message_ids) in &events {
        assert_eq!(
            message_ids.len(),
            1,
            "order {id} has one event: {message_ids:?}"
        );
    }
    assert!(server.stop().await, "a clean exit on SIGTERM");
}

/// `--publish` with a URL that is neither `amqp://` nor `kafka://` stops the
/// start with an error naming what is expected, without repeating the URL
/// (it may hold a password).
pub(crate) async fn a_bad_publish_url_fails_the_start(binary: &str) {
    let dir = fresh_dir(binary, "bad-publish");
    let output = tokio::time::timeout(
        Duration::from_secs(15),
        Command::new(binary)
            .args(["--listen", "127.0.0.1:0", "--database"])
            .arg(format!("sqlite://{}", dir.join("orders.db").display()))
            .args(["--publish", "http://user:hunter2@example.invalid"])
            .output(),
    )
    .await
    .expect("the start fails within 15 s")
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(output.stdout.is_empty(), "nothing listened");
    assert!(
        stderr.contains("--publish needs an amqp:// or a kafka:// URL"),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");
}
