//! The payments service: authentication, validation, the operations, and the
//! answers the frameworks send.

use std::time::Duration;

use idem_core::{PROBLEM_CONTENT_TYPE, PROBLEM_TYPE_BASE, Policy, Scope};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{AccountView, Ledger, LedgerError, OperationKind};

/// The payments service behind both examples. Cheap to clone.
///
/// ```
/// use std::time::Duration;
/// use payments::{Ledger, Payments};
///
/// # tokio_test_block_on(async {
/// let payments = Payments::new(Ledger::new(), Duration::ZERO);
/// let receipt = payments.charge("acct-1", br#"{"amount": 250, "currency": "EUR"}"#).await?;
/// assert_eq!((receipt.amount, receipt.balance), (250, 250));
/// assert_eq!(payments.account("acct-1").operations, 1);
/// # Ok::<(), payments::PaymentError>(())
/// # }).unwrap();
/// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(f)
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Payments {
    ledger: Ledger,
    provider_latency: Duration,
}

/// The authenticated caller: the token of `Authorization: Bearer TOKEN`. It is
/// the idempotency scope, so two callers never share keys.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Principal(String);

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
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PaymentError {
    /// No `Authorization: Bearer TOKEN`: `401 unauthorized`.
    #[error("an `Authorization: Bearer TOKEN` header is required")]
    Unauthorized,
    /// The body is not a valid operation: `400 invalid-request`.
    #[error("{0}")]
    InvalidRequest(String),
    /// The ledger refused the operation: `400 invalid-request`.
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

/// An answer as any framework sends it: status, content type, body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The status code.
    pub status: u16,
    /// The `Content-Type`.
    pub content_type: &'static str,
    /// The body.
    pub body: String,
}

/// The idempotency policy of `POST /accounts/{account_id}/charges`: key required.
pub fn charge_policy() -> Policy {
    Policy::required()
}

/// The idempotency policy of `POST /accounts/{account_id}/deposits`: key optional.
pub fn deposit_policy() -> Policy {
    Policy::optional()
}

impl Payments {
    /// The service over `ledger`, with a provider that takes `provider_latency`
    /// per charge.
    pub fn new(ledger: Ledger, provider_latency: Duration) -> Self {
        Self {
            ledger,
            provider_latency,
        }
    }

    /// The ledger.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// `POST /accounts/{account_id}/charges`: asks the provider (which takes the
    /// configured latency), then adds the amount to the balance.
    pub async fn charge(&self, account_id: &str, body: &[u8]) -> Result<Receipt, PaymentError> {
        let request = OperationRequest::parse(body)?;
        tokio::time::sleep(self.provider_latency).await;
        self.apply(account_id, OperationKind::Charge, request)
    }

    /// `POST /accounts/{account_id}/deposits`: adds the amount to the balance.
    pub async fn deposit(&self, account_id: &str, body: &[u8]) -> Result<Receipt, PaymentError> {
        let request = OperationRequest::parse(body)?;
        self.apply(account_id, OperationKind::Deposit, request)
    }

    /// `GET /accounts/{account_id}`.
    pub fn account(&self, account_id: &str) -> AccountView {
        self.ledger.account(account_id)
    }

    fn apply(
        &self,
        account_id: &str,
        kind: OperationKind,
        request: OperationRequest,
    ) -> Result<Receipt, PaymentError> {
        let applied = self.ledger.apply(account_id, kind, request.amount)?;
        tracing::info!(
            account_id,
            ?kind,
            amount = request.amount,
            balance = applied.balance,
            "applied"
        );
        Ok(Receipt {
            id: applied.id,
            account_id: account_id.to_owned(),
            amount: request.amount,
            currency: request.currency,
            balance: applied.balance,
        })
    }
}

impl Principal {
    /// The principal of an `Authorization` header value.
    ///
    /// ```
    /// use payments::{PaymentError, Principal};
    ///
    /// assert_eq!(Principal::from_authorization(Some(b"Bearer alice"))?.as_str(), "alice");
    /// assert_eq!(Principal::from_authorization(None), Err(PaymentError::Unauthorized));
    /// assert_eq!(Principal::from_authorization(Some(b"Basic YTpi")), Err(PaymentError::Unauthorized));
    /// # Ok::<(), PaymentError>(())
    /// ```
    pub fn from_authorization(value: Option<&[u8]>) -> Result<Self, PaymentError> {
        let token = value
            .and_then(|value| value.strip_prefix(b"Bearer "))
            .and_then(|token| std::str::from_utf8(token).ok())
            .map(str::trim)
            .filter(|token| !token.is_empty())
            .ok_or(PaymentError::Unauthorized)?;
        Ok(Self(token.to_owned()))
    }

    /// The token.
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
            Self::InvalidRequest(_) | Self::Ledger(_) => 400,
        }
    }

    /// The slug of the problem `type`.
    pub fn slug(&self) -> &'static str {
        match self {
            Self::Unauthorized => "unauthorized",
            Self::InvalidRequest(_) | Self::Ledger(_) => "invalid-request",
        }
    }

    /// The RFC 9457 problem answer.
    ///
    /// ```
    /// let answer = payments::PaymentError::Unauthorized.answer();
    /// assert_eq!((answer.status, answer.content_type), (401, "application/problem+json"));
    /// ```
    pub fn answer(&self) -> Answer {
        let title = match self {
            Self::Unauthorized => "Authentication required",
            Self::InvalidRequest(_) | Self::Ledger(_) => "Invalid request",
        };
        let body = serde_json::json!({
            "type": format!("{PROBLEM_TYPE_BASE}{}", self.slug()),
            "title": title,
            "status": self.status(),
            "detail": self.to_string(),
        });
        Answer {
            status: self.status(),
            content_type: PROBLEM_CONTENT_TYPE,
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

/// `200` with the account.
impl From<AccountView> for Answer {
    fn from(account: AccountView) -> Self {
        Self::json(200, &account)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[tokio::test]
    async fn every_charge_applies_its_amount() {
        let payments = Payments::new(Ledger::new(), Duration::ZERO);
        let body = br#"{"amount": 100, "currency": "EUR"}"#;
        let first = payments.charge("a1", body).await.unwrap();
        let second = payments.deposit("a1", body).await.unwrap();
        assert_ne!(first.id, second.id);
        assert_eq!((first.balance, second.balance), (100, 200));
        assert_eq!(
            payments.account("a1"),
            AccountView {
                account_id: "a1".into(),
                balance: 200,
                operations: 2
            }
        );
        assert_eq!(payments.account("unknown").operations, 0);
    }

    #[tokio::test]
    async fn invalid_bodies_are_400_problems_and_apply_nothing() {
        let payments = Payments::new(Ledger::new(), Duration::ZERO);
        for body in [
            &br#"{"amount": -1, "currency": "EUR"}"#[..],
            br#"{"amount": 1.5, "currency": "EUR"}"#,
            br#"{"amount": 1, "currency": "EURO"}"#,
            br#"{"amount": 1, "currency": "E1R"}"#,
            br#"{"amount": 1}"#,
            br#"{"amount": 1, "currency": "EUR", "extra": true}"#,
            b"not json",
        ] {
            let error = payments.charge("a1", body).await.unwrap_err();
            let answer = error.answer();
            assert_eq!(answer.status, 400);
            let json: serde_json::Value = serde_json::from_str(&answer.body).unwrap();
            assert_eq!(json["type"], "https://idem.rs/problems/invalid-request");
            assert_eq!(json["status"], 400);
        }
        assert_eq!(payments.account("a1").operations, 0);
    }

    #[tokio::test]
    async fn an_overflowing_balance_is_refused() {
        let payments = Payments::new(Ledger::new(), Duration::ZERO);
        let max = format!(r#"{{"amount": {}, "currency": "EUR"}}"#, i64::MAX);
        payments.deposit("a1", max.as_bytes()).await.unwrap();
        let error = payments
            .deposit("a1", br#"{"amount": 1, "currency": "EUR"}"#)
            .await
            .unwrap_err();
        assert_eq!(error.status(), 400);
        assert_eq!(payments.account("a1").balance, i64::MAX);
    }

    #[tokio::test(start_paused = true)]
    async fn a_charge_waits_for_the_provider() {
        let payments = Payments::new(Ledger::new(), Duration::from_secs(2));
        let started = tokio::time::Instant::now();
        payments
            .charge("a1", br#"{"amount": 1, "currency": "EUR"}"#)
            .await
            .unwrap();
        assert!(started.elapsed() >= Duration::from_secs(2));
    }
}
