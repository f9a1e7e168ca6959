//! Where a call's idempotency key is: in its metadata, or in a field of its message.

use bytes::{Buf, Bytes};

use super::protowire::{fields, Malformed, Value};
use http::header::{HeaderName, HeaderValue};

/// Where the server layer reads a call's key.
///
/// ```
/// use tower_idempotency::grpc::KeySource;
///
/// // The default: metadata `idempotency-key`, as the client layer sends it.
/// let _ = KeySource::default();
/// // AIP-155: `string request_id = 1;` in the request message.
/// let _ = KeySource::field(1);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeySource {
    /// A metadata entry (ASCII), read with the server face's `Idempotency-Key` syntax: one
    /// bare token or one quoted string of 1 to 255 visible ASCII characters.
    Metadata(HeaderName),
    /// A top-level `string` field of the request message, by field number (AIP-155's
    /// `request_id`, AEP-155's `idempotency_key`): 1 to 255 visible ASCII characters. A
    /// message sent compressed is refused with `INVALID_ARGUMENT`: its fields cannot be
    /// read without decompressing it.
    Field(u32),
}

impl Default for KeySource {
    fn default() -> Self {
        Self::Metadata(HeaderName::from_static("idempotency-key"))
    }
}

impl KeySource {
    /// The key in metadata entry `name`.
    ///
    /// # Panics
    ///
    /// If `name` is not a valid lower-case metadata name.
    pub fn metadata(name: &'static str) -> Self {
        Self::Metadata(HeaderName::from_static(name))
    }

    /// The key in the request message's top-level `string` field number `number`.
    pub fn field(number: u32) -> Self {
        Self::Field(number)
    }
}

/// Why a message's key field could not be read.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum FieldKeyError {
    /// The body is not one uncompressed gRPC message.
    Unreadable(&'static str),
    /// The field is absent or empty.
    Missing,
}

/// The `string` field `number` of the single message in a unary request `body` (the 5-byte
/// gRPC prefix, then the message), as a header value quoted as an RFC 8941 sf-string, so
/// that the server face reads it with its one key syntax. The last occurrence wins, as
/// protobuf decoders read a repeated scalar.
pub(super) fn field_key(body: &Bytes, number: u32) -> Result<HeaderValue, FieldKeyError> {
    let message = single_message(body)?;
    let value = last_string_field(message, number)?.ok_or(FieldKeyError::Missing)?;
    if value.is_empty() {
        return Err(FieldKeyError::Missing);
    }
    quoted(&value).ok_or(FieldKeyError::Unreadable("the key is not visible ASCII"))
}

/// The single uncompressed message of a unary request `body`, without its 5-byte prefix.
pub(super) fn single_message(body: &Bytes) -> Result<Bytes, FieldKeyError> {
    let mut rest = body.clone();
    if rest.len() < 5 {
        return Err(FieldKeyError::Unreadable("no gRPC message"));
    }
    if rest.get_u8() != 0 {
        return Err(FieldKeyError::Unreadable(
            "the message is compressed: send the key in metadata",
        ));
    }
    let len = rest.get_u32() as usize;
    if rest.len() != len {
        return Err(FieldKeyError::Unreadable("not exactly one gRPC message"));
    }
    Ok(rest)
}

/// The last length-delimited occurrence of field `number` in `message`.
fn last_string_field(message: Bytes, number: u32) -> Result<Option<Bytes>, FieldKeyError> {
    let fields = fields(message)
        .map_err(|Malformed| FieldKeyError::Unreadable("the message is malformed"))?;
    Ok(fields
        .into_iter()
        .rev()
        .find_map(|(field, value)| match value {
            Value::Delimited(bytes) if field == u64::from(number) => Some(bytes),
            _ => None,
        }))
}

/// `value` as an RFC 8941 sf-string (`"` and `\` escaped), if it is visible ASCII or space.
fn quoted(value: &[u8]) -> Option<HeaderValue> {
    let mut out = Vec::with_capacity(value.len() + 2);
    out.push(b'"');
    for &byte in value {
        if !(0x20..0x7f).contains(&byte) {
            return None;
        }
        if byte == b'"' || byte == b'\\' {
            out.push(b'\\');
        }
        out.push(byte);
    }
    out.push(b'"');
    HeaderValue::from_bytes(&out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A unary request body: the gRPC prefix, then `message`.
    fn framed(message: &[u8]) -> Bytes {
        let mut body = vec![0];
        body.extend_from_slice(&(message.len() as u32).to_be_bytes());
        body.extend_from_slice(message);
        body.into()
    }

    /// Field `number` as a length-delimited `value`.
    fn string_field(number: u8, value: &str) -> Vec<u8> {
        let mut out = vec![number << 3 | 2, value.len() as u8];
        out.extend_from_slice(value.as_bytes());
        out
    }

    #[test]
    fn the_key_field_is_found_among_fields_of_every_wire_type() {
        let mut message = vec![0x10, 0x96, 0x01]; // field 2, varint 150
        message.extend([0x19, 1, 2, 3, 4, 5, 6, 7, 8]); // field 3, fixed64
        message.extend([0x25, 1, 2, 3, 4]); // field 4, fixed32
        message.extend(string_field(5, "other"));
        message.extend(string_field(1, "req-42"));

        let key = field_key(&framed(&message), 1).unwrap();

        assert_eq!(key, "\"req-42\"");
    }

    #[test]
    fn the_last_occurrence_wins_and_quotes_are_escaped() {
        let mut message = string_field(1, "first");
        message.extend(string_field(1, "a\"b"));
        assert_eq!(field_key(&framed(&message), 1).unwrap(), r#""a\"b""#);
    }

    #[test]
    fn missing_empty_compressed_and_malformed_keys_are_refused() {
        assert_eq!(field_key(&framed(&[]), 1), Err(FieldKeyError::Missing));
        assert_eq!(
            field_key(&framed(&string_field(1, "")), 1),
            Err(FieldKeyError::Missing)
        );
        let mut compressed = framed(&string_field(1, "k")).to_vec();
        compressed[0] = 1;
        assert!(matches!(
            field_key(&compressed.into(), 1),
            Err(FieldKeyError::Unreadable(_))
        ));
        assert!(matches!(
            field_key(&framed(&[0x0a, 9, b'x']), 1),
            Err(FieldKeyError::Unreadable(_))
        ));
        assert!(matches!(
            field_key(&framed(&string_field(1, "caf\u{e9}")), 1),
            Err(FieldKeyError::Unreadable(_))
        ));
    }
}
