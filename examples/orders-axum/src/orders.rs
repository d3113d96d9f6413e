//! What the orders API is without its web framework (orders-actix includes
//! this file too): the caller's principal, the problem answers' body, and the
//! application's own data: orders, in the same SQLite file as the idempotency
//! records, written in the request's transaction.
//!
//! Same file, same transaction: the order, its event and the idempotency
//! record's completion commit together (transactional mode), so a crash at any
//! instant leaves the order with its record, or neither, and the retry replays
//! it or orders once.

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Text};
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use idem::Scope;
use idem::diesel::{Event, SqliteOutbox, SqlitePool, SqliteTransaction, SqliteTransactionError};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Who the caller is, as authentication established it: the idempotency scope,
/// so two callers never share a key.
///
/// Here: a SHA-256 of the bearer token, so that no log line (the idempotency
/// span names the scope) holds a credential. A real application verifies the
/// token (a session, a JWT) and uses the user id it names.
#[derive(Clone, Debug)]
pub struct Principal(String);

impl Principal {
    /// The principal of an `Authorization: Bearer TOKEN` header's value.
    pub fn from_authorization(value: Option<&[u8]>) -> Option<Self> {
        let value = std::str::from_utf8(value?).ok()?;
        // The scheme is case-insensitive (RFC 9110 §11.1).
        let (scheme, token) = value.split_at_checked(7)?;
        if !scheme.eq_ignore_ascii_case("Bearer ") {
            return None;
        }
        let token = token.trim();
        if token.is_empty() {
            return None;
        }
        let digest = Sha256::digest(token.as_bytes());
        Some(Self(
            digest.iter().map(|byte| format!("{byte:02x}")).collect(),
        ))
    }
}

impl From<Principal> for Scope {
    fn from(principal: Principal) -> Self {
        Scope::new(principal.0)
    }
}

/// What `POST /orders` takes.
#[derive(Debug, Deserialize)]
pub struct NewOrder {
    /// What to order.
    pub item: String,
    /// How many (at least 1).
    pub quantity: i64,
}

/// The body of an RFC 9457 problem answer (`application/problem+json`).
pub fn problem_body(status: u16, title: &str, detail: &str) -> String {
    serde_json::json!({ "type": "about:blank", "title": title, "status": status, "detail": detail })
        .to_string()
}

/// A failed query, with its cause (logged, never sent to the client).
pub type OrdersError = Box<dyn std::error::Error + Send + Sync>;

/// One order.
#[derive(Debug, Serialize, QueryableByName)]
pub struct Order {
    /// Its number.
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    /// What was ordered.
    #[diesel(sql_type = Text)]
    pub item: String,
    /// How many.
    #[diesel(sql_type = BigInt)]
    pub quantity: i64,
}

/// The orders table, in the idempotency store's SQLite file, and the outbox
/// that carries `order.created` to the broker when the app publishes.
#[derive(Clone)]
pub struct Orders {
    pool: SqlitePool,
    publishing: Option<Publishing>,
    crash: Option<CrashPoint>,
}

/// The outbox and where its events go (`--publish`, `--publish-to`).
#[derive(Clone)]
pub struct Publishing {
    /// The outbox, in the orders' file.
    pub outbox: SqliteOutbox,
    /// The queue or topic.
    pub destination: String,
}

/// Where a crash test asks the app to die (the environment variable
/// `ORDERS_CRASH_AT`): a fault the end-to-end tests arm to reach one instant
/// exactly, instead of killing the process at a lucky moment. Not part of the
/// application a user copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashPoint {
    /// `write`: the order (and its event) written in the request's
    /// transaction, not committed yet. On a plain store, whose handler writes
    /// commit on their own, this is the instant between the handler's commit
    /// and the record's completion: the retry would order twice.
    AfterWrite,
    /// `answer`: the order committed with its record, the answer not sent.
    BeforeAnswer,
}

impl CrashPoint {
    /// The crash point the environment arms, if any.
    pub fn from_env() -> Result<Option<Self>, OrdersError> {
        match std::env::var("ORDERS_CRASH_AT").as_deref() {
            Err(_) => Ok(None),
            Ok("write") => Ok(Some(Self::AfterWrite)),
            Ok("answer") => Ok(Some(Self::BeforeAnswer)),
            Ok(other) => Err(format!(
                "ORDERS_CRASH_AT is {other:?}: expected \"write\" or \"answer\""
            )
            .into()),
        }
    }

    /// Dies at once, as `SIGKILL` would: nothing is flushed, nothing rolled
    /// back by the process.
    pub fn crash(self) -> ! {
        std::process::abort()
    }
}

impl Orders {
    /// Creates the table if missing (the application's own migration).
    pub async fn open(
        pool: SqlitePool,
        publishing: Option<Publishing>,
        crash: Option<CrashPoint>,
    ) -> Result<Self, OrdersError> {
        let mut connection = pool.get().await?;
        connection
            .batch_execute(
                "CREATE TABLE IF NOT EXISTS orders (
                    id       INTEGER PRIMARY KEY AUTOINCREMENT,
                    owner    TEXT    NOT NULL,
                    item     TEXT    NOT NULL,
                    quantity INTEGER NOT NULL
                )",
            )
            .await?;
        drop(connection);
        Ok(Self {
            pool,
            publishing,
            crash,
        })
    }

    /// Adds an order for `owner` in the request's transaction, and stages
    /// its `order.created` event there when the app publishes: both commit
    /// with the request's idempotency record, or neither does.
    pub async fn create(
        &self,
        transaction: &SqliteTransaction,
        owner: &Principal,
        order: NewOrder,
    ) -> Result<Order, SqliteTransactionError> {
        let owner = owner.0.clone();
        let publishing = self.publishing.clone();
        let crash = self.crash;
        transaction
            .write(move |connection| {
                // diesel's synchronous query methods: `write` runs on a
                // blocking thread.
                let insert = diesel::sql_query(
                    "INSERT INTO orders (owner, item, quantity) VALUES (?, ?, ?)
                     RETURNING id, item, quantity",
                )
                .bind::<Text, _>(owner)
                .bind::<Text, _>(order.item)
                .bind::<BigInt, _>(order.quantity);
                let order: Order = diesel::RunQueryDsl::get_result(insert, connection)?;
                if let Some(publishing) = &publishing {
                    publishing
                        .outbox
                        .stage_blocking(connection, &publishing.event(&order))?;
                }
                if crash == Some(CrashPoint::AfterWrite) {
                    CrashPoint::AfterWrite.crash();
                }
                Ok(order)
            })
            .await
    }

    /// Whether the app dies once an order's answer is ready (a crash test).
    pub fn crashes_before_answer(&self) -> bool {
        self.crash == Some(CrashPoint::BeforeAnswer)
    }

    /// The orders of `owner`, oldest first.
    pub async fn list(&self, owner: &Principal) -> Result<Vec<Order>, OrdersError> {
        let (pool, owner) = (self.pool.clone(), owner.0.clone());
        // As a task of its own: a SQLite query whose future is dropped midway
        // blocks the thread, which a current-thread runtime cannot afford.
        tokio::spawn(async move {
            let mut connection = pool.get().await?;
            let orders = diesel::sql_query(
                "SELECT id, item, quantity FROM orders WHERE owner = ? ORDER BY id",
            )
            .bind::<Text, _>(owner)
            .load::<Order>(&mut *connection)
            .await?;
            Ok(orders)
        })
        .await?
    }
}

impl Publishing {
    /// The `order.created` event of `order`: keyed by the order's id.
    fn event(&self, order: &Order) -> Event {
        let body = serde_json::json!({ "type": "order.created", "order": order });
        Event::new(
            self.destination.clone(),
            order.id.to_string(),
            body.to_string(),
        )
        .header("content-type", "application/json")
    }
}
