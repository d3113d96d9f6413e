//! What the server logs: never a credential, a full idempotency key or a
//! request body, at any level.

use std::sync::Arc;

use payments::Principal;

use crate::Suite;
use crate::server::{Launch, Post, Scratch, Server};

/// Every store, `RUST_LOG=trace`, each kind of keyed and unkeyed request: the
/// whole log holds the scope (the token's hash) but never the token, a key or
/// a body.
pub(crate) async fn no_token_key_or_body_in_the_log_at_trace(suite: Arc<Suite>) {
    let scratch = Scratch::new("payments-logs");
    let sqlite = scratch.sqlite();
    let postgres = suite.fresh_database().await;
    for store in ["memory", sqlite.as_str(), postgres.as_str()] {
        let secrets = Secrets::new();
        let server = Server::launch(
            suite.binary(),
            Launch {
                rust_log: "trace",
                log_lines: usize::MAX,
                ..Launch::new(store)
            },
        )
        .await;
        let statuses = secrets.send_every_kind(&server).await;
        assert_eq!(
            statuses,
            [201, 201, 422, 400, 201, 201, 401, 201, 201, 201, 201, 201],
            "{store}"
        );
        let log = server.kill_and_read_log().await;
        let scope = Principal::from_token(&secrets.token);
        assert!(
            log.contains(scope.as_str()),
            "{store}: the log names the scope; the log:\n{log}"
        );
        for secret in secrets.every() {
            // As text, and as the decimal bytes a database driver's debug
            // output shows for a bound parameter.
            let bytes = format!("{:?}", secret.as_bytes());
            let bytes = bytes.trim_start_matches('[').trim_end_matches(']');
            if let Some(line) = log
                .lines()
                .find(|line| line.contains(secret) || line.contains(bytes))
            {
                panic!("{store}: the log holds {secret:?}:\n{line}");
            }
        }
        // Keys of 1 to 4 characters show no prefix at all (`key=…(3)`): the
        // 1-character key is looked for as a field, the others anywhere.
        for key in SHORT_KEYS {
            let shown = format!("key={key}");
            if let Some(line) = log
                .lines()
                .find(|line| line.contains(&shown) || (key.len() > 1 && line.contains(key)))
            {
                panic!("{store}: the log holds the short key {key:?}:\n{line}");
            }
        }
        // A request-controlled field shows at most 128 bytes: the 2000-byte
        // account id (in the path, and in the line that says it was applied)
        // leaves no line longer than the bounds allow.
        if let Some(line) = log.lines().find(|line| line.len() > 2048) {
            panic!("{store}: a log line of {} bytes:\n{line}", line.len());
        }
        for shown in ["…(2018 bytes)", "…(2000 bytes)"] {
            assert!(
                log.contains(shown),
                "{store}: the long path and account id are shown bounded ({shown})"
            );
        }
    }
}

/// Keys of 1 to 4 characters, of characters no log line holds otherwise.
const SHORT_KEYS: [&str; 4] = ["~", "~^", "~^]", "~^]|"];

/// An account id of 2000 bytes (under PostgreSQL's index row limit): a field a
/// request controls, logged bounded.
fn long_account() -> String {
    "a".repeat(2000)
}

/// A token, keys and bodies that appear nowhere else.
struct Secrets {
    token: String,
    keys: [String; 3],
    bodies: [String; 3],
}

impl Secrets {
    fn new() -> Self {
        let unique = || uuid::Uuid::new_v4().simple().to_string();
        Self {
            token: format!("tok-{}", unique()),
            keys: [(); 3].map(|()| format!("key-{}", unique())),
            bodies: [(); 3].map(|()| {
                let amount = 1_000_000 + rand::random_range(0..1_000_000);
                format!(r#"{{"amount": {amount}, "currency": "EUR"}}"#)
            }),
        }
    }

    fn every(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.token.as_str())
            .chain(self.keys.iter().map(String::as_str))
            .chain(self.bodies.iter().map(String::as_str))
    }

    /// A charge, its replay, its key reused, an invalid body, a keyed and an
    /// unkeyed deposit, and a request without a token: their statuses.
    async fn send_every_kind(&self, server: &Server) -> Vec<u16> {
        let endpoint = server.endpoint();
        let charges = "/accounts/acct-logs/charges";
        let deposits = "/accounts/acct-logs/deposits";
        let long = format!("/accounts/{}/charges", long_account());
        let requests: [(&str, Option<&str>, &str, &str); 12] = [
            (charges, Some(&self.keys[0]), &self.bodies[0], &self.token),
            (charges, Some(&self.keys[0]), &self.bodies[0], &self.token),
            (charges, Some(&self.keys[0]), &self.bodies[1], &self.token),
            (
                charges,
                Some(&self.keys[1]),
                r#"{"amount": -1, "currency": "EUR"}"#,
                &self.token,
            ),
            (deposits, Some(&self.keys[2]), &self.bodies[1], &self.token),
            (deposits, None, &self.bodies[2], &self.token),
            (charges, Some(&self.keys[1]), &self.bodies[2], ""),
            (charges, Some(SHORT_KEYS[0]), &self.bodies[0], &self.token),
            (charges, Some(SHORT_KEYS[1]), &self.bodies[0], &self.token),
            (charges, Some(SHORT_KEYS[2]), &self.bodies[0], &self.token),
            (charges, Some(SHORT_KEYS[3]), &self.bodies[0], &self.token),
            (&long, Some("long-account-1"), &self.bodies[0], &self.token),
        ];
        let mut statuses = Vec::new();
        for (path, key, body, principal) in requests {
            let reply = endpoint
                .post(Post {
                    path,
                    principal,
                    key,
                    body,
                })
                .await
                .expect("an answer");
            statuses.push(reply.status);
        }
        statuses
    }
}
