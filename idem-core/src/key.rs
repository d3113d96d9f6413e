//! The `Idempotency-Key` header: parsing and validation (CONTRACT §2).

use std::fmt;
use std::sync::Arc;

/// The name of the request header that carries the key.
pub const KEY_HEADER: &str = "idempotency-key";

/// A valid idempotency key: 1 to 255 printable ASCII characters (0x20–0x7E).
///
/// Parsed from a Structured Field String (`Idempotency-Key: "abc"`, RFC 9651) or
/// from a bare value (`Idempotency-Key: abc`), the form Stripe's clients send.
/// Surrounding whitespace is not part of the key.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(Arc<str>);

/// Why a key was rejected. Each is answered `400` with problem type `invalid-key`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The request carried the header more than once.
    #[error("the Idempotency-Key header appears more than once")]
    MultipleFields,
    /// The value is empty (or only whitespace, or the empty string `""`).
    #[error("the Idempotency-Key header is empty")]
    Empty,
    /// A bare value contains a comma: a proxy joined repeated fields.
    #[error("the Idempotency-Key header holds a list (a comma in a bare value)")]
    Comma,
    /// The value starts as a Structured Field String but is not a valid one.
    #[error("the Idempotency-Key header is not a valid structured field string: {0}")]
    Syntax(String),
    /// The value holds a control character.
    #[error("the Idempotency-Key header contains a control character")]
    ControlCharacter,
    /// The value holds a byte outside ASCII.
    #[error("the Idempotency-Key header contains a non-ASCII byte")]
    NonAscii,
    /// The key is longer than 255 characters.
    #[error("the idempotency key is {0} characters long; at most 255 are allowed")]
    TooLong(usize),
}

/// The longest key accepted.
pub const MAX_KEY_LEN: usize = 255;

impl IdempotencyKey {
    /// Parses the values of every `Idempotency-Key` field of a request.
    ///
    /// `Ok(None)` when the request has none; `Err(KeyError::MultipleFields)` when it
    /// has more than one.
    pub fn from_fields<'a, I>(fields: I) -> Result<Option<Self>, KeyError>
    where
        I: IntoIterator<Item = &'a [u8]>,
    {
        let mut fields = fields.into_iter();
        let Some(first) = fields.next() else {
            return Ok(None);
        };
        if fields.next().is_some() {
            return Err(KeyError::MultipleFields);
        }
        Self::parse(first).map(Some)
    }

    /// Parses one field value.
    pub fn parse(value: &[u8]) -> Result<Self, KeyError> {
        todo!("key parsing")
    }

    /// A key from a string that is already known to be valid; the same checks as
    /// [`parse`](Self::parse) on the bare form.
    pub fn new(key: &str) -> Result<Self, KeyError> {
        Self::parse(key.as_bytes())
    }

    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A form of the key that is safe to log: its first four characters, an
    /// ellipsis, and its length (`8e03…(36)`). The whole key never reaches a log.
    pub fn redacted(&self) -> Redacted<'_> {
        Redacted(self)
    }
}

/// A key as it may appear in logs. See [`IdempotencyKey::redacted`].
#[derive(Clone, Copy)]
pub struct Redacted<'a>(&'a IdempotencyKey);

impl fmt::Display for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let key = self.0.as_str();
        let shown = key.get(..4.min(key.len())).unwrap_or("");
        write!(f, "{shown}…({})", key.len())
    }
}

impl fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Debug output is redacted too, so a key in a logged struct does not leak.
impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({})", self.redacted())
    }
}
