//! The examples as real processes on 127.0.0.1.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem_testkit::shell::{self, cargo, target_dir};

/// An example binary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Example {
    Axum,
    Actix,
    /// `payments-consumer`, the RabbitMQ consumer (no HTTP server).
    Consumer,
    /// `orders-axum`, the Getting started app on axum.
    OrdersAxum,
    /// `orders-actix`, the Getting started app on actix-web.
    OrdersActix,
}

impl Example {
    pub(crate) fn package(self) -> &'static str {
        match self {
            Self::Axum => "payments-axum",
            Self::Actix => "payments-actix",
            Self::Consumer => "payments-consumer",
            Self::OrdersAxum => "orders-axum",
            Self::OrdersActix => "orders-actix",
        }
    }

    /// Builds the binaries of `examples` for a plain `cargo run` (dev
    /// profile, default features), in one cargo invocation, and answers the
    /// directory they are in.
    pub(crate) fn build_dev(examples: &[Self]) -> Result<PathBuf, String> {
        let mut args = vec!["build", "-q"];
        for example in examples {
            args.extend(["-p", example.package()]);
        }
        shell::run(&format!("cargo {}", args.join(" ")), &mut cargo(&args))?;
        Ok(target_dir().join("debug"))
    }

    /// The binary in the directory a build answered.
    pub(crate) fn binary(self, dir: &Path) -> PathBuf {
        dir.join(self.package())
    }
}

/// A running example; killed when dropped.
pub(crate) struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub(crate) base: String,
}

impl Server {
    /// Starts `binary` in `dir` with `args`, and waits for its `listening on`
    /// line; its stderr (its log) is appended to `log`, off the terminal.
    pub(crate) fn start_logged(
        binary: &Path,
        dir: &Path,
        args: &[&str],
        env: &[(String, String)],
        log: &Path,
    ) -> Result<Self, String> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| format!("{}: {e}", log.display()))?;
        Self::launch(binary, dir, args, env, Stdio::from(file))
    }

    /// Asks the server to stop (SIGTERM), as a supervisor would, and kills it
    /// if it is still running after `grace`.
    pub(crate) fn terminate(mut self, grace: Duration) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Drop kills what is left.
    }

    fn launch(
        binary: &Path,
        dir: &Path,
        args: &[&str],
        env: &[(String, String)],
        stderr: Stdio,
    ) -> Result<Self, String> {
        let mut child = Command::new(binary)
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .envs(env.iter().map(|(name, value)| (name, value)))
            .current_dir(dir)
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("could not start {}: {e}", binary.display()))?;
        let stdout = child.stdout.take().ok_or_else(|| "no stdout".to_owned())?;
        let rx = idem_testkit::shell::first_line(stdout);
        let mut server = Self {
            child,
            base: String::new(),
        };
        let first = rx.recv_timeout(Duration::from_secs(30)).map_err(|_| {
            let exit = match server.child.try_wait() {
                Ok(Some(status)) => format!(" and exited ({status})"),
                _ => String::new(),
            };
            format!("{} printed no `listening on` line{exit}", binary.display())
        })?;
        let base = first
            .strip_prefix("listening on ")
            .ok_or_else(|| format!("unexpected first line: {first:?}"))?;
        server.base = base.trim_end_matches('/').to_owned();
        Ok(server)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
