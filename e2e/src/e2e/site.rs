//! Where a scenario runs: an example binary over a fresh store of one kind.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_testkit::TestRedis;

use crate::example::{Example, Server};

use super::api::{Api, Failure};
use super::postgres::Cluster;

/// A store the examples run on (`--store`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum StoreKind {
    Memory,
    Sqlite,
    Postgres,
    /// A Redis node of the scenario's own.
    Redis,
}

/// One example over one kind of store; hands each scenario a fresh store.
pub(crate) struct Deployment {
    pub(crate) example: Example,
    pub(crate) store: StoreKind,
    binary: PathBuf,
    root: PathBuf,
    /// The shared cluster, or why it is not there.
    cluster: Result<Arc<Cluster>, String>,
    sites: AtomicUsize,
    /// The example's `--help`: which optional flags it offers.
    help: String,
}

/// One scenario's store and directory; its servers run here, one after the
/// other or side by side.
pub(crate) struct Site {
    binary: PathBuf,
    dir: PathBuf,
    url: String,
    cluster: Option<Arc<Cluster>>,
    /// The scenario's Redis, stopped with the site.
    redis: Option<TestRedis>,
    servers: AtomicUsize,
}

/// A running example and a client of it; killed when dropped.
pub(crate) struct Instance {
    server: Server,
    pub(crate) api: Api,
}

impl StoreKind {
    pub(crate) const ALL: [Self; 4] = [Self::Memory, Self::Sqlite, Self::Postgres, Self::Redis];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Sqlite => "sqlite",
            Self::Postgres => "postgres",
            Self::Redis => "redis",
        }
    }
}

impl Deployment {
    pub(crate) fn new(
        example: Example,
        store: StoreKind,
        binary: PathBuf,
        help: String,
        root: &Path,
        cluster: Result<Arc<Cluster>, String>,
    ) -> Self {
        Self {
            example,
            store,
            binary,
            root: root.to_owned(),
            cluster,
            sites: AtomicUsize::new(0),
            help,
        }
    }

    /// Whether the example's `--help` mentions `flag`.
    pub(crate) fn offers(&self, flag: &str) -> bool {
        self.help
            .split(|c: char| c.is_whitespace() || c == ',' || c == '=')
            .any(|word| word == flag)
    }

    /// A fresh store for `scenario` (on PostgreSQL, a fresh database of the
    /// shared cluster; on Redis, a node of its own).
    pub(crate) async fn site(&self, scenario: &str) -> Result<Site, Failure> {
        match (&self.cluster, self.store) {
            (Ok(cluster), StoreKind::Postgres) => {
                self.site_on(scenario, Some(cluster.clone())).await
            }
            (Err(why), StoreKind::Postgres) => Err(Failure::new(
                "no PostgreSQL",
                format!("the PostgreSQL cluster did not start: {why}"),
            )),
            _ => self.site_on(scenario, None).await,
        }
    }

    /// A PostgreSQL cluster of the scenario's own, for scenarios that stop it.
    pub(crate) async fn own_cluster(&self, scenario: &str) -> Result<Arc<Cluster>, Failure> {
        let dir = self.scratch(&format!("{scenario}-cluster"));
        blocking(move || Cluster::start(&dir)).await.map(Arc::new)
    }

    /// A fresh store for `scenario`; on PostgreSQL, a fresh database of `cluster`.
    pub(crate) async fn site_on(
        &self,
        scenario: &str,
        cluster: Option<Arc<Cluster>>,
    ) -> Result<Site, Failure> {
        let dir = self.scratch(scenario);
        std::fs::create_dir_all(&dir)
            .map_err(|e| Failure::new("no directory", format!("{}: {e}", dir.display())))?;
        let mut redis = None;
        let url = match self.store {
            StoreKind::Memory => "memory".to_owned(),
            StoreKind::Redis => {
                let node = blocking(|| TestRedis::start().map_err(|e| e.to_string())).await?;
                let url = node.url();
                redis = Some(node);
                url
            }
            // Relative to the server's working directory, the default of `docs/contract.md` §8.
            StoreKind::Sqlite => "sqlite://payments.db".to_owned(),
            StoreKind::Postgres => {
                let Some(cluster) = cluster.clone() else {
                    return Err(Failure::new(
                        "no PostgreSQL",
                        "the PostgreSQL cluster did not start",
                    ));
                };
                blocking(move || cluster.create_database()).await?
            }
        };
        Ok(Site {
            binary: self.binary.clone(),
            dir,
            url,
            cluster,
            redis,
            servers: AtomicUsize::new(0),
        })
    }

    fn scratch(&self, scenario: &str) -> PathBuf {
        let n = self.sites.fetch_add(1, Ordering::Relaxed) + 1;
        self.root.join(format!(
            "{}-{}-{scenario}-{n}",
            self.example.package(),
            self.store.name()
        ))
    }
}

impl Site {
    /// How many lines of this site's servers' logs contain every one of
    /// `texts`.
    pub(crate) fn log_lines(&self, texts: &[&str]) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        entries
            .filter_map(Result::ok)
            .filter(|entry| entry.file_name().to_string_lossy().starts_with("server-"))
            .map(|entry| {
                std::fs::read_to_string(entry.path())
                    .unwrap_or_default()
                    .lines()
                    .filter(|line| texts.iter().all(|text| line.contains(text)))
                    .count()
            })
            .sum()
    }

    /// Starts the example over this site's store with extra `flags`.
    pub(crate) async fn start(&self, flags: &[&str]) -> Result<Instance, Failure> {
        self.start_with_env(flags, &[]).await
    }

    /// [`start`](Self::start), with environment variables (a crash test's
    /// crash point).
    pub(crate) async fn start_with_env(
        &self,
        flags: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Instance, Failure> {
        self.launch(&self.url, flags, env).await
    }

    /// This site's store, as `--store` names it (e.g. `postgres://…`).
    pub(crate) fn store_url(&self) -> &str {
        &self.url
    }

    /// [`start`](Self::start) with `--store store` instead of the site's own
    /// URL: the same store reached another way (through a fault proxy).
    pub(crate) async fn start_on(&self, store: &str, flags: &[&str]) -> Result<Instance, Failure> {
        self.launch(store, flags, &[]).await
    }

    async fn launch(
        &self,
        store: &str,
        flags: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Instance, Failure> {
        let n = self.servers.fetch_add(1, Ordering::Relaxed) + 1;
        let log = self.dir.join(format!("server-{n}.log"));
        let mut args = vec!["--store".to_owned(), store.to_owned()];
        args.extend(flags.iter().map(|f| (*f).to_owned()));
        let (binary, dir) = (self.binary.clone(), self.dir.clone());
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
            .collect();
        let started = {
            let log = log.clone();
            blocking(move || {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                Server::start_logged(&binary, &dir, &args, &env, &log)
            })
            .await
        };
        let server = started.map_err(|failure| {
            Failure::new(
                "did not start",
                format!(
                    "{}\nflags: --store {} {}\nstderr: {}",
                    failure.details,
                    store,
                    flags.join(" "),
                    log_tail(&log)
                ),
            )
        })?;
        let api = Api::new(&server.base).map_err(|e| Failure::new("no client", e))?;
        Ok(Instance { server, api })
    }

    /// Counts the idempotency records in the store, where the harness can see
    /// them (`None` for the in-memory store).
    pub(crate) async fn records(&self) -> Result<Option<i64>, Failure> {
        const COUNT: &str = "SELECT count(*) FROM idem_records";
        if let Some(redis) = &self.redis {
            // The Redis store's records are the keys under its default prefix.
            let listed = redis
                .cli(&["--scan", "--pattern", "idem:{*"])
                .map_err(|e| Failure::new("redis-cli failed", e.to_string()))?;
            let keys = listed.iter().flat_map(|keys| keys.lines()).count();
            return Ok(Some(i64::try_from(keys).unwrap_or(i64::MAX)));
        }
        let Some(text) = self.query(COUNT).await? else {
            return Ok(None);
        };
        text.parse()
            .map(Some)
            .map_err(|_| Failure::new("unreadable count", format!("{COUNT} answered {text:?}")))
    }

    /// Runs `sql` in the site's SQL database (psql or the `sqlite3` CLI) and
    /// answers the output, columns separated by `|`; `None` without such a
    /// database.
    pub(crate) async fn query(&self, sql: &str) -> Result<Option<String>, Failure> {
        let sql = sql.to_owned();
        if let Some(cluster) = self.cluster.clone() {
            let url = self.url.clone();
            return blocking(move || cluster.query(&url, &sql).map(Some)).await;
        }
        if !self.url.starts_with("sqlite://") {
            return Ok(None);
        }
        let file = self.dir.join("payments.db");
        blocking(move || {
            let out = match Command::new("sqlite3")
                .args(["-cmd", ".timeout 5000"])
                .arg(&file)
                .arg(&sql)
                .stdin(Stdio::null())
                .output()
            {
                Ok(out) => out,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(
                        "the sqlite3 command is missing: install it (`apt-get install sqlite3`; \
                         .ci/run does) so that the SQLite rows can read the API's tables"
                            .to_owned(),
                    );
                }
                Err(e) => return Err(format!("sqlite3: {e}")),
            };
            if out.status.success() {
                Ok(Some(String::from_utf8_lossy(&out.stdout).trim().to_owned()))
            } else {
                Err(format!("sqlite3: {}", String::from_utf8_lossy(&out.stderr)))
            }
        })
        .await
    }
}

impl Instance {
    /// Where the server listens: `http://127.0.0.1:PORT`.
    pub(crate) fn base(&self) -> &str {
        &self.server.base
    }

    /// Kills the process at once (SIGKILL), as a crash would.
    pub(crate) fn kill(self) {
        drop(self.server);
    }

    /// Stops the process as a supervisor would (SIGTERM, then SIGKILL after 5 s).
    pub(crate) async fn terminate(self) {
        let server = self.server;
        let _ = blocking(move || {
            server.terminate(Duration::from_secs(5));
            Ok(())
        })
        .await;
    }
}

/// Runs blocking work (processes, pipes) off the async workers.
pub(crate) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, Failure> {
    match tokio::task::spawn_blocking(work).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(message)) => Err(Failure::new(first_line(&message), message)),
        Err(e) => Err(Failure::new("harness task failed", e.to_string())),
    }
}

fn first_line(message: &str) -> String {
    let line = message.lines().next().unwrap_or_default();
    line.chars().take(60).collect()
}

/// The last lines a server wrote to stderr, for failure details.
fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(8)..].join("\n  ");
    if tail.is_empty() {
        "(nothing)".to_owned()
    } else {
        format!("\n  {tail}")
    }
}

/// `binary --help`, bounded in time: an example that ignores the flag and
/// starts serving is killed after 5 s.
pub(crate) fn help_text(binary: &Path) -> String {
    let Ok(mut child) = Command::new(binary)
        .arg("--help")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
    else {
        return String::new();
    };
    let stdout = child.stdout.take();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut stdout) = stdout {
            let _ = std::io::Read::read_to_string(&mut stdout, &mut text);
        }
        text
    });
    for _ in 0..250 {
        if !matches!(child.try_wait(), Ok(None)) {
            return reader.join().unwrap_or_default();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    reader.join().unwrap_or_default()
}
