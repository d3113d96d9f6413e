//! The request fingerprint (`docs/contract.md` §3).
//!
//! Stores persist fingerprints, so the encoding hashed is part of the stored data:
//! it is written out on [`Fingerprint`] and pinned by test vectors. Never change it
//! in place; a new encoding gets a new version tag.

use std::borrow::Cow;
use std::fmt;

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The domain and version tag that starts every encoding.
const VERSION_TAG: &[u8] = b"idem-fingerprint-v1";

/// SHA-256 over a request: its method, path, query string, `Content-Type`,
/// `Content-Encoding` and body, each part length-prefixed.
///
/// A retry with the same key must carry the same request; a different fingerprint
/// under the same key is answered `422 key-reused`.
///
/// # The encoding (version 1)
///
/// Stores keep fingerprints, so this encoding never changes silently. With
/// `u64be(n)` the eight bytes of `n` big-endian, `part(x) = u64be(len(x)) ‖ x` and
/// `optional(x) = 0x00` when `x` is absent, `0x01 ‖ part(x)` when present, the hash
/// is SHA-256 over, in order:
///
/// 1. `part("idem-fingerprint-v1")`, the version tag;
/// 2. `part(method)`, `part(path)`, `part(query)` (the query without `?`, empty when
///    absent), as the adapter passes them in [`RequestHead`];
/// 3. `optional(content-type)`, `optional(content-encoding)` (the first field of
///    each), so that an absent header and an empty one differ;
/// 4. `u64be(n)`, the number of headers in [`FingerprintSpec::headers`], then for
///    each, in the spec's order, `part(name)` (lower-cased) and `optional(value)`;
/// 5. `part(mode)`, with mode `exact`, `canonical-json` or `fields`;
/// 6. the body, last and unprefixed:
///    - `exact`: the body bytes as sent;
///    - `canonical-json`: `0x01 ‖ canonical(body)` when the body is JSON, else
///      `0x00 ‖` the body bytes;
///    - `fields`: when the body is JSON, `0x01` then for each pointer, in the spec's
///      order, `part(pointer) ‖ optional(canonical(value at pointer))`; else `0x00 ‖`
///      the body bytes.
///
/// `canonical(v)` is JSON without whitespace, object members sorted by the UTF-8
/// bytes of their names (the last of duplicate names wins), strings and numbers as
/// `serde_json` writes them after reading them (so `"\u0041"` and `"A"` agree, while
/// `1` and `1.0` differ).
///
/// ```
/// use idem_core::{FingerprintSpec, HeaderSource, RequestHead};
///
/// struct Headers(Vec<(&'static str, &'static [u8])>);
///
/// impl HeaderSource for Headers {
///     fn each_field<'a>(&'a self, name: &str, each: &mut dyn FnMut(&'a [u8])) {
///         self.0.iter().filter(|(n, _)| *n == name).for_each(|(_, v)| each(v));
///     }
/// }
///
/// let headers = Headers(vec![("content-type", b"application/json")]);
/// let head = RequestHead { method: "POST", path: "/charges", query: "", headers: &headers };
///
/// let mut whole = FingerprintSpec::default().start(&head);
/// whole.update(br#"{"amount":100}"#);
///
/// let mut streamed = FingerprintSpec::default().start(&head);
/// streamed.update(br#"{"amount""#);
/// streamed.update(br#":100}"#);
///
/// assert_eq!(whole.finish(), streamed.finish());
/// ```
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
    /// Calls `each` with the value of every field named `name` (lower-case), in
    /// order. Repeats matter: `Idempotency-Key` must appear once.
    fn each_field<'a>(&'a self, name: &str, each: &mut dyn FnMut(&'a [u8]));

    /// The value of the first field named `name` (lower-case), if any.
    fn header(&self, name: &str) -> Option<&[u8]> {
        let mut first = None;
        self.each_field(name, &mut |value| {
            first = first.or(Some(value));
        });
        first
    }
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
///
/// Built from a constructor for each body mode, [`FingerprintSpec::exact`]
/// (the default), [`FingerprintSpec::canonical_json`] and
/// [`FingerprintSpec::fields`], then [`headers`](Self::headers) for further
/// headers; read through the public fields or [`get_body`](Self::get_body) and
/// [`get_headers`](Self::get_headers). More settings may come, so it is not
/// built by a struct literal.
///
/// ```
/// use idem_core::{BodyMode, FingerprintSpec, Policy};
///
/// let spec = FingerprintSpec::canonical_json().headers(["x-tenant"]);
/// assert_eq!(spec.body, BodyMode::CanonicalJson);
/// assert_eq!(spec.get_headers(), ["x-tenant"]);
/// let policy = Policy::required().fingerprint(spec.clone());
/// assert_eq!(policy.get_fingerprint(), &spec);
/// assert_eq!(FingerprintSpec::default(), FingerprintSpec::exact());
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
#[must_use]
pub struct FingerprintSpec {
    /// How the body enters the fingerprint.
    pub body: BodyMode,
    /// Further headers (lower-case names) whose values enter the fingerprint.
    pub headers: Vec<String>,
}

/// How the body enters the fingerprint.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
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
///
/// In [`BodyMode::Exact`] chunks are hashed as they arrive and nothing is kept; the
/// JSON modes keep the body (bounded by the request-body limit upstream) until
/// [`finish`](Self::finish).
pub struct FingerprintHasher {
    hasher: Sha256,
    body: BodyFeed,
}

/// Where body chunks go.
enum BodyFeed {
    Exact,
    CanonicalJson(Vec<u8>),
    Fields {
        pointers: Vec<String>,
        buffered: Vec<u8>,
    },
}

impl FingerprintSpec {
    /// The body byte for byte ([`BodyMode::Exact`]), no further headers: the
    /// default.
    pub fn exact() -> Self {
        Self::default()
    }

    /// A JSON body canonicalized ([`BodyMode::CanonicalJson`]), no further
    /// headers: for clients that serialize the body again for each attempt.
    pub fn canonical_json() -> Self {
        Self::default().body(BodyMode::CanonicalJson)
    }

    /// Only the JSON fields at `pointers` (`"/amount"`, [`BodyMode::Fields`]),
    /// no further headers.
    pub fn fields<I, P>(pointers: I) -> Self
    where
        I: IntoIterator<Item = P>,
        P: Into<String>,
    {
        Self::default().body(BodyMode::Fields(
            pointers.into_iter().map(Into::into).collect(),
        ))
    }

    /// How the body enters the fingerprint.
    pub fn body(mut self, body: BodyMode) -> Self {
        self.body = body;
        self
    }

    /// The further headers whose values enter the fingerprint (names compare
    /// case-insensitively), in place of any set before.
    pub fn headers<I, N>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = N>,
        N: Into<String>,
    {
        self.headers = names.into_iter().map(Into::into).collect();
        self
    }

    /// How the body enters the fingerprint.
    pub fn get_body(&self) -> &BodyMode {
        &self.body
    }

    /// The further headers whose values enter the fingerprint.
    pub fn get_headers(&self) -> &[String] {
        &self.headers
    }

    /// Starts a fingerprint of the request whose head is `head`.
    pub fn start(&self, head: &RequestHead<'_>) -> FingerprintHasher {
        let mut hasher = Sha256::new();
        part(&mut hasher, VERSION_TAG);
        part(&mut hasher, head.method.as_bytes());
        part(&mut hasher, head.path.as_bytes());
        part(&mut hasher, head.query.as_bytes());
        optional(&mut hasher, head.headers.header("content-type"));
        optional(&mut hasher, head.headers.header("content-encoding"));
        hasher.update((self.headers.len() as u64).to_be_bytes());
        for name in &self.headers {
            let name = lower_case(name);
            part(&mut hasher, name.as_bytes());
            optional(&mut hasher, head.headers.header(&name));
        }
        let (mode, body): (&[u8], _) = match &self.body {
            BodyMode::Exact => (b"exact", BodyFeed::Exact),
            BodyMode::CanonicalJson => (b"canonical-json", BodyFeed::CanonicalJson(Vec::new())),
            BodyMode::Fields(pointers) => (
                b"fields",
                BodyFeed::Fields {
                    pointers: pointers.clone(),
                    buffered: Vec::new(),
                },
            ),
        };
        part(&mut hasher, mode);
        FingerprintHasher { hasher, body }
    }
}

impl FingerprintHasher {
    /// Feeds the next chunk of the body.
    pub fn update(&mut self, chunk: &[u8]) {
        match &mut self.body {
            BodyFeed::Exact => self.hasher.update(chunk),
            BodyFeed::CanonicalJson(buffered) | BodyFeed::Fields { buffered, .. } => {
                buffered.extend_from_slice(chunk);
            }
        }
    }

    /// The fingerprint of the request and every chunk fed.
    pub fn finish(self) -> Fingerprint {
        let mut hasher = self.hasher;
        match self.body {
            BodyFeed::Exact => {}
            BodyFeed::CanonicalJson(body) => {
                match serde_json::from_slice::<Value>(&body).and_then(|v| canonical(&v)) {
                    Ok(json) => {
                        hasher.update([JSON]);
                        hasher.update(json);
                    }
                    Err(_) => raw(&mut hasher, &body),
                }
            }
            BodyFeed::Fields { pointers, buffered } => match selected(&buffered, &pointers) {
                Ok(fields) => {
                    hasher.update([JSON]);
                    for (pointer, value) in pointers.iter().zip(&fields) {
                        part(&mut hasher, pointer.as_bytes());
                        optional(&mut hasher, value.as_deref());
                    }
                }
                Err(_) => raw(&mut hasher, &buffered),
            },
        }
        Fingerprint(hasher.finalize().into())
    }
}

impl fmt::Debug for FingerprintHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = match self.body {
            BodyFeed::Exact => "exact",
            BodyFeed::CanonicalJson(_) => "canonical-json",
            BodyFeed::Fields { .. } => "fields",
        };
        f.debug_struct("FingerprintHasher")
            .field("mode", &mode)
            .finish_non_exhaustive()
    }
}

/// Marks a body hashed as JSON, as opposed to [`RAW`] bytes.
const JSON: u8 = 0x01;
/// Marks a body hashed byte for byte because it is not JSON.
const RAW: u8 = 0x00;

/// `u64be(len(x)) ‖ x`.
fn part(hasher: &mut Sha256, bytes: &[u8]) {
    hasher.update((bytes.len() as u64).to_be_bytes());
    hasher.update(bytes);
}

/// `0x00` when absent, `0x01 ‖ part(x)` when present.
fn optional(hasher: &mut Sha256, bytes: Option<&[u8]>) {
    match bytes {
        None => hasher.update([0x00]),
        Some(bytes) => {
            hasher.update([0x01]);
            part(hasher, bytes);
        }
    }
}

/// A body that is not JSON, hashed as sent.
fn raw(hasher: &mut Sha256, body: &[u8]) {
    hasher.update([RAW]);
    hasher.update(body);
}

/// Header names are looked up and hashed lower-case; most specs already are.
fn lower_case(name: &str) -> Cow<'_, str> {
    if name.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(name.to_ascii_lowercase())
    } else {
        Cow::Borrowed(name)
    }
}

/// The canonical form of each pointer's value in a JSON body (`None` where the
/// pointer selects nothing).
fn selected(body: &[u8], pointers: &[String]) -> serde_json::Result<Vec<Option<Vec<u8>>>> {
    let document: Value = serde_json::from_slice(body)?;
    pointers
        .iter()
        .map(|pointer| document.pointer(pointer).map(canonical).transpose())
        .collect()
}

/// JSON without whitespace, object members sorted by name.
///
/// Sorted here rather than relying on `serde_json::Map` being a `BTreeMap`: any
/// crate in a build may enable serde_json's `preserve_order`, which would make the
/// fingerprint depend on the client's key order.
fn canonical(value: &Value) -> serde_json::Result<Vec<u8>> {
    let mut out = Vec::new();
    write_canonical(value, &mut out)?;
    Ok(out)
}

fn write_canonical(value: &Value, out: &mut Vec<u8>) -> serde_json::Result<()> {
    match value {
        Value::Object(members) => {
            let mut members: Vec<_> = members.iter().collect();
            members.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (name, member)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, name)?;
                out.push(b':');
                write_canonical(member, out)?;
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out)?;
            }
            out.push(b']');
        }
        scalar => serde_json::to_writer(&mut *out, scalar)?,
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Headers as a test request carries them.
    #[derive(Clone, Default)]
    struct Headers(Vec<(String, Vec<u8>)>);

    impl HeaderSource for Headers {
        fn each_field<'a>(&'a self, name: &str, each: &mut dyn FnMut(&'a [u8])) {
            self.0
                .iter()
                .filter(|(n, _)| n == name)
                .for_each(|(_, v)| each(v));
        }
    }

    /// A whole request, fingerprinted in one call.
    #[derive(Clone)]
    struct Request {
        method: &'static str,
        path: &'static str,
        query: &'static str,
        headers: Headers,
        body: Vec<u8>,
    }

    impl Request {
        fn charge() -> Self {
            Self {
                method: "POST",
                path: "/accounts/a1/charges",
                query: "expand=balance",
                headers: Headers(vec![
                    ("content-type".into(), b"application/json".to_vec()),
                    ("x-tenant".into(), b"acme".to_vec()),
                ]),
                body: br#"{"amount": 100, "currency": "EUR"}"#.to_vec(),
            }
        }

        fn header(mut self, name: &str, value: Option<&[u8]>) -> Self {
            self.headers.0.retain(|(n, _)| n != name);
            if let Some(value) = value {
                self.headers.0.push((name.into(), value.to_vec()));
            }
            self
        }

        fn body(mut self, body: &[u8]) -> Self {
            self.body = body.to_vec();
            self
        }

        fn fingerprint_chunked(&self, spec: &FingerprintSpec, chunks: &[usize]) -> Fingerprint {
            let head = RequestHead {
                method: self.method,
                path: self.path,
                query: self.query,
                headers: &self.headers,
            };
            let mut builder = spec.start(&head);
            let mut rest = self.body.as_slice();
            for &len in chunks {
                let (chunk, tail) = rest.split_at(len.min(rest.len()));
                builder.update(chunk);
                rest = tail;
            }
            builder.update(rest);
            builder.finish()
        }

        fn fingerprint(&self, spec: &FingerprintSpec) -> Fingerprint {
            self.fingerprint_chunked(spec, &[])
        }

        fn exact(&self) -> Fingerprint {
            self.fingerprint(&FingerprintSpec::default())
        }
    }

    fn spec(body: BodyMode, headers: &[&str]) -> FingerprintSpec {
        FingerprintSpec::exact()
            .body(body)
            .headers(headers.iter().copied())
    }

    fn fields(pointers: &[&str]) -> BodyMode {
        BodyMode::Fields(pointers.iter().map(|p| (*p).to_owned()).collect())
    }

    /// The documented encoding, assembled by hand.
    struct Encoding(Vec<u8>);

    impl Encoding {
        fn new() -> Self {
            Self(Vec::new())
        }
        fn part(mut self, bytes: &[u8]) -> Self {
            self.0
                .extend_from_slice(&(bytes.len() as u64).to_be_bytes());
            self.0.extend_from_slice(bytes);
            self
        }
        fn absent(mut self) -> Self {
            self.0.push(0);
            self
        }
        fn present(mut self, bytes: &[u8]) -> Self {
            self.0.push(1);
            self.part(bytes)
        }
        fn raw(mut self, bytes: &[u8]) -> Self {
            self.0.extend_from_slice(bytes);
            self
        }
        fn hex(&self) -> String {
            Sha256::digest(&self.0)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect()
        }
    }

    #[test]
    fn exact_encoding_is_pinned() {
        let request = Request::charge();
        let expected = Encoding::new()
            .part(b"idem-fingerprint-v1")
            .part(b"POST")
            .part(b"/accounts/a1/charges")
            .part(b"expand=balance")
            .present(b"application/json")
            .absent()
            .raw(&0u64.to_be_bytes())
            .part(b"exact")
            .raw(br#"{"amount": 100, "currency": "EUR"}"#);
        let fingerprint = request.exact();
        assert_eq!(fingerprint.to_string(), expected.hex());
        assert_eq!(
            fingerprint.to_string(),
            "fe9022ebe139832f0f9f7694dd9e0e4cee9b6f74efe1bdcf32c900edcbcc1fa7"
        );
    }

    #[test]
    fn canonical_json_encoding_with_a_header_is_pinned() {
        let request = Request::charge();
        let expected = Encoding::new()
            .part(b"idem-fingerprint-v1")
            .part(b"POST")
            .part(b"/accounts/a1/charges")
            .part(b"expand=balance")
            .present(b"application/json")
            .absent()
            .raw(&1u64.to_be_bytes())
            .part(b"x-tenant")
            .present(b"acme")
            .part(b"canonical-json")
            .raw(&[1])
            .raw(br#"{"amount":100,"currency":"EUR"}"#);
        let fingerprint = request.fingerprint(&spec(BodyMode::CanonicalJson, &["X-Tenant"]));
        assert_eq!(fingerprint.to_string(), expected.hex());
        assert_eq!(
            fingerprint.to_string(),
            "fe220026c89ed3542858bdb54f6ff9cad870700d27cd5df2749f9cfc7ec798eb"
        );
    }

    #[test]
    fn fields_encoding_is_pinned() {
        let request = Request::charge();
        let expected = Encoding::new()
            .part(b"idem-fingerprint-v1")
            .part(b"POST")
            .part(b"/accounts/a1/charges")
            .part(b"expand=balance")
            .present(b"application/json")
            .absent()
            .raw(&0u64.to_be_bytes())
            .part(b"fields")
            .raw(&[1])
            .part(b"/amount")
            .present(b"100")
            .part(b"/missing")
            .absent();
        let fingerprint = request.fingerprint(&spec(fields(&["/amount", "/missing"]), &[]));
        assert_eq!(fingerprint.to_string(), expected.hex());
    }

    #[test]
    fn non_json_body_is_hashed_raw_in_json_modes() {
        let request = Request::charge().body(b"amount=100");
        let head = Encoding::new()
            .part(b"idem-fingerprint-v1")
            .part(b"POST")
            .part(b"/accounts/a1/charges")
            .part(b"expand=balance")
            .present(b"application/json")
            .absent()
            .raw(&0u64.to_be_bytes());
        let canonical = Encoding(head.0.clone())
            .part(b"canonical-json")
            .raw(&[0])
            .raw(b"amount=100");
        let selected = head.part(b"fields").raw(&[0]).raw(b"amount=100");
        assert_eq!(
            request
                .fingerprint(&spec(BodyMode::CanonicalJson, &[]))
                .to_string(),
            canonical.hex()
        );
        assert_eq!(
            request
                .fingerprint(&spec(fields(&["/amount"]), &[]))
                .to_string(),
            selected.hex()
        );
    }

    #[test]
    fn same_request_gives_same_fingerprint() {
        assert_eq!(Request::charge().exact(), Request::charge().exact());
        let spec = spec(BodyMode::CanonicalJson, &["x-tenant"]);
        assert_eq!(
            Request::charge().fingerprint(&spec),
            Request::charge().fingerprint(&spec)
        );
    }

    #[test]
    fn each_part_changes_the_fingerprint() {
        let original = Request::charge();
        let variants = [
            Request {
                method: "PATCH",
                ..original.clone()
            },
            Request {
                path: "/accounts/a2/charges",
                ..original.clone()
            },
            Request {
                query: "expand=none",
                ..original.clone()
            },
            original.clone().header("content-type", Some(b"text/plain")),
            original.clone().header("content-encoding", Some(b"gzip")),
            original
                .clone()
                .body(br#"{"amount": 101, "currency": "EUR"}"#),
            original.clone().body(b""),
        ];
        let spec = FingerprintSpec::default();
        let base = original.fingerprint(&spec);
        for (i, variant) in variants.iter().enumerate() {
            assert_ne!(variant.fingerprint(&spec), base, "variant {i}");
        }
    }

    #[test]
    fn selected_header_changes_the_fingerprint_and_others_do_not() {
        let with_tenant = spec(BodyMode::Exact, &["x-tenant"]);
        let original = Request::charge();
        let base = original.fingerprint(&with_tenant);
        let other_tenant = original.clone().header("x-tenant", Some(b"globex"));
        let no_tenant = original.clone().header("x-tenant", None);
        let empty_tenant = original.clone().header("x-tenant", Some(b""));
        assert_ne!(other_tenant.fingerprint(&with_tenant), base);
        assert_ne!(no_tenant.fingerprint(&with_tenant), base);
        assert_ne!(
            no_tenant.fingerprint(&with_tenant),
            empty_tenant.fingerprint(&with_tenant)
        );
        // Not selected: ignored.
        assert_eq!(other_tenant.exact(), original.exact());
        let traced = original.clone().header("x-request-id", Some(b"r-1"));
        assert_eq!(traced.fingerprint(&with_tenant), base);
    }

    #[test]
    fn absent_and_empty_headers_differ() {
        let request = Request::charge();
        for name in ["content-type", "content-encoding"] {
            let absent = request.clone().header(name, None).exact();
            let empty = request.clone().header(name, Some(b"")).exact();
            assert_ne!(absent, empty, "{name}");
        }
    }

    #[test]
    fn part_boundaries_are_not_confused() {
        let base = Request::charge();
        let ab_c = Request {
            path: "/ab",
            query: "c",
            ..base.clone()
        };
        let a_bc = Request {
            path: "/a",
            query: "bc",
            ..base.clone()
        };
        assert_ne!(ab_c.exact(), a_bc.exact());

        // Content-Type "" + Content-Encoding absent vs the reverse.
        let type_only = base
            .clone()
            .header("content-type", Some(b""))
            .header("content-encoding", None);
        let encoding_only = base
            .clone()
            .header("content-type", None)
            .header("content-encoding", Some(b""));
        assert_ne!(type_only.exact(), encoding_only.exact());

        // A query that ends like a body starts.
        let q = Request {
            query: "x",
            ..base.clone()
        }
        .body(b"y");
        let b = Request {
            query: "",
            ..base.clone()
        }
        .body(b"xy");
        assert_ne!(q.exact(), b.exact());
    }

    #[test]
    fn body_modes_give_different_fingerprints() {
        let request = Request::charge();
        let exact = request.exact();
        let canonical = request.fingerprint(&spec(BodyMode::CanonicalJson, &[]));
        let all_fields = request.fingerprint(&spec(fields(&[""]), &[]));
        assert_ne!(exact, canonical);
        assert_ne!(canonical, all_fields);
        assert_ne!(exact, all_fields);
    }

    #[test]
    fn canonical_json_ignores_key_order_and_whitespace() {
        let spec = spec(BodyMode::CanonicalJson, &[]);
        let request = Request::charge();
        let base = request.fingerprint(&spec);
        let reordered = request
            .clone()
            .body(b"{\n  \"currency\" : \"EUR\",\n\t\"amount\":100 }");
        let escaped = request
            .clone()
            .body(br#"{"amount":100,"currency":"\u0045UR"}"#);
        assert_eq!(reordered.fingerprint(&spec), base);
        assert_eq!(escaped.fingerprint(&spec), base);

        let nested_a = request
            .clone()
            .body(br#"{"m":{"b":[1,{"y":2,"x":1}],"a":null}}"#);
        let nested_b = request
            .clone()
            .body(br#"{ "m" : { "a":null, "b":[ 1, {"x":1,"y":2} ] } }"#);
        assert_eq!(nested_a.fingerprint(&spec), nested_b.fingerprint(&spec));
    }

    #[test]
    fn canonical_json_keeps_values_and_array_order() {
        let spec = spec(BodyMode::CanonicalJson, &[]);
        let request = Request::charge();
        let base = request.fingerprint(&spec);
        for body in [
            &br#"{"amount":101,"currency":"EUR"}"#[..],
            br#"{"amount":"100","currency":"EUR"}"#,
            br#"{"amount":100,"currency":"EUR","memo":null}"#,
            br#"{"amount":100}"#,
            br#"[{"amount":100,"currency":"EUR"}]"#,
        ] {
            assert_ne!(
                request.clone().body(body).fingerprint(&spec),
                base,
                "{body:?}"
            );
        }
        let ab = request.clone().body(b"[1,2]").fingerprint(&spec);
        let ba = request.clone().body(b"[2,1]").fingerprint(&spec);
        assert_ne!(ab, ba);
    }

    #[test]
    fn non_json_body_is_taken_byte_for_byte() {
        let spec = spec(BodyMode::CanonicalJson, &[]);
        let request = Request::charge();
        let a = request.clone().body(b"amount=100 ").fingerprint(&spec);
        let b = request.clone().body(b"amount=100").fingerprint(&spec);
        assert_ne!(a, b);
    }

    #[test]
    fn fields_mode_ignores_unselected_fields() {
        let spec = spec(fields(&["/amount", "/currency"]), &[]);
        let request = Request::charge();
        let base = request.fingerprint(&spec);
        let with_memo = request
            .clone()
            .body(br#"{"memo":"lunch","currency":"EUR","amount":100,"at":"2024-01-01"}"#);
        assert_eq!(with_memo.fingerprint(&spec), base);

        let other_amount = request.clone().body(br#"{"amount":200,"currency":"EUR"}"#);
        assert_ne!(other_amount.fingerprint(&spec), base);
        let missing_currency = request.clone().body(br#"{"amount":100}"#);
        let null_currency = request.clone().body(br#"{"amount":100,"currency":null}"#);
        assert_ne!(missing_currency.fingerprint(&spec), base);
        assert_ne!(
            missing_currency.fingerprint(&spec),
            null_currency.fingerprint(&spec)
        );
    }

    #[test]
    fn fields_mode_canonicalizes_selected_values() {
        let spec = spec(fields(&["/payer"]), &[]);
        let request = Request::charge();
        let a = request
            .clone()
            .body(br#"{"payer":{"id":1,"name":"x"},"n":1}"#);
        let b = request
            .clone()
            .body(br#"{"n":2,"payer":{ "name":"x", "id":1 }}"#);
        assert_eq!(a.fingerprint(&spec), b.fingerprint(&spec));
    }

    #[test]
    fn builder_debug_names_the_mode() {
        let request = Request::charge();
        let head = RequestHead {
            method: request.method,
            path: request.path,
            query: request.query,
            headers: &request.headers,
        };
        let builder = spec(BodyMode::CanonicalJson, &[]).start(&head);
        assert_eq!(
            format!("{builder:?}"),
            r#"FingerprintHasher { mode: "canonical-json", .. }"#
        );
    }

    fn any_spec() -> impl Strategy<Value = FingerprintSpec> {
        prop_oneof![
            Just(spec(BodyMode::Exact, &[])),
            Just(spec(BodyMode::CanonicalJson, &["x-tenant"])),
            Just(spec(fields(&["/amount", "/items/0"]), &[])),
        ]
    }

    fn any_body() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..2048),
            (any::<i64>(), "[a-z ]{0,40}").prop_map(|(amount, memo)| {
                format!(r#"{{"amount": {amount}, "memo": "{memo}", "items": [{amount}, "x"]}}"#)
                    .into_bytes()
            }),
        ]
    }

    proptest! {
        #[test]
        fn chunking_does_not_change_the_fingerprint(
            spec in any_spec(),
            body in any_body(),
            chunks in proptest::collection::vec(0usize..300, 0..20),
        ) {
            let request = Request::charge().body(&body);
            prop_assert_eq!(
                request.fingerprint_chunked(&spec, &chunks),
                request.fingerprint(&spec)
            );
        }
    }
}
