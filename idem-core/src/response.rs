//! The response a completed record keeps and replays.

use std::borrow::Cow;

use bytes::Bytes;

/// A response as idem stores it: framework-neutral, so that the same record replays
/// through any adapter.
///
/// Headers keep their order and their repeats (two `Set-Cookie` fields stay two
/// fields). Names are stored lower-case, as HTTP/2 and the `http` crates spell them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status code.
    pub status: u16,
    /// Every header field, in order, repeats kept.
    pub headers: Vec<Header>,
    /// The body, byte for byte. Empty when `replayable` is false.
    pub body: Bytes,
    /// Whether the body was kept. A body over the stored-body limit is sent to the
    /// first client but not kept; a retry then gets a problem answer instead of a
    /// replay (and never a second execution).
    pub replayable: bool,
}

/// One header field: a lower-case name and its value's raw bytes.
///
/// The name is a `Cow` so that the names answers carry most (`content-type`,
/// `location`, the replay marker…) are shared, not allocated per response:
/// cloning a stored answer for a replay then copies no name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Header {
    /// The field name, lower-case.
    pub name: Cow<'static, str>,
    /// The field value, as sent (not necessarily UTF-8).
    pub value: Bytes,
}

/// The header that marks a replayed answer.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The header names every keyed request looks up (its key, and the content type
/// and encoding its fingerprint covers) or may answer with (the replay marker):
/// an adapter makes its framework's names of these once, not per request.
pub const KEYED_REQUEST_HEADERS: [&str; 4] = [
    crate::KEY_HEADER,
    REPLAYED_HEADER,
    "content-type",
    "content-encoding",
];

/// The position of `name` in [`KEYED_REQUEST_HEADERS`], if it is one of them.
pub fn keyed_request_header(name: &str) -> Option<usize> {
    KEYED_REQUEST_HEADERS
        .iter()
        .position(|known| *known == name)
}

impl Header {
    /// A header field; the name is lower-cased (a name that already is, as a
    /// `&'static str` or a `String`, is kept as it is, without a copy).
    pub fn new(name: impl Into<Cow<'static, str>>, value: impl Into<Bytes>) -> Self {
        let mut name = name.into();
        if name.bytes().any(|b| b.is_ascii_uppercase()) {
            name.to_mut().make_ascii_lowercase();
        }
        Self {
            name,
            value: value.into(),
        }
    }

    /// A header field whose name is borrowed from a request or response being
    /// converted: a common name is shared, any other copied (lower-cased).
    /// For adapters ([`adapter`](crate::adapter)); an application uses
    /// [`new`](Self::new).
    #[doc(hidden)]
    pub fn named(name: &str, value: impl Into<Bytes>) -> Self {
        match common_name(name.as_bytes()) {
            Some(name) => Self {
                name: Cow::Borrowed(name),
                value: value.into(),
            },
            None => Self::new(name.to_owned(), value),
        }
    }
}

/// `name` as one of the header names responses carry most, if it is one.
fn common_name(name: &[u8]) -> Option<&'static str> {
    // Beside the names every keyed request uses (one list, the adapters' too).
    const MORE: [&str; 13] = [
        "content-length",
        "content-language",
        "content-location",
        "location",
        "cache-control",
        "etag",
        "last-modified",
        "expires",
        "vary",
        "set-cookie",
        "link",
        "retry-after",
        "x-request-id",
    ];
    KEYED_REQUEST_HEADERS
        .into_iter()
        .chain(MORE)
        .find(|common| common.as_bytes() == name)
}

impl StoredResponse {
    /// A replayable response.
    pub fn new(status: u16, headers: Vec<Header>, body: impl Into<Bytes>) -> Self {
        Self {
            status,
            headers,
            body: body.into(),
            replayable: true,
        }
    }

    /// A response whose body was too large to keep: status and headers only.
    pub fn without_body(status: u16, headers: Vec<Header>) -> Self {
        Self {
            status,
            headers,
            body: Bytes::new(),
            replayable: false,
        }
    }

    /// The values of every field named `name` (case-insensitive), in order.
    pub fn header_values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.headers
            .iter()
            .filter(move |h| h.name.eq_ignore_ascii_case(name))
            .map(|h| h.value.as_ref())
    }

    /// Encodes the header list into one byte string, for stores that keep it in a
    /// single column. Each name and value is prefixed by its length (u32, big-endian).
    pub fn encode_headers(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_headers_len());
        self.encode_headers_into(&mut out);
        out
    }

    /// The length of [`encode_headers`](Self::encode_headers)' answer.
    pub(crate) fn encoded_headers_len(&self) -> usize {
        self.headers
            .iter()
            .map(|h| 8 + h.name.len() + h.value.len())
            .sum()
    }

    /// Appends [`encode_headers`](Self::encode_headers)' answer to `out`.
    pub(crate) fn encode_headers_into(&self, out: &mut Vec<u8>) {
        for h in &self.headers {
            for part in [h.name.as_bytes(), h.value.as_ref()] {
                out.extend_from_slice(&(part.len() as u32).to_be_bytes());
                out.extend_from_slice(part);
            }
        }
    }

    /// Decodes what [`encode_headers`](Self::encode_headers) wrote; `None` if the
    /// bytes are not such an encoding.
    pub fn decode_headers(bytes: &[u8]) -> Option<Vec<Header>> {
        walk_headers(bytes, |value| Bytes::copy_from_slice(&bytes[value]))
    }

    /// [`decode_headers`](Self::decode_headers) of the encoding at `within` in a
    /// shared buffer: the values are slices of `bytes`, not copies.
    pub(crate) fn decode_shared_headers(
        bytes: &Bytes,
        within: std::ops::Range<usize>,
    ) -> Option<Vec<Header>> {
        let offset = within.start;
        walk_headers(bytes.get(within)?, |value| {
            bytes.slice(offset + value.start..offset + value.end)
        })
    }
}

/// The fields of a header encoding, each value made by `value` from its range in
/// `bytes`.
fn walk_headers(
    bytes: &[u8],
    mut value: impl FnMut(std::ops::Range<usize>) -> Bytes,
) -> Option<Vec<Header>> {
    /// The range of the next length-prefixed part at `*at`, which moves past it.
    fn part(bytes: &[u8], at: &mut usize) -> Option<std::ops::Range<usize>> {
        let (len, _) = bytes.get(*at..)?.split_first_chunk::<4>()?;
        let start = *at + 4;
        let end = start.checked_add(u32::from_be_bytes(*len) as usize)?;
        if end > bytes.len() {
            return None;
        }
        *at = end;
        Some(start..end)
    }
    // Counted first, so that the list is allocated once: at its size, and one
    // more for the replay marker a replayed answer gains.
    let (mut fields, mut at) = (0, 0);
    while at < bytes.len() {
        part(bytes, &mut at)?;
        part(bytes, &mut at)?;
        fields += 1;
    }
    let mut headers = Vec::with_capacity(fields + 1);
    let mut at = 0;
    while at < bytes.len() {
        let name = &bytes[part(bytes, &mut at)?];
        let value = value(part(bytes, &mut at)?);
        // A common name is known valid; any other is checked.
        headers.push(match common_name(name) {
            Some(name) => Header {
                name: Cow::Borrowed(name),
                value,
            },
            None => Header::new(std::str::from_utf8(name).ok()?.to_owned(), value),
        });
    }
    Some(headers)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn header_encoding_round_trips_repeats_and_binary_values() {
        let response = StoredResponse::new(
            201,
            vec![
                Header::new("Set-Cookie", "a=1"),
                Header::new("set-cookie", "b=2"),
                Header::new("x-bin", Bytes::from_static(&[0, 255, 10, 13])),
                Header::new("x-empty", ""),
            ],
            "{}",
        );
        let decoded = StoredResponse::decode_headers(&response.encode_headers());
        assert_eq!(decoded, Some(response.headers.clone()));
        assert_eq!(
            response.header_values("SET-COOKIE").collect::<Vec<_>>(),
            vec![b"a=1".as_ref(), b"b=2".as_ref()]
        );
    }

    #[test]
    fn common_names_are_shared_and_keyed_request_headers_found() {
        let named = Header::named("content-type", "text/plain");
        assert!(matches!(named.name, Cow::Borrowed("content-type")));
        let location = Header::named("location", "/orders/7").name;
        assert!(matches!(location, Cow::Borrowed("location")));
        assert!(matches!(Header::named("x-own", "1").name, Cow::Owned(_)));
        assert_eq!(Header::new("X-Own", "1").name, "x-own");
        assert_eq!(keyed_request_header(REPLAYED_HEADER), Some(1));
        assert_eq!(keyed_request_header("idempotency-key"), Some(0));
        assert_eq!(keyed_request_header("x-own"), None);
    }

    #[test]
    fn truncated_header_encoding_is_rejected() {
        let response = StoredResponse::new(200, vec![Header::new("a", "bc")], "");
        let bytes = response.encode_headers();
        assert_eq!(
            StoredResponse::decode_headers(&bytes[..bytes.len() - 1]),
            None
        );
    }
}
