//! What a request controls, bounded before it reaches a log line.
//!
//! A path, an account id, a scope an application derives from its input: any
//! of them can be kilobytes long, and a log that copies them whole lets one
//! client write megabytes of log per request. [`bounded`] shows at most
//! [`FIELD_LIMIT`] bytes of such a field, then its length: every field idem
//! logs that a request controls goes through it (the span's `path` and
//! `scope`; a [`Scope`](crate::Scope) displays bounded), and the examples log
//! their request-controlled fields the same way. Keys have a stricter form of
//! their own ([`IdempotencyKey::redacted`](crate::IdempotencyKey::redacted)).
//!
//! ```
//! use idem_core::log::bounded;
//!
//! assert_eq!(bounded("acct-1").to_string(), "acct-1");
//! let long = "x".repeat(59_000);
//! assert_eq!(bounded(&long).to_string(), format!("{}…(59000 bytes)", "x".repeat(128)));
//! ```

use std::fmt;

/// The most bytes of a request-controlled field a log line shows.
pub const FIELD_LIMIT: usize = 128;

/// The tracing targets of the drivers idem runs on that log what they carry
/// below `INFO`: PostgreSQL's (`tokio_postgres`, at `DEBUG`: every
/// statement's bound parameters, which hold idempotency keys, message ids and
/// the values of bodies), RabbitMQ's (`lapin`, `amq_protocol`, at `TRACE`:
/// every frame, its properties and body), the AWS SDK's (`aws_smithy_*`,
/// `aws_sigv4`, `aws_sdk_*`, at `DEBUG` and `TRACE`: requests and responses
/// whole, message bodies and ids, the signing's access key id) and
/// librdkafka's (`rdkafka`). An application caps them at `INFO` whatever
/// `RUST_LOG` says ([`carries_payloads`]), so that no log level shows a body,
/// a whole key or a credential; idem's own events never carry one.
pub const PAYLOAD_TARGETS: &[&str] = &[
    "tokio_postgres",
    "lapin",
    "amq_protocol",
    "aws_smithy",
    "aws_sigv4",
    "aws_sdk_",
    "aws_config",
    "aws_credential_types",
    "aws_runtime",
    "rdkafka",
];

/// Whether `target` is one of the [`PAYLOAD_TARGETS`] or in one of their
/// modules (a prefix match): an application's subscriber lets such events
/// through at `INFO` and above only.
///
/// ```
/// use idem_core::log::carries_payloads;
///
/// assert!(carries_payloads("tokio_postgres::query"));
/// assert!(carries_payloads("aws_smithy_runtime::client::orchestrator"));
/// assert!(carries_payloads("aws_sdk_sqs::operation::receive_message"));
/// assert!(!carries_payloads("idem"));
/// assert!(!carries_payloads("idem_sqs"));
/// ```
pub fn carries_payloads(target: &str) -> bool {
    PAYLOAD_TARGETS
        .iter()
        .any(|driver| target.starts_with(driver))
}

/// The longest prefix of `text` of at most `max` bytes that ends on a
/// character boundary: how a log field, a shown key and a dead letter's
/// reason are cut.
///
/// ```
/// assert_eq!(idem_core::log::cut("éé", 3), "é");
/// assert_eq!(idem_core::log::cut("abc", 8), "abc");
/// ```
pub fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.get(..end).unwrap_or("")
}

/// `text` as a log line may show it: whole up to [`FIELD_LIMIT`] bytes, else
/// its first bytes up to the limit (cut at a character boundary), an ellipsis
/// and its length in bytes.
pub fn bounded(text: &str) -> Bounded<'_> {
    Bounded(text)
}

/// A field bounded for logs; see [`bounded`].
#[derive(Clone, Copy)]
pub struct Bounded<'a>(&'a str);

impl fmt::Display for Bounded<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = self.0;
        if text.len() <= FIELD_LIMIT {
            return f.write_str(text);
        }
        write!(f, "{}…({} bytes)", cut(text, FIELD_LIMIT), text.len())
    }
}

impl fmt::Debug for Bounded<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{self}\"")
    }
}

/// An error and its sources on one line, `outer: cause: root`: what idem logs
/// for a failure, and what a dead letter keeps as its reason.
///
/// ```
/// use idem_core::log::error_chain;
///
/// #[derive(Debug, thiserror::Error)]
/// #[error("the ledger failed")]
/// struct Ledger(#[source] std::io::Error);
///
/// let error = Ledger(std::io::Error::other("disk full"));
/// assert_eq!(error_chain(&error), "the ledger failed: disk full");
/// ```
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_fields_are_whole_and_long_ones_cut_at_a_character() {
        assert_eq!(bounded("").to_string(), "");
        let exact = "a".repeat(FIELD_LIMIT);
        assert_eq!(bounded(&exact).to_string(), exact);
        // 127 ASCII bytes, then a 2-byte character across the limit.
        let across = format!("{}é{}", "a".repeat(FIELD_LIMIT - 1), "b".repeat(10));
        assert_eq!(
            bounded(&across).to_string(),
            format!("{}…(139 bytes)", "a".repeat(FIELD_LIMIT - 1))
        );
        assert_eq!(format!("{:?}", bounded("x")), "\"x\"");
    }
}
