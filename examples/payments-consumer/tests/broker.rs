//! The consumer as a process against a real RabbitMQ node, on a real
//! PostgreSQL and on SQLite, both started here and stopped at the end: every
//! scenario of `payments_consumer::testing::SCENARIOS` on each database
//! (`postgres::NAME`, `sqlite::NAME`), on a queue and a database of its own.
//! The scenarios that stop the broker run alone (the others hold a shared
//! lock).

use std::process::ExitCode;
use std::sync::{Arc, OnceLock, RwLock};

use idem_testkit::{TestPostgres, TestRabbitMq};
use libtest_mimic::{Arguments, Failed, Trial};
use payments_consumer::testing::{Case, SCENARIOS, Scenario};

struct Servers {
    broker: Arc<TestRabbitMq>,
    cluster: TestPostgres,
    logs: std::path::PathBuf,
}

/// The consumer's databases.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Backend {
    Postgres,
    Sqlite,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Self::Postgres => "postgres",
            Self::Sqlite => "sqlite",
        }
    }

    /// A fresh database named `name`.
    fn database(self, servers: &Servers, name: &str) -> Result<String, Failed> {
        match self {
            Self::Postgres => {
                servers
                    .cluster
                    .create_database(name)
                    .map_err(|e| Failed::from(e.to_string()))?;
                Ok(servers.cluster.url(name))
            }
            Self::Sqlite => {
                std::fs::create_dir_all(&servers.logs).map_err(|e| Failed::from(e.to_string()))?;
                Ok(format!(
                    "sqlite://{}",
                    servers.logs.join(format!("{name}.db")).display()
                ))
            }
        }
    }
}

type Shared = Arc<OnceLock<Result<Servers, String>>>;

fn main() -> ExitCode {
    let args = Arguments::from_args();
    let servers: Shared = Arc::new(OnceLock::new());
    let alone = Arc::new(RwLock::new(()));
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => Arc::new(runtime),
        Err(error) => {
            eprintln!("cannot start a Tokio runtime for the tests: {error}");
            return ExitCode::FAILURE;
        }
    };
    let trials = [Backend::Postgres, Backend::Sqlite]
        .into_iter()
        .flat_map(|backend| SCENARIOS.iter().map(move |scenario| (backend, scenario)))
        .filter(|(backend, scenario)| !scenario.postgres_only || *backend == Backend::Postgres)
        .map(|(backend, scenario)| {
            let (servers, runtime, alone) = (servers.clone(), runtime.clone(), alone.clone());
            Trial::test(
                format!("{}::{}", backend.name(), scenario.name),
                move || trial(backend, scenario, &servers, &runtime, &alone),
            )
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    drop(runtime);
    // The node and the cluster are stopped here, whatever the trials did;
    // the consumers' logs stay when a trial failed.
    if let Ok(Some(Ok(servers))) = Arc::try_unwrap(servers).map(OnceLock::into_inner) {
        if !conclusion.has_failed() {
            let _ = std::fs::remove_dir_all(&servers.logs);
        }
        drop(servers);
    }
    conclusion.exit_code()
}

fn trial(
    backend: Backend,
    scenario: &'static Scenario,
    servers: &Shared,
    runtime: &tokio::runtime::Runtime,
    alone: &RwLock<()>,
) -> Result<(), Failed> {
    let servers = servers
        .get_or_init(start)
        .as_ref()
        .map_err(|why| Failed::from(why.as_str()))?;
    // The broker's restart would cut every other scenario's connections.
    let _turn = if scenario.alone {
        Turn::Alone(alone.write().unwrap_or_else(|p| p.into_inner()))
    } else {
        Turn::Shared(alone.read().unwrap_or_else(|p| p.into_inner()))
    };
    let name = format!("{}_{}", scenario.name, backend.name());
    let case = Case::new(
        env!("CARGO_BIN_EXE_payments-consumer"),
        servers.broker.url(),
        backend.database(servers, &name)?,
        name.as_str(),
        servers.logs.clone(),
    )
    .with_broker(servers.broker.clone());
    runtime
        .block_on((scenario.run)(case))
        .map(|figure| println!("{name}: {figure}"))
        .map_err(|why| {
            Failed::from(format!(
                "{why}\n(the consumers' logs: {})",
                servers.logs.display()
            ))
        })
}

#[allow(dead_code)]
enum Turn<'a> {
    Alone(std::sync::RwLockWriteGuard<'a, ()>),
    Shared(std::sync::RwLockReadGuard<'a, ()>),
}

fn start() -> Result<Servers, String> {
    let broker = TestRabbitMq::start().map_err(|e| format!("RabbitMQ: {e}"))?;
    let cluster = TestPostgres::start().map_err(|e| format!("PostgreSQL: {e}"))?;
    let logs = std::env::temp_dir().join(format!("payments-consumer-tests-{}", std::process::id()));
    Ok(Servers {
        broker: Arc::new(broker),
        cluster,
        logs,
    })
}
