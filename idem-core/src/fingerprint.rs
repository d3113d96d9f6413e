//! The request fingerprint (CONTRACT §3).

use std::fmt;

/// SHA-256 over a request: its method, path, query string, `Content-Type`,
/// `Content-Encoding` and body, each part length-prefixed.
///
/// A retry with the same key must carry the same request; a different fingerprint
/// under the same key is answered `422 key-reused`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// A fingerprint from its 32 bytes (for stores).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// A fingerprint from a slice of 32 bytes; `None` for any other length.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }

    /// The 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

/// Lower-case hex.
impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// Where the adapter's request headers are looked up by the fingerprint.
pub trait HeaderSource {
    /// The value of the first field named `name` (lower-case), if any.
    fn header(&self, name: &str) -> Option<&[u8]>;
}

/// The parts of a request that come before its body.
pub struct RequestHead<'a> {
    /// The method, e.g. `POST`.
    pub method: &'a str,
    /// The path, e.g. `/accounts/a1/charges`.
    pub path: &'a str,
    /// The query string without `?`; empty when absent.
    pub query: &'a str,
    /// The request's headers.
    pub headers: &'a dyn HeaderSource,
}

/// How the fingerprint treats the body and which extra headers it covers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FingerprintSpec {
    /// How the body enters the fingerprint.
    pub body: BodyMode,
    /// Further headers (lower-case names) whose values enter the fingerprint.
    pub headers: Vec<String>,
}

/// How the body enters the fingerprint.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum BodyMode {
    /// Every byte, as sent. The default.
    #[default]
    Exact,
    /// A JSON body re-serialized canonically: object keys sorted, whitespace
    /// dropped. A body that is not JSON is taken byte for byte.
    CanonicalJson,
    /// Only the named fields of a JSON body, as JSON Pointers (`/amount`), each
    /// canonicalized. A body that is not JSON is taken byte for byte.
    Fields(Vec<String>),
}

/// Builds a fingerprint incrementally: start from the request head, feed the body
/// chunk by chunk as it streams, then finish.
pub struct FingerprintBuilder {
    _todo: (),
}

impl FingerprintSpec {
    /// Starts a fingerprint of the request whose head is `head`.
    pub fn start(&self, head: &RequestHead<'_>) -> FingerprintBuilder {
        todo!("fingerprint")
    }
}

impl FingerprintBuilder {
    /// Feeds the next chunk of the body.
    pub fn update(&mut self, chunk: &[u8]) {
        todo!("fingerprint")
    }

    /// The fingerprint of the request and every chunk fed.
    pub fn finish(self) -> Fingerprint {
        todo!("fingerprint")
    }
}
