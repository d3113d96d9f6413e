//! The `Idempotency-Key` header: parsing and validation (`docs/contract.md` §2).

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
#[non_exhaustive]
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
    ///
    /// Surrounding spaces and tabs are dropped. A value that then starts with `"` is
    /// a Structured Field String (RFC 9651; parameters after it are ignored); any
    /// other value is the key itself (a bare key), which may hold inner spaces but
    /// no comma. A key that starts with `"` is therefore sent quoted.
    /// Control characters are refused before anything else, then bytes outside
    /// ASCII.
    ///
    /// ```
    /// use idem_core::{IdempotencyKey, KeyError};
    ///
    /// assert_eq!(IdempotencyKey::parse(b"\"ab c\"")?.as_str(), "ab c");
    /// assert_eq!(IdempotencyKey::parse(b"  order-17 ")?.as_str(), "order-17");
    /// assert_eq!(IdempotencyKey::parse(b"a, b"), Err(KeyError::Comma));
    /// assert_eq!(IdempotencyKey::parse(b"\"\""), Err(KeyError::Empty));
    /// # Ok::<(), KeyError>(())
    /// ```
    pub fn parse(value: &[u8]) -> Result<Self, KeyError> {
        let value = trim_field_whitespace(value);
        if value.is_empty() {
            return Err(KeyError::Empty);
        }
        check_bytes(value)?;
        // `check_bytes` let only 0x20–0x7E through.
        let value = std::str::from_utf8(value).map_err(|_| KeyError::NonAscii)?;
        if value.starts_with('"') {
            return Self::from_sf_string(value);
        }
        if value.contains(',') {
            return Err(KeyError::Comma);
        }
        Self::checked(value)
    }

    /// A key that is already known to be valid, taken verbatim: 1 to 255 printable
    /// ASCII characters. Stores rebuild keys with it, so every key
    /// [`parse`](Self::parse) yields (a quoted one may hold commas or start with a
    /// space) is accepted back unchanged.
    ///
    /// ```
    /// use idem_core::IdempotencyKey;
    ///
    /// let key = IdempotencyKey::parse(br#"" a, \"b\" ""#)?;
    /// assert_eq!(key.as_str(), r#" a, "b" "#);
    /// assert_eq!(IdempotencyKey::new(key.as_str())?, key);
    /// # Ok::<(), idem_core::KeyError>(())
    /// ```
    pub fn new(key: &str) -> Result<Self, KeyError> {
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        check_bytes(key.as_bytes())?;
        Self::checked(key)
    }

    /// The key of a value that starts with `"`: it must be one sf String.
    fn from_sf_string(value: &str) -> Result<Self, KeyError> {
        let item: sfv::Item = sfv::Parser::new(value)
            .parse()
            .map_err(|e| KeyError::Syntax(e.to_string()))?;
        match item.bare_item {
            sfv::BareItem::String(key) if key.as_str().is_empty() => Err(KeyError::Empty),
            sfv::BareItem::String(key) => Self::checked(key.as_str()),
            // A value starting with `"` can only parse as a String, but the type
            // system does not know that.
            other => Err(KeyError::Syntax(format!(
                "expected a string, found {}",
                bare_item_kind(&other)
            ))),
        }
    }

    /// A key whose bytes are known to be printable ASCII: checks its length.
    fn checked(key: &str) -> Result<Self, KeyError> {
        if key.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong(key.len()));
        }
        Ok(Self(Arc::from(key)))
    }

    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A form of the key that is safe to log: a prefix of at most four
    /// characters and at most half the key (none for keys of four characters
    /// or fewer), an ellipsis, and its length: `8e03…(36)`, `ab…(5)`, `…(3)`.
    /// The whole key never reaches a log, however short.
    pub fn redacted(&self) -> Redacted<'_> {
        Redacted(self.as_str())
    }
}

/// Refuses control characters first, then bytes outside ASCII.
fn check_bytes(value: &[u8]) -> Result<(), KeyError> {
    if value.iter().any(|&b| b < 0x20 || b == 0x7f) {
        return Err(KeyError::ControlCharacter);
    }
    if !value.is_ascii() {
        return Err(KeyError::NonAscii);
    }
    Ok(())
}

/// Drops the whitespace HTTP allows around a field value: SP and HTAB (not CR or
/// LF, which stay control characters).
fn trim_field_whitespace(value: &[u8]) -> &[u8] {
    let is_ws = |b: &u8| matches!(b, b' ' | b'\t');
    let start = value.iter().position(|b| !is_ws(b)).unwrap_or(value.len());
    let end = value
        .iter()
        .rposition(|b| !is_ws(b))
        .map_or(start, |i| i + 1);
    &value[start..end]
}

/// The name of a bare item's type, for syntax errors.
fn bare_item_kind(item: &sfv::BareItem) -> &'static str {
    match item {
        sfv::BareItem::Decimal(_) => "a decimal",
        sfv::BareItem::Integer(_) => "an integer",
        sfv::BareItem::String(_) => "a string",
        sfv::BareItem::ByteSequence(_) => "a byte sequence",
        sfv::BareItem::Boolean(_) => "a boolean",
        sfv::BareItem::Token(_) => "a token",
        sfv::BareItem::Date(_) => "a date",
        sfv::BareItem::DisplayString(_) => "a display string",
    }
}

/// A key as it may appear in logs. See [`IdempotencyKey::redacted`].
#[derive(Clone, Copy)]
pub struct Redacted<'a>(&'a str);

impl<'a> Redacted<'a> {
    /// Any identifier a client or producer chose (a message id, say), redacted
    /// as a key is. It need not be ASCII: the prefix is cut at a character
    /// boundary, and the length is in bytes.
    pub fn of(id: &'a str) -> Self {
        Self(id)
    }

    /// Keys up to this length show no prefix at all.
    const HIDDEN_UP_TO: usize = 4;
    /// The longest prefix shown.
    const SHOWN: usize = 4;
}

impl fmt::Display for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let key = self.0;
        let shown = if key.len() <= Redacted::HIDDEN_UP_TO {
            ""
        } else {
            // Keys are ASCII (a byte is a character); another id is cut at
            // the character boundary at or below the bound.
            crate::log::cut(key, Redacted::SHOWN.min(key.len() / 2))
        };
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn parsed(value: &str) -> String {
        IdempotencyKey::parse(value.as_bytes())
            .unwrap()
            .as_str()
            .to_owned()
    }

    fn rejected(value: &[u8]) -> KeyError {
        IdempotencyKey::parse(value).unwrap_err()
    }

    /// Serializes `key` as an sf String: quoted, `"` and `\` escaped.
    fn sf_string(key: &str) -> String {
        let mut out = String::from("\"");
        for c in key.chars() {
            if matches!(c, '"' | '\\') {
                out.push('\\');
            }
            out.push(c);
        }
        out.push('"');
        out
    }

    #[test]
    fn bare_key_is_taken_as_is() {
        assert_eq!(
            parsed("8e03978e-40d5-43e8-bc93-6894a57f9324"),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
        assert_eq!(parsed("a"), "a");
        assert_eq!(
            parsed("~!#$%&'()*+-./:;<=>?@[]^_`{|}"),
            "~!#$%&'()*+-./:;<=>?@[]^_`{|}"
        );
    }

    #[test]
    fn bare_key_keeps_inner_spaces_and_quotes() {
        assert_eq!(parsed("order 17 retry"), "order 17 retry");
        assert_eq!(parsed("a\"b\\c"), "a\"b\\c");
    }

    #[test]
    fn surrounding_spaces_and_tabs_are_not_part_of_the_key() {
        assert_eq!(parsed("  abc \t"), "abc");
        assert_eq!(parsed("\t\"abc\"  "), "abc");
    }

    #[test]
    fn sf_string_is_unquoted_and_unescaped() {
        assert_eq!(parsed(r#""abc""#), "abc");
        assert_eq!(parsed(r#""a \"quoted\" \\ key""#), r#"a "quoted" \ key"#);
        assert_eq!(parsed(r#"" padded ""#), " padded ");
        assert_eq!(parsed(r#""a, b""#), "a, b");
    }

    #[test]
    fn sf_string_parameters_are_ignored() {
        assert_eq!(parsed(r#""abc";v=1;x"#), "abc");
    }

    #[test]
    fn longest_key_is_accepted() {
        let bare = "k".repeat(MAX_KEY_LEN);
        assert_eq!(parsed(&bare), bare);
        assert_eq!(parsed(&sf_string(&bare)), bare);
    }

    #[test]
    fn empty_values_are_rejected_as_empty() {
        assert_eq!(rejected(b""), KeyError::Empty);
        assert_eq!(rejected(b"   "), KeyError::Empty);
        assert_eq!(rejected(b" \t "), KeyError::Empty);
        assert_eq!(rejected(br#""""#), KeyError::Empty);
        assert_eq!(rejected(br#" "" "#), KeyError::Empty);
    }

    #[test]
    fn comma_in_bare_value_is_rejected_as_comma() {
        assert_eq!(rejected(b"a,b"), KeyError::Comma);
        assert_eq!(rejected(b"abc, def"), KeyError::Comma);
        assert_eq!(rejected(b","), KeyError::Comma);
    }

    #[test]
    fn control_characters_are_rejected_as_control_character() {
        for value in [
            &b"a\x00b"[..],
            b"a\nb",
            b"a\r\n",
            b"\x1fabc",
            b"ab\x7f",
            b"a\tb",
        ] {
            assert_eq!(rejected(value), KeyError::ControlCharacter, "{value:?}");
        }
        // Before sf parsing, so a quoted value gets the same answer.
        assert_eq!(rejected(b"\"a\x01b\""), KeyError::ControlCharacter);
        // Before the non-ASCII check.
        assert_eq!(rejected(b"\xc3\xa9\x00"), KeyError::ControlCharacter);
    }

    #[test]
    fn non_ascii_is_rejected_as_non_ascii() {
        assert_eq!(rejected("café".as_bytes()), KeyError::NonAscii);
        assert_eq!(rejected(b"\xff"), KeyError::NonAscii);
        assert_eq!(rejected("\"café\"".as_bytes()), KeyError::NonAscii);
    }

    #[test]
    fn long_keys_are_rejected_with_their_length() {
        assert_eq!(rejected("k".repeat(256).as_bytes()), KeyError::TooLong(256));
        assert_eq!(
            rejected(sf_string(&"k".repeat(300)).as_bytes()),
            KeyError::TooLong(300)
        );
        // The length of the key, not of its escaped form.
        let escaped = sf_string(&"\"".repeat(200));
        assert_eq!(parsed(&escaped), "\"".repeat(200));
    }

    #[test]
    fn bad_sf_syntax_is_rejected_as_syntax() {
        for value in [
            &br#""abc"#[..],
            br#""abc" trailing"#,
            br#""a\x""#,
            br#""abc", "def""#,
            br#""abc";"#,
            br#""abc";A=1"#,
        ] {
            assert!(
                matches!(rejected(value), KeyError::Syntax(_)),
                "{:?} gave {:?}",
                String::from_utf8_lossy(value),
                IdempotencyKey::parse(value),
            );
        }
    }

    #[test]
    fn more_than_one_field_is_rejected() {
        let fields = [&b"a"[..], b"b"];
        assert_eq!(
            IdempotencyKey::from_fields(fields),
            Err(KeyError::MultipleFields)
        );
        assert_eq!(IdempotencyKey::from_fields(std::iter::empty()), Ok(None));
        assert_eq!(
            IdempotencyKey::from_fields([&b"\"abc\""[..]]),
            Ok(Some(IdempotencyKey::new("abc").unwrap()))
        );
    }

    #[test]
    fn new_takes_a_valid_key_verbatim() {
        assert_eq!(
            IdempotencyKey::new(" a, \"b\" ").unwrap().as_str(),
            " a, \"b\" "
        );
        assert_eq!(IdempotencyKey::new(""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::new("a\tb"), Err(KeyError::ControlCharacter));
        assert_eq!(IdempotencyKey::new("é"), Err(KeyError::NonAscii));
        assert_eq!(
            IdempotencyKey::new(&"k".repeat(256)),
            Err(KeyError::TooLong(256))
        );
    }

    #[test]
    fn redacted_form_hides_all_but_four_characters() {
        let key = IdempotencyKey::new("8e03978e-40d5").unwrap();
        assert_eq!(key.redacted().to_string(), "8e03…(13)");
        assert_eq!(format!("{key:?}"), "IdempotencyKey(8e03…(13))");
        let redacted = |key: &str| IdempotencyKey::new(key).unwrap().redacted().to_string();
        assert_eq!(redacted("?"), "…(1)");
        assert_eq!(redacted("?1"), "…(2)");
        assert_eq!(redacted("abc"), "…(3)");
        assert_eq!(redacted("abcd"), "…(4)");
        assert_eq!(redacted("abcde"), "ab…(5)");
        assert_eq!(redacted("abcdefg"), "abc…(7)");
        assert_eq!(redacted("abcdefgh"), "abcd…(8)");
    }

    proptest! {
        /// The shown prefix is never more than half the key, nor four
        /// characters, and never the whole key.
        #[test]
        fn redacted_form_never_shows_half_the_key(key in bare_key(1..=64)) {
            let shown = IdempotencyKey::new(&key).unwrap().redacted().to_string();
            let (prefix, rest) = shown.split_once('…').unwrap();
            prop_assert!(prefix.len() <= 4 && prefix.len() <= key.len() / 2);
            prop_assert!(key.starts_with(prefix));
            prop_assert_eq!(rest, format!("({})", key.len()));
        }
    }

    /// Printable ASCII without a comma, not starting or ending with a space, and not
    /// starting with `"` (which would make it an sf String).
    fn bare_key(len: std::ops::RangeInclusive<usize>) -> impl Strategy<Value = String> {
        let first = "[\\x21\\x23-\\x2b\\x2d-\\x7e]";
        let inner = "[\\x20-\\x2b\\x2d-\\x7e]";
        let last = "[\\x21-\\x2b\\x2d-\\x7e]";
        len.prop_flat_map(move |len| match len {
            1 => proptest::string::string_regex(first).unwrap().boxed(),
            n => proptest::string::string_regex(&format!("{first}{inner}{{{}}}{last}", n - 2))
                .unwrap()
                .boxed(),
        })
    }

    proptest! {
        #[test]
        fn any_bare_key_parses_to_itself(key in bare_key(1..=MAX_KEY_LEN)) {
            let parsed = IdempotencyKey::parse(key.as_bytes()).unwrap();
            prop_assert_eq!(parsed.as_str(), key.as_str());
        }

        #[test]
        fn any_sf_string_parses_to_its_content(key in "[\\x20-\\x7e]{1,255}") {
            let parsed = IdempotencyKey::parse(sf_string(&key).as_bytes()).unwrap();
            prop_assert_eq!(parsed.as_str(), key.as_str());
            // Stores rebuild it verbatim.
            prop_assert_eq!(IdempotencyKey::new(parsed.as_str()).unwrap(), parsed);
        }

        #[test]
        fn any_control_byte_is_rejected(
            mut value in proptest::collection::vec(any::<u8>(), 0..300),
            control in prop_oneof![0x00u8..=0x08, 0x0au8..=0x1f, Just(0x7fu8)],
            at in any::<prop::sample::Index>(),
        ) {
            value.insert(at.index(value.len() + 1), control);
            prop_assert_eq!(IdempotencyKey::parse(&value), Err(KeyError::ControlCharacter));
        }

        #[test]
        fn inner_tab_is_rejected(head in bare_key(1..=10), tail in bare_key(1..=10)) {
            let value = format!("{head}\t{tail}");
            prop_assert_eq!(IdempotencyKey::parse(value.as_bytes()), Err(KeyError::ControlCharacter));
        }

        #[test]
        fn keys_over_255_are_too_long(key in bare_key(256..=399)) {
            prop_assert_eq!(IdempotencyKey::parse(key.as_bytes()), Err(KeyError::TooLong(key.len())));
            prop_assert_eq!(
                IdempotencyKey::parse(sf_string(&key).as_bytes()),
                Err(KeyError::TooLong(key.len()))
            );
        }
    }
}
