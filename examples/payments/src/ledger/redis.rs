//! The ledger in Redis, next to the Redis store's records (`--store redis://…`,
//! `--store redis+cluster://…`).
//!
//! An account is three keys sharing its hash tag, so one script applies an
//! operation atomically even on a Redis Cluster:
//!
//! - `payments:{account:LEN:ID}`: a hash, `balance` and `operations`;
//! - `payments:{account:LEN:ID}:operations`: a list of the operations applied,
//!   as JSON, oldest first;
//! - `payments:{account:LEN:ID}:key:LEN:SCOPE:KEY`: for a keyed request, which
//!   operation its key applied, kept as long as idempotency records are.
//!
//! (`LEN` is the length of what follows in bytes, so no account's or key's
//! name can spell another key.)
//!
//! The last one is what Redis allows instead of transactional mode. The
//! idempotency record lives in another slot (its own hash tag), so the ledger's
//! write and the record's completion cannot be one atomic step. A process that
//! dies between the two leaves the key in progress; once its lease lapses, the
//! retry runs the handler again, and the ledger answers the operation the key
//! already applied instead of applying it a second time: one effect, and the
//! same receipt. What this does not cover is a Redis failover that loses
//! acknowledged writes (see idem-redis's docs): the operation and its marker
//! are lost together, and the retry applies the charge again, once.

use std::sync::LazyLock;
use std::time::Duration;

use idem_redis::RedisConnection;
use redis::Script;
use uuid::Uuid;

use super::{Applied, Attempt, LedgerError, Operation};

/// The ledger's keys start with this.
const PREFIX: &str = "payments:";

static APPLY: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("redis.lua")));

/// The connection and how long keys' markers live.
#[derive(Clone)]
pub(super) struct RedisLedger {
    connection: RedisConnection,
    retention: Duration,
}

/// An operation as the operations list keeps it (`balance_after` is appended
/// by the script).
#[derive(serde::Serialize)]
struct Entry<'a> {
    id: Uuid,
    kind: &'static str,
    amount: i64,
    currency: &'a str,
    idempotency_scope: Option<&'a str>,
    idempotency_key: Option<&'a str>,
}

impl RedisLedger {
    pub(super) fn new(connection: RedisConnection, retention: Duration) -> Self {
        Self {
            connection,
            retention,
        }
    }

    pub(super) async fn apply(
        &self,
        id: Uuid,
        operation: &Operation,
        attempt: &Attempt,
    ) -> Result<Applied, LedgerError> {
        let account = account_key(&operation.account_id);
        let (scope, key) = attempt.recorded_key();
        let entry = Entry {
            id,
            kind: operation.kind.as_str(),
            amount: operation.amount,
            currency: &operation.currency,
            idempotency_scope: scope,
            idempotency_key: key,
        };
        let mut json = serde_json::to_string(&entry).map_err(LedgerError::unavailable)?;
        // `{…}` → `{…,"balance_after":`; the script appends the balance and `}`.
        json.pop();
        json.push_str(",\"balance_after\":");
        let marker = match (scope, key) {
            (Some(scope), Some(key)) => format!("{account}:key:{}:{scope}:{key}", scope.len()),
            _ => format!("{account}:key:"),
        };
        let mut connection = self.connection.clone();
        let reply: Vec<String> = APPLY
            .key(account.as_str())
            .key(format!("{account}:operations"))
            .key(marker)
            .arg(operation.amount)
            .arg(id.to_string())
            .arg(if scope.is_some() { "1" } else { "0" })
            .arg(
                u64::try_from(self.retention.as_millis())
                    .unwrap_or(u64::MAX)
                    .max(1),
            )
            .arg(json)
            .invoke_async(&mut connection)
            .await
            .map_err(LedgerError::unavailable)?;
        match reply.as_slice() {
            [outcome, applied] if outcome == "applied" || outcome == "earlier" => {
                parse_applied(applied).ok_or_else(|| {
                    LedgerError::unavailable(format!("the ledger answered {applied:?}"))
                })
            }
            [overflow] if overflow == "overflow" => Err(LedgerError::Overflow {
                account_id: operation.account_id.clone(),
            }),
            other => Err(LedgerError::unavailable(format!(
                "the ledger answered {other:?}"
            ))),
        }
    }

    /// The balance and the operation count; `(0, 0)` for an unknown account.
    pub(super) async fn account(&self, account_id: &str) -> Result<(i64, u64), LedgerError> {
        let mut connection = self.connection.clone();
        let (balance, operations): (Option<i64>, Option<u64>) = redis::cmd("HMGET")
            .arg(account_key(account_id))
            .arg("balance")
            .arg("operations")
            .query_async(&mut connection)
            .await
            .map_err(LedgerError::unavailable)?;
        Ok((balance.unwrap_or(0), operations.unwrap_or(0)))
    }
}

/// `payments:{account:LEN:ID}`.
fn account_key(account_id: &str) -> String {
    format!("{PREFIX}{{account:{}:{account_id}}}", account_id.len())
}

/// `"ID BALANCE"`.
fn parse_applied(applied: &str) -> Option<Applied> {
    let (id, balance) = applied.split_once(' ')?;
    Some(Applied {
        id: Uuid::parse_str(id).ok()?,
        balance: balance.parse().ok()?,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use idem_core::{IdempotencyKey, Scope};
    use idem_testkit::TestRedis;

    use super::*;
    use crate::{Ledger, LedgerError, OperationKind};

    async fn ledger() -> Ledger {
        let redis = TestRedis::shared();
        let store = idem_redis::RedisStore::builder()
            .prefix(redis.fresh_prefix())
            .connect(&redis.url())
            .await
            .unwrap();
        Ledger::redis(store.connection(), Duration::from_secs(60))
    }

    #[tokio::test]
    async fn a_keys_operation_is_applied_once_and_answered_again() {
        let ledger = ledger().await;
        let account = format!("acct-{}", Uuid::new_v4());
        let charge = Operation::new(OperationKind::Charge, &account, 25, "EUR");
        let keyed = Attempt::keyed(Scope::new("alice"), IdempotencyKey::new("k-1").unwrap());
        let first = ledger.apply(&charge, &keyed).await.unwrap();
        let again = ledger.apply(&charge, &keyed).await.unwrap();
        assert_eq!(again, first, "the key's operation, not a second one");
        let other_scope = Attempt::keyed(Scope::new("bob"), IdempotencyKey::new("k-1").unwrap());
        let bobs = ledger.apply(&charge, &other_scope).await.unwrap();
        assert_ne!(bobs.id, first.id);
        for _ in 0..2 {
            ledger.apply(&charge, &Attempt::unkeyed()).await.unwrap();
        }
        let view = ledger.account(&account).await.unwrap();
        assert_eq!((view.balance, view.operations), (100, 4));
    }

    #[tokio::test]
    async fn an_overflowing_balance_is_refused_and_applies_nothing() {
        let ledger = ledger().await;
        let account = format!("acct-{}", Uuid::new_v4());
        let huge = Operation::new(OperationKind::Deposit, &account, i64::MAX, "EUR");
        ledger.apply(&huge, &Attempt::unkeyed()).await.unwrap();
        let one = Operation::new(OperationKind::Deposit, &account, 1, "EUR");
        assert!(matches!(
            ledger.apply(&one, &Attempt::unkeyed()).await,
            Err(LedgerError::Overflow { .. })
        ));
        let view = ledger.account(&account).await.unwrap();
        assert_eq!((view.balance, view.operations), (i64::MAX, 1));
        assert_eq!(ledger.account("unknown").await.unwrap().operations, 0);
    }

    #[test]
    fn account_keys_cannot_spell_each_other() {
        assert_eq!(account_key("a}b"), "payments:{account:3:a}b}");
        assert_ne!(
            format!("{}:operations", account_key("x")),
            account_key("x}:operations")
        );
    }
}
