//! Every kind of server stops by itself, and its directory goes, when the
//! process that started it is killed with `SIGKILL` (no destructor runs):
//! the watchdog sees its pipe close.
//!
//! Each test runs this binary again as a child (`IDEM_TESTKIT_CHILD=KIND`,
//! the `child` entry below), which starts the server, prints its port and
//! directory, and waits to be killed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use idem_testkit::{TestPostgres, TestRabbitMq, TestRedis};

const CHILD: &str = "IDEM_TESTKIT_CHILD";

/// Not a test of its own: the child's body, run only under [`CHILD`].
#[test]
fn child() {
    let Ok(kind) = std::env::var(CHILD) else {
        return;
    };
    let (port, dir): (u16, PathBuf) = match kind.as_str() {
        "postgres" => {
            let cluster = Box::leak(Box::new(TestPostgres::start().unwrap()));
            let dir = PathBuf::from(cluster.psql("postgres", "SHOW data_directory").unwrap());
            (cluster.port(), dir)
        }
        "redis" => {
            let redis = Box::leak(Box::new(TestRedis::start().unwrap()));
            let dir = redis.cli(&["CONFIG", "GET", "dir"]).unwrap().remove(0);
            let dir = dir.lines().nth(1).unwrap().to_owned();
            (redis.ports()[0], PathBuf::from(dir))
        }
        "rabbitmq" => {
            let broker = Box::leak(Box::new(TestRabbitMq::start().unwrap()));
            (broker.port(), broker.dir().to_owned())
        }
        other => panic!("no server kind {other}"),
    };
    println!("ready {port} {}", dir.display());
    loop {
        std::thread::sleep(Duration::from_secs(60));
    }
}

/// Starts the child for `kind`, kills it once its server is ready, and
/// waits until the server's port is closed and its directory gone.
fn killed_child_leaves_nothing(kind: &str) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env(CHILD, kind)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let ready = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find_map(|line| line.split_once("ready ").map(|(_, rest)| rest.to_owned()))
        .unwrap_or_else(|| panic!("the {kind} child printed no `ready` line"));
    let (port, dir) = ready.split_once(' ').unwrap();
    let (port, dir): (u16, PathBuf) = (port.parse().unwrap(), PathBuf::from(dir));
    assert!(connects(port), "the {kind} server listens before the kill");
    assert!(dir.exists(), "{} exists before the kill", dir.display());

    child.kill().unwrap(); // SIGKILL: no destructor runs in the child.
    child.wait().unwrap();

    let deadline = Instant::now() + Duration::from_secs(60);
    while connects(port) || dir.exists() {
        assert!(
            Instant::now() < deadline,
            "60 s after its process was killed, the {kind} server still listens ({}) \
             or its directory {} is still there ({})",
            connects(port),
            dir.display(),
            dir.exists()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn connects(port: u16) -> bool {
    TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(1)).is_ok()
}

#[test]
fn postgres_stops_when_its_process_is_killed() {
    if std::env::var(CHILD).is_err() {
        killed_child_leaves_nothing("postgres");
    }
}

#[test]
fn redis_stops_when_its_process_is_killed() {
    if std::env::var(CHILD).is_err() {
        killed_child_leaves_nothing("redis");
    }
}

#[test]
fn rabbitmq_stops_when_its_process_is_killed() {
    if std::env::var(CHILD).is_err() {
        killed_child_leaves_nothing("rabbitmq");
    }
}
