//! The Redis key of a record.

use idem_core::{IdempotencyKey, Scope};

/// `PREFIX{LEN:SCOPE:KEY}`: the scope's length in bytes, the scope, the key.
///
/// The length makes the encoding injective (no scope/key pair reads as
/// another: `("a:b", "c")` is `{3:a:b:c}`, `("a", "b:c")` is `{1:a:b:c}`).
/// The braces are the record's hash tag: every key of one record (there is one
/// today) lands in one cluster slot, and records spread over the slots. A `}`
/// in the scope or key ends the tag early, the same way for every key of that
/// record, so it stays one slot.
pub(crate) fn record_key(prefix: &str, scope: &Scope, key: &IdempotencyKey) -> Vec<u8> {
    let scope = scope.as_str();
    let key = key.as_str();
    let length = scope.len().to_string();
    let mut out = Vec::with_capacity(prefix.len() + length.len() + scope.len() + key.len() + 4);
    out.extend_from_slice(prefix.as_bytes());
    out.push(b'{');
    out.extend_from_slice(length.as_bytes());
    out.push(b':');
    out.extend_from_slice(scope.as_bytes());
    out.push(b':');
    out.extend_from_slice(key.as_bytes());
    out.push(b'}');
    out
}

/// The `SCAN MATCH` pattern of every record under `prefix`: the prefix with its
/// glob characters escaped, then `{*`.
pub(crate) fn records_pattern(prefix: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(prefix.len() * 2 + 2);
    for byte in prefix.bytes() {
        if matches!(byte, b'*' | b'?' | b'[' | b']' | b'\\') {
            out.push(b'\\');
        }
        out.push(byte);
    }
    out.extend_from_slice(b"{*");
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn encoded(scope: &str, key: &str) -> String {
        String::from_utf8(record_key(
            "idem:",
            &Scope::new(scope),
            &IdempotencyKey::new(key).unwrap(),
        ))
        .unwrap()
    }

    #[test]
    fn scope_and_key_cannot_collide() {
        assert_eq!(encoded("a:b", "c"), "idem:{3:a:b:c}");
        assert_eq!(encoded("a", "b:c"), "idem:{1:a:b:c}");
        assert_ne!(encoded("", "1:a"), encoded("1:a", "a"));
        assert_eq!(encoded("", "k"), "idem:{0::k}");
    }

    #[test]
    fn the_pattern_escapes_glob_characters() {
        assert_eq!(records_pattern("a*b?[c]\\"), b"a\\*b\\?\\[c\\]\\\\{*");
    }
}
