//! The consumer as a process against a real RabbitMQ node and a real
//! PostgreSQL, both started here and stopped at the end: every scenario of
//! `payments_consumer::testing::SCENARIOS`, one trial each, on a queue and a
//! database of its own.

use std::process::ExitCode;
use std::sync::{Arc, OnceLock};

use idem_testkit::TestPostgres;
use idem_testkit::TestRabbitMq;
use libtest_mimic::{Arguments, Failed, Trial};
use payments_consumer::testing::{Case, SCENARIOS};

struct Servers {
    broker: TestRabbitMq,
    cluster: TestPostgres,
    logs: std::path::PathBuf,
}

fn main() -> ExitCode {
    let args = Arguments::from_args();
    let servers: Arc<OnceLock<Result<Servers, String>>> = Arc::new(OnceLock::new());
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
    let trials = SCENARIOS
        .iter()
        .map(|scenario| {
            let servers = servers.clone();
            let runtime = runtime.clone();
            Trial::test(scenario.name, move || {
                let servers = servers
                    .get_or_init(start)
                    .as_ref()
                    .map_err(|why| Failed::from(why.as_str()))?;
                servers
                    .cluster
                    .create_database(scenario.name)
                    .map_err(|e| Failed::from(e.to_string()))?;
                let case = Case::new(
                    env!("CARGO_BIN_EXE_payments-consumer"),
                    servers.broker.url(),
                    servers.cluster.url(scenario.name),
                    scenario.name,
                    servers.logs.clone(),
                );
                runtime
                    .block_on((scenario.run)(case))
                    .map(|figure| println!("{}: {figure}", scenario.name))
                    .map_err(|why| {
                        Failed::from(format!(
                            "{why}\n(the consumers' logs: {})",
                            servers.logs.display()
                        ))
                    })
            })
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

fn start() -> Result<Servers, String> {
    let broker = TestRabbitMq::start().map_err(|e| format!("RabbitMQ: {e}"))?;
    let cluster = TestPostgres::start().map_err(|e| format!("PostgreSQL: {e}"))?;
    let logs = std::env::temp_dir().join(format!("payments-consumer-tests-{}", std::process::id()));
    Ok(Servers {
        broker,
        cluster,
        logs,
    })
}
