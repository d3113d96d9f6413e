//! The payments service: authentication, validation, the operations, and the
//! answers the frameworks send.

use std::time::Duration;

use idem_core::log::{bounded, error_chain};
use idem_core::{PROBLEM_CONTENT_TYPE, PROBLEM_TYPE_BASE, Scope};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::{
    AccountView, Attempt, Ledger, LedgerError, Operation, OperationKind, Provider, ProviderError,
};

/// The payments service behind both examples. Cheap to clone.
///
/// Each operation takes the request's [`Attempt`]: its key, recorded with the
/// operation, and in transactional mode the request's transaction, which the
/// ledger writes join.
///
/// ```
/// use std::time::Duration;
/// use payments::{Attempt, Ledger, Payments};
///
/// # tokio_test_block_on(async {
/// let payments = Payments::new(Ledger::memory(), Duration::ZERO);
/// let body = br#"{"amount": 250, "currency": "EUR"}"#;
/// let receipt = payments.charge("acct-1", body, &Attempt::unkeyed()).await?;
/// assert_eq!((receipt.amount, receipt.balance), (250, 250));
/// assert_eq!(payments.account("acct-1").await?.operations, 1);
/// # Ok::<(), payments::PaymentError>(())
/// # }).unwrap();
/// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(f)
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Payments {
    ledger: Ledger,
    provider: Provider,
}

/// The authenticated caller, named by the token of `Authorization: Bearer TOKEN`,
/// and the idempotency scope, so two callers never share keys.
///
/// It holds the [scope derived from the token](Self::from_token), never the
/// token itself: the scope is logged (target `idem`, at info level), and a
/// credential must not be.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Principal(String);

/// What the token's hash is taken over, before the token: a scope from this
/// service is never the bare hash of a token that another system may log.
const SCOPE_CONTEXT: &[u8] = b"payments scope v1\n";

/// How many hex digits of a SHA-256 name a scope or a forwarded key: 128 bits.
const HEX_DIGITS: usize = 32;

/// The first [`HEX_DIGITS`] hex digits of the SHA-256 of `parts`, concatenated.
pub(crate) fn hex_digest(parts: &[&[u8]]) -> String {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update(part);
    }
    let digest = hash.finalize();
    let mut hex = String::with_capacity(HEX_DIGITS);
    for byte in digest.iter().take(HEX_DIGITS / 2) {
        hex.push_str(&format!("{byte:02x}"));
    }
    hex
}

/// The body of a charge or a deposit.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperationRequest {
    /// A positive integer amount, in minor units.
    pub amount: i64,
    /// Three upper-case letters, e.g. `EUR`.
    pub currency: String,
}

/// The answer to a charge or a deposit (`201`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Receipt {
    /// The operation's id.
    pub id: Uuid,
    /// The account.
    pub account_id: String,
    /// The amount applied.
    pub amount: i64,
    /// Its currency.
    pub currency: String,
    /// The balance after it.
    pub balance: i64,
}

/// Why a request was refused. Each is a problem answer.
#[derive(Debug, thiserror::Error)]
pub enum PaymentError {
    /// No `Authorization: Bearer TOKEN`: `401 unauthorized`.
    #[error("an `Authorization: Bearer TOKEN` header is required")]
    Unauthorized,
    /// The body is not a valid operation: `400 invalid-request`.
    #[error("{0}")]
    InvalidRequest(String),
    /// The ledger refused the operation (`400 invalid-request`), or could not
    /// be reached (`503 ledger-unavailable`, with `Retry-After`; the idempotency
    /// layer stores no 5xx answer, so a retry runs the operation again, and in
    /// transactional mode the request's transaction is rolled back).
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// The payment provider did not accept the charge: `502 provider-failed`,
    /// with `Retry-After`; nothing was applied, and the idempotency layer
    /// stores no 5xx answer, so a retry calls the provider again.
    #[error(transparent)]
    Provider(#[from] ProviderError),
}

/// An answer as any framework sends it: status, content type, body, and a
/// `Retry-After` when the client should retry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The status code.
    pub status: u16,
    /// The `Content-Type`.
    pub content_type: &'static str,
    /// `Retry-After`, in seconds.
    pub retry_after: Option<u32>,
    /// The body.
    pub body: String,
}

impl Payments {
    /// The service over `ledger`, with the simulated provider, which takes
    /// `provider_latency` per charge.
    ///
    /// In transactional mode on PostgreSQL the provider's latency passes
    /// inside the request's transaction (the claim comes before the handler);
    /// on SQLite before it (the transaction opens at the ledger's write, after
    /// the provider has answered), so no write lock is held meanwhile.
    pub fn new(ledger: Ledger, provider_latency: Duration) -> Self {
        Self::with_provider(ledger, Provider::simulated(provider_latency))
    }

    /// The service over `ledger`, charging through `provider`.
    pub fn with_provider(ledger: Ledger, provider: Provider) -> Self {
        Self { ledger, provider }
    }

    /// The ledger.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// `POST /accounts/{account_id}/charges`: asks the [`Provider`], then
    /// adds the amount to the balance. A provider that does not accept the
    /// charge fails it before anything is applied.
    pub async fn charge(
        &self,
        account_id: &str,
        body: &[u8],
        attempt: &Attempt,
    ) -> Result<Receipt, PaymentError> {
        let request = OperationRequest::parse(body)?;
        if let Err(error) = self.provider.charge(account_id, &request, attempt).await {
            tracing::warn!(
                account_id = %bounded(account_id),
                error = %error_chain(&error),
                "the payment provider did not accept the charge; nothing was applied"
            );
            return Err(error.into());
        }
        self.apply(account_id, OperationKind::Charge, request, attempt)
            .await
    }

    /// `POST /accounts/{account_id}/deposits`: adds the amount to the balance.
    pub async fn deposit(
        &self,
        account_id: &str,
        body: &[u8],
        attempt: &Attempt,
    ) -> Result<Receipt, PaymentError> {
        let request = OperationRequest::parse(body)?;
        self.apply(account_id, OperationKind::Deposit, request, attempt)
            .await
    }

    /// `GET /accounts/{account_id}`.
    pub async fn account(&self, account_id: &str) -> Result<AccountView, PaymentError> {
        self.ledger.account(account_id).await.map_err(|error| {
            log_failure(&error, account_id);
            error.into()
        })
    }

    async fn apply(
        &self,
        account_id: &str,
        kind: OperationKind,
        request: OperationRequest,
        attempt: &Attempt,
    ) -> Result<Receipt, PaymentError> {
        let operation = Operation::new(kind, account_id, request.amount, request.currency);
        let applied = match self.ledger.apply(&operation, attempt).await {
            Ok(applied) => applied,
            Err(error) => {
                log_failure(&error, account_id);
                return Err(error.into());
            }
        };
        tracing::info!(
            account_id = %bounded(account_id),
            ?kind,
            amount = operation.amount,
            balance = applied.balance,
            keyed = attempt.key().is_some(),
            transactional = attempt.is_transactional(),
            "applied"
        );
        Ok(Receipt {
            id: applied.id,
            account_id: operation.account_id,
            amount: operation.amount,
            currency: operation.currency,
            balance: applied.balance,
        })
    }
}

/// The log keeps what the client is not told: the cause, with its sources.
fn log_failure(error: &LedgerError, account_id: &str) {
    if let LedgerError::Unavailable(_) = error {
        tracing::error!(account_id = %bounded(account_id), error = %error_chain(error), "the ledger failed; nothing was applied");
    }
}

impl Principal {
    /// The principal of an `Authorization` header value.
    ///
    /// ```
    /// use payments::{PaymentError, Principal};
    ///
    /// let alice = Principal::from_authorization(Some(b"Bearer alice"))?;
    /// assert_eq!(alice, Principal::from_token("alice"));
    /// // The scheme is case-insensitive (RFC 9110 §11.1).
    /// assert_eq!(Principal::from_authorization(Some(b"bearer alice"))?, alice);
    /// assert_eq!(Principal::from_authorization(Some(b"BEARER alice"))?, alice);
    /// assert!(matches!(Principal::from_authorization(None), Err(PaymentError::Unauthorized)));
    /// assert!(matches!(
    ///     Principal::from_authorization(Some(b"Basic YTpi")),
    ///     Err(PaymentError::Unauthorized)
    /// ));
    /// # Ok::<(), PaymentError>(())
    /// ```
    pub fn from_authorization(value: Option<&[u8]>) -> Result<Self, PaymentError> {
        let token = value
            .and_then(bearer_token)
            .and_then(|token| std::str::from_utf8(token).ok())
            .map(str::trim)
            .filter(|token| !token.is_empty())
            .ok_or(PaymentError::Unauthorized)?;
        Ok(Self::from_token(token))
    }

    /// The principal named by `token`: its scope is the first 32 hex digits
    /// (128 bits) of the SHA-256 of the token, after a context string. The same
    /// token always gives the same scope, two tokens practically never do, and
    /// the scope does not give the token back.
    ///
    /// ```
    /// use payments::Principal;
    ///
    /// let alice = Principal::from_token("alice");
    /// assert_eq!(alice.as_str().len(), 32);
    /// assert!(!alice.as_str().contains("alice"));
    /// assert_eq!(alice, Principal::from_token("alice"));
    /// assert_ne!(alice, Principal::from_token("bob"));
    /// ```
    pub fn from_token(token: &str) -> Self {
        Self(hex_digest(&[SCOPE_CONTEXT, token.as_bytes()]))
    }

    /// The scope's name: the hex digits of the token's hash.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<Principal> for Scope {
    fn from(principal: Principal) -> Self {
        Scope::new(principal.0)
    }
}

impl OperationRequest {
    /// Parses and validates a body: `{"amount": INT > 0, "currency": "ABC"}`.
    ///
    /// ```
    /// use payments::OperationRequest;
    ///
    /// assert!(OperationRequest::parse(br#"{"amount": 5, "currency": "USD"}"#).is_ok());
    /// assert!(OperationRequest::parse(br#"{"amount": 0, "currency": "USD"}"#).is_err());
    /// assert!(OperationRequest::parse(br#"{"amount": 5, "currency": "usd"}"#).is_err());
    /// ```
    pub fn parse(body: &[u8]) -> Result<Self, PaymentError> {
        let request: Self = serde_json::from_slice(body).map_err(|error| {
            PaymentError::InvalidRequest(format!(
                "the body must be {{\"amount\": INT > 0, \"currency\": \"ABC\"}}: {error}"
            ))
        })?;
        if request.amount <= 0 {
            return Err(PaymentError::InvalidRequest(format!(
                "amount must be a positive integer, not {}",
                request.amount
            )));
        }
        let currency = request.currency.as_bytes();
        if currency.len() != 3 || !currency.iter().all(u8::is_ascii_uppercase) {
            return Err(PaymentError::InvalidRequest(format!(
                "currency must be three upper-case letters, not {:?}",
                request.currency
            )));
        }
        Ok(request)
    }
}

impl PaymentError {
    /// The status code.
    pub fn status(&self) -> u16 {
        match self {
            Self::Unauthorized => 401,
            Self::InvalidRequest(_) | Self::Ledger(LedgerError::Overflow { .. }) => 400,
            Self::Ledger(LedgerError::Unavailable(_)) => 503,
            Self::Provider(_) => 502,
        }
    }

    /// The slug of the problem `type`.
    pub fn slug(&self) -> &'static str {
        match self {
            Self::Unauthorized => "unauthorized",
            Self::InvalidRequest(_) | Self::Ledger(LedgerError::Overflow { .. }) => {
                "invalid-request"
            }
            Self::Ledger(LedgerError::Unavailable(_)) => "ledger-unavailable",
            Self::Provider(_) => "provider-failed",
        }
    }

    /// The RFC 9457 problem answer.
    ///
    /// ```
    /// let answer = payments::PaymentError::Unauthorized.answer();
    /// assert_eq!((answer.status, answer.content_type), (401, "application/problem+json"));
    /// ```
    ///
    /// A ledger that failed is `503` with `Retry-After: 1`, and its detail
    /// names no cause (the log has it):
    ///
    /// ```
    /// use payments::{LedgerError, PaymentError};
    ///
    /// let error = PaymentError::from(LedgerError::Unavailable("connection refused".into()));
    /// let answer = error.answer();
    /// assert_eq!((answer.status, answer.retry_after), (503, Some(1)));
    /// assert!(!answer.body.contains("refused"));
    /// ```
    pub fn answer(&self) -> Answer {
        let (title, detail, retry_after) = match self {
            Self::Unauthorized => ("Authentication required", self.to_string(), None),
            Self::InvalidRequest(_) | Self::Ledger(LedgerError::Overflow { .. }) => {
                ("Invalid request", self.to_string(), None)
            }
            Self::Ledger(LedgerError::Unavailable(_)) => (
                "Ledger unavailable",
                "the ledger is unavailable; the request was not applied, retry later".to_owned(),
                Some(1),
            ),
            Self::Provider(_) => (
                "Payment provider failed",
                "the payment provider did not accept the charge; nothing was applied, retry later"
                    .to_owned(),
                Some(1),
            ),
        };
        let body = serde_json::json!({
            "type": format!("{PROBLEM_TYPE_BASE}{}", self.slug()),
            "title": title,
            "status": self.status(),
            "detail": detail,
        });
        Answer {
            status: self.status(),
            content_type: PROBLEM_CONTENT_TYPE,
            retry_after,
            body: body.to_string(),
        }
    }
}

impl Answer {
    /// A JSON answer.
    pub fn json(status: u16, value: &impl Serialize) -> Self {
        Self {
            status,
            content_type: "application/json",
            retry_after: None,
            // Serializing these plain structs cannot fail.
            body: serde_json::to_string(value).unwrap_or_default(),
        }
    }
}

/// `201` with the receipt, or the problem.
impl From<Result<Receipt, PaymentError>> for Answer {
    fn from(result: Result<Receipt, PaymentError>) -> Self {
        match result {
            Ok(receipt) => Self::json(201, &receipt),
            Err(error) => error.answer(),
        }
    }
}

/// `200` with the account, or the problem.
impl From<Result<AccountView, PaymentError>> for Answer {
    fn from(result: Result<AccountView, PaymentError>) -> Self {
        match result {
            Ok(account) => Self::json(200, &account),
            Err(error) => error.answer(),
        }
    }
}

/// The token of an `Authorization` value whose scheme is `Bearer`, in any
/// case (RFC 9110 §11.1: the scheme is case-insensitive), before the token
/// is trimmed.
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, token) = value.split_at_checked(7)?;
    scheme.eq_ignore_ascii_case(b"Bearer ").then_some(token)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use idem_core::IdempotencyKey;
    use idem_diesel::SqliteStore;
    use idem_testkit::TempDir;

    use super::*;

    /// A fresh directory for a SQLite file, removed when dropped.
    fn sqlite_dir() -> TempDir {
        TempDir::new("payments-ledger").unwrap()
    }

    /// `sqlite://` and the database file in `dir`.
    fn sqlite_url(dir: &TempDir) -> String {
        format!("sqlite://{}", dir.file("payments.db"))
    }

    /// The ledger in `dir`'s file, as `--store sqlite://…` opens it.
    async fn sqlite_ledger(dir: &TempDir) -> Ledger {
        sqlite_store_and_ledger(dir).await.1
    }

    /// The store and the ledger in `dir`'s file.
    async fn sqlite_store_and_ledger(dir: &TempDir) -> (SqliteStore, Ledger) {
        let store = SqliteStore::connect(&sqlite_url(dir)).await.unwrap();
        store.migrate().await.unwrap();
        let ledger = Ledger::sqlite(store.pool().clone());
        ledger.migrate().await.unwrap();
        (store, ledger)
    }

    async fn every_charge_applies_its_amount(ledger: Ledger) {
        let payments = Payments::new(ledger, Duration::ZERO);
        let body = br#"{"amount": 100, "currency": "EUR"}"#;
        let keyed = Attempt::keyed(Scope::new("alice"), IdempotencyKey::new("k-1").unwrap());
        let first = payments.charge("a1", body, &keyed).await.unwrap();
        let second = payments
            .deposit("a1", body, &Attempt::unkeyed())
            .await
            .unwrap();
        assert_ne!(first.id, second.id);
        assert_eq!((first.balance, second.balance), (100, 200));
        assert_eq!(
            payments.account("a1").await.unwrap(),
            AccountView {
                account_id: "a1".into(),
                balance: 200,
                operations: 2
            }
        );
        assert_eq!(payments.account("unknown").await.unwrap().operations, 0);
    }

    #[tokio::test]
    async fn every_charge_applies_its_amount_in_memory() {
        every_charge_applies_its_amount(Ledger::memory()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_charge_applies_its_amount_on_sqlite() {
        let dir = sqlite_dir();
        every_charge_applies_its_amount(sqlite_ledger(&dir).await).await;
    }

    /// In transactional mode on SQLite, a keyed charge is written in the
    /// request's transaction: nothing of it is visible until the record
    /// completes with it, and a release rolls it back, so the retry applies
    /// it once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_keyed_charge_commits_with_its_record_on_sqlite() {
        use idem_core::{Begin, Engine, Fingerprint, Settlement, StoredResponse};

        let dir = sqlite_dir();
        let (store, ledger) = sqlite_store_and_ledger(&dir).await;
        let payments = Payments::new(ledger, Duration::ZERO);
        let engine = Engine::new(store.transactional(), idem_core::Policy::required());
        let body = br#"{"amount": 100, "currency": "EUR"}"#;
        let begin = || {
            engine.begin(
                Scope::new("alice"),
                IdempotencyKey::new("k-1").unwrap(),
                Fingerprint::from_bytes([1; 32]),
            )
        };
        let attempt_of = |execution: &idem_core::Execution| {
            let transaction = std::sync::Arc::clone(execution.context().unwrap())
                .downcast::<idem_diesel::SqliteTransaction>()
                .unwrap();
            Attempt::keyed(Scope::new("alice"), IdempotencyKey::new("k-1").unwrap())
                .within_sqlite(transaction)
        };

        // Released (the handler failed after its write): rolled back.
        let Begin::Execute(execution) = begin().await else {
            panic!("a new key runs")
        };
        payments
            .charge("a1", body, &attempt_of(&execution))
            .await
            .unwrap();
        assert_eq!(payments.account("a1").await.unwrap().operations, 0);
        execution.release().await;
        assert_eq!(payments.account("a1").await.unwrap().balance, 0);

        // The retry runs, and commits with its record.
        let Begin::Execute(execution) = begin().await else {
            panic!("the released key runs again")
        };
        let receipt = payments
            .charge("a1", body, &attempt_of(&execution))
            .await
            .unwrap();
        assert_eq!(receipt.balance, 100);
        let settled = execution
            .settle(&StoredResponse::new(201, vec![], "charged"))
            .await;
        assert!(matches!(settled, Settlement::Deliver));
        assert_eq!(
            payments.account("a1").await.unwrap(),
            AccountView {
                account_id: "a1".into(),
                balance: 100,
                operations: 1
            }
        );
        assert!(matches!(begin().await, Begin::Replay(_)));
    }

    #[tokio::test]
    async fn invalid_bodies_are_400_problems_and_apply_nothing() {
        let payments = Payments::new(Ledger::memory(), Duration::ZERO);
        for body in [
            &br#"{"amount": -1, "currency": "EUR"}"#[..],
            br#"{"amount": 1.5, "currency": "EUR"}"#,
            br#"{"amount": 1, "currency": "EURO"}"#,
            br#"{"amount": 1, "currency": "E1R"}"#,
            br#"{"amount": 1}"#,
            br#"{"amount": 1, "currency": "EUR", "extra": true}"#,
            b"not json",
        ] {
            let error = payments
                .charge("a1", body, &Attempt::unkeyed())
                .await
                .unwrap_err();
            let answer = error.answer();
            assert_eq!(answer.status, 400);
            let json: serde_json::Value = serde_json::from_str(&answer.body).unwrap();
            assert_eq!(json["type"], "https://idem.rs/problems/invalid-request");
            assert_eq!(json["status"], 400);
        }
        assert_eq!(payments.account("a1").await.unwrap().operations, 0);
    }

    async fn an_overflowing_balance_is_refused(ledger: Ledger) {
        let payments = Payments::new(ledger, Duration::ZERO);
        let max = format!(r#"{{"amount": {}, "currency": "EUR"}}"#, i64::MAX);
        let one = br#"{"amount": 1, "currency": "EUR"}"#;
        let unkeyed = Attempt::unkeyed();
        payments.deposit("a1", one, &unkeyed).await.unwrap();
        let error = payments
            .deposit("a1", max.as_bytes(), &unkeyed)
            .await
            .unwrap_err();
        assert_eq!(error.status(), 400);
        assert_eq!(
            error.to_string(),
            "the balance of a1 would overflow",
            "{error:?}"
        );
        // Nothing of the refused operation was applied.
        assert_eq!(
            payments.account("a1").await.unwrap(),
            AccountView {
                account_id: "a1".into(),
                balance: 1,
                operations: 1
            }
        );
        // Up to the limit exactly.
        let rest = format!(r#"{{"amount": {}, "currency": "EUR"}}"#, i64::MAX - 1);
        let receipt = payments
            .deposit("a1", rest.as_bytes(), &unkeyed)
            .await
            .unwrap();
        assert_eq!(receipt.balance, i64::MAX);
        assert_eq!(
            payments
                .deposit("a1", one, &unkeyed)
                .await
                .unwrap_err()
                .status(),
            400
        );
        assert_eq!(payments.account("a1").await.unwrap().operations, 2);
    }

    #[tokio::test]
    async fn an_overflowing_balance_is_refused_in_memory() {
        an_overflowing_balance_is_refused(Ledger::memory()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_overflowing_balance_is_refused_on_sqlite() {
        let dir = sqlite_dir();
        an_overflowing_balance_is_refused(sqlite_ledger(&dir).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_sqlite_ledger_survives_a_reopen_and_records_each_key() {
        let dir = sqlite_dir();
        let body = br#"{"amount": 70, "currency": "EUR"}"#;
        let keyed = Attempt::keyed(Scope::new("alice"), IdempotencyKey::new("k-9").unwrap());
        let receipt = {
            let payments = Payments::new(sqlite_ledger(&dir).await, Duration::ZERO);
            payments.charge("a1", body, &keyed).await.unwrap()
        };
        // A second start-up migrates again: nothing is lost.
        let ledger = sqlite_ledger(&dir).await;
        let payments = Payments::new(ledger, Duration::ZERO);
        payments
            .deposit("a1", body, &Attempt::unkeyed())
            .await
            .unwrap();
        assert_eq!(
            payments.account("a1").await.unwrap(),
            AccountView {
                account_id: "a1".into(),
                balance: 140,
                operations: 2
            }
        );
        let store = SqliteStore::connect(&sqlite_url(&dir)).await.unwrap();
        let mut connection = store.pool().get().await.unwrap();
        let rows: Vec<OperationRow> = connection
            .spawn_blocking(|c| {
                use diesel::RunQueryDsl;
                diesel::sql_query(
                    "SELECT id, kind, amount, idempotency_scope, idempotency_key \
                     FROM payment_operations ORDER BY created_at, kind",
                )
                .load(c)
            })
            .await
            .unwrap();
        assert_eq!(
            rows,
            [
                OperationRow {
                    id: receipt.id.to_string(),
                    kind: "charge".into(),
                    amount: 70,
                    idempotency_scope: Some("alice".into()),
                    idempotency_key: Some("k-9".into()),
                },
                OperationRow {
                    id: rows[1].id.clone(),
                    kind: "deposit".into(),
                    amount: 70,
                    idempotency_scope: None,
                    idempotency_key: None,
                },
            ]
        );
    }

    #[derive(Debug, PartialEq, Eq, diesel::QueryableByName)]
    struct OperationRow {
        #[diesel(sql_type = diesel::sql_types::Text)]
        id: String,
        #[diesel(sql_type = diesel::sql_types::Text)]
        kind: String,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        amount: i64,
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
        idempotency_scope: Option<String>,
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
        idempotency_key: Option<String>,
    }

    #[tokio::test(start_paused = true)]
    async fn a_charge_waits_for_the_provider() {
        let payments = Payments::new(Ledger::memory(), Duration::from_secs(2));
        let started = tokio::time::Instant::now();
        payments
            .charge(
                "a1",
                br#"{"amount": 1, "currency": "EUR"}"#,
                &Attempt::unkeyed(),
            )
            .await
            .unwrap();
        assert!(started.elapsed() >= Duration::from_secs(2));
    }
}
