//! A payment message's body, and why a body is not one.

use serde::{Deserialize, Serialize};

/// The longest account id, in bytes. A longer one can never be applied (a
/// PostgreSQL index row holds about 2,700 bytes; a log line shows at most 128
/// of a field), so it is refused as the message's own fault, at once, on
/// every database alike.
pub const MAX_ACCOUNT_ID_LEN: usize = 255;

/// The body of a message: add `amount` to the account's balance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Payment {
    /// The account, 1 to [`MAX_ACCOUNT_ID_LEN`] bytes.
    pub account_id: String,
    /// The amount to add: a positive integer.
    pub amount: i64,
}

/// Why a body is not a payment: a permanent error, so the message goes to
/// the dead-letter queue at once. Its text is the dead letter's reason and
/// is logged, so it never quotes the body (serde_json's own messages quote
/// the values they reject): a category and a position at most.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotAPayment {
    /// Not JSON, or not the payment's shape (a field missing, of another
    /// type).
    #[error(
        "the body is not a payment {{\"account_id\": STRING, \"amount\": INT > 0}}: \
         {category} at line {line}, column {column}"
    )]
    Json {
        /// serde_json's category: what is wrong, without the value.
        category: &'static str,
        /// Where (1-based).
        line: usize,
        /// Where (1-based).
        column: usize,
    },
    /// The amount is zero or negative.
    #[error("the amount is not positive")]
    NotPositive,
    /// The amount is not an integer (a fraction, an exponent).
    #[error("the amount is not an integer")]
    NotAnInteger,
    /// The amount is over `i64::MAX`.
    #[error("the amount is too large")]
    TooLarge,
    /// The account id is empty.
    #[error("the account id is empty")]
    NoAccount,
    /// The account id is over [`MAX_ACCOUNT_ID_LEN`] bytes.
    #[error("the account id has {0} bytes, more than {MAX_ACCOUNT_ID_LEN}")]
    AccountIdTooLong(usize),
}

/// The body as it is read, before its values are checked.
#[derive(Deserialize)]
struct Body {
    account_id: String,
    amount: serde_json::Number,
}

impl Payment {
    /// Reads a body: JSON `{"account_id": STRING, "amount": INT > 0}`.
    ///
    /// ```
    /// use payments_consumer::payment::{NotAPayment, Payment};
    ///
    /// let payment = Payment::parse(br#"{"account_id": "acc-1", "amount": 5}"#).unwrap();
    /// assert_eq!((payment.account_id.as_str(), payment.amount), ("acc-1", 5));
    /// assert_eq!(
    ///     Payment::parse(br#"{"account_id": "acc-1", "amount": -5}"#),
    ///     Err(NotAPayment::NotPositive)
    /// );
    /// assert_eq!(
    ///     Payment::parse(br#"{"account_id": "acc-1", "amount": 2.5}"#),
    ///     Err(NotAPayment::NotAnInteger)
    /// );
    /// let error = Payment::parse(br#"{"account_id": "acc-1", "amount": "secret"}"#).unwrap_err();
    /// assert!(!error.to_string().contains("secret"), "{error}");
    /// ```
    pub fn parse(body: &[u8]) -> Result<Self, NotAPayment> {
        let body: Body = serde_json::from_slice(body).map_err(|error| NotAPayment::Json {
            category: match error.classify() {
                serde_json::error::Category::Syntax => "not JSON",
                serde_json::error::Category::Eof => "JSON cut short",
                serde_json::error::Category::Data => "a field missing or of another type",
                serde_json::error::Category::Io => "unreadable",
            },
            line: error.line(),
            column: error.column(),
        })?;
        let amount = match body.amount.as_i64() {
            Some(amount) if amount > 0 => amount,
            Some(_) => return Err(NotAPayment::NotPositive),
            None if body.amount.is_u64() => return Err(NotAPayment::TooLarge),
            None => return Err(NotAPayment::NotAnInteger),
        };
        if body.account_id.is_empty() {
            return Err(NotAPayment::NoAccount);
        }
        if body.account_id.len() > MAX_ACCOUNT_ID_LEN {
            return Err(NotAPayment::AccountIdTooLong(body.account_id.len()));
        }
        Ok(Self {
            account_id: body.account_id,
            amount,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn only_positive_integer_amounts_are_payments() {
        let parse = |amount: &str| {
            Payment::parse(format!(r#"{{"account_id": "a", "amount": {amount}}}"#).as_bytes())
        };
        assert_eq!(parse("1").unwrap().amount, 1);
        assert_eq!(parse("9223372036854775807").unwrap().amount, i64::MAX);
        assert_eq!(parse("0"), Err(NotAPayment::NotPositive));
        assert_eq!(parse("-5"), Err(NotAPayment::NotPositive));
        assert_eq!(parse("5.0"), Err(NotAPayment::NotAnInteger));
        assert_eq!(parse("1e3"), Err(NotAPayment::NotAnInteger));
        assert_eq!(parse("9223372036854775808"), Err(NotAPayment::TooLarge));
        assert!(matches!(parse(r#""5""#), Err(NotAPayment::Json { .. })));
        assert!(matches!(parse("null"), Err(NotAPayment::Json { .. })));
    }

    #[test]
    fn the_account_id_is_bounded() {
        let body = |account: &str| format!(r#"{{"account_id": "{account}", "amount": 1}}"#);
        let longest = "a".repeat(MAX_ACCOUNT_ID_LEN);
        assert!(Payment::parse(body(&longest).as_bytes()).is_ok());
        assert_eq!(
            Payment::parse(body(&format!("{longest}a")).as_bytes()),
            Err(NotAPayment::AccountIdTooLong(MAX_ACCOUNT_ID_LEN + 1))
        );
        assert_eq!(
            Payment::parse(body("").as_bytes()),
            Err(NotAPayment::NoAccount)
        );
    }

    #[test]
    fn a_reason_never_quotes_the_body() {
        for body in [
            r#"{"account_id": "acc-secret-1", "amount": "secret-2"}"#,
            r#"{"account_id": ["secret-3"], "amount": 1}"#,
            r#"{"account_id": "acc", "amount": 1, "secret-4"#,
            "secret-5",
            r#"{"secret-6": 1}"#,
        ] {
            let reason = Payment::parse(body.as_bytes()).unwrap_err().to_string();
            assert!(!reason.contains("secret"), "{body} -> {reason}");
        }
    }
}
