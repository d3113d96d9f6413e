//! What the orders API is without its web framework (orders-actix includes
//! this file too): the caller's principal, the problem answers' body, and the
//! application's own data: orders, in the same SQLite file as the idempotency
//! records, through the store's pool.
//!
//! Same file, same durability: after a restart, a replayed answer names an
//! order that still exists. (Orders kept in memory beside a SQLite store would
//! be lost on restart while their records replay.)

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Text};
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use idem::Scope;
use idem::diesel::SqlitePool;
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

/// The orders table, on the idempotency store's pool.
#[derive(Clone)]
pub struct Orders {
    pool: SqlitePool,
}

impl Orders {
    /// Creates the table if missing (the application's own migration).
    pub async fn open(pool: SqlitePool) -> Result<Self, OrdersError> {
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
        Ok(Self { pool })
    }

    /// Adds an order for `owner`.
    pub async fn create(&self, owner: &Principal, order: NewOrder) -> Result<Order, OrdersError> {
        let (pool, owner) = (self.pool.clone(), owner.0.clone());
        // As a task of its own: a SQLite query whose future is dropped midway
        // blocks the thread, which a current-thread runtime cannot afford.
        tokio::spawn(async move {
            let mut connection = pool.get().await?;
            let order = diesel::sql_query(
                "INSERT INTO orders (owner, item, quantity) VALUES (?, ?, ?)
                 RETURNING id, item, quantity",
            )
            .bind::<Text, _>(owner)
            .bind::<Text, _>(order.item)
            .bind::<BigInt, _>(order.quantity)
            .get_result::<Order>(&mut *connection)
            .await?;
            Ok(order)
        })
        .await?
    }

    /// The orders of `owner`, oldest first.
    pub async fn list(&self, owner: &Principal) -> Result<Vec<Order>, OrdersError> {
        let (pool, owner) = (self.pool.clone(), owner.0.clone());
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
