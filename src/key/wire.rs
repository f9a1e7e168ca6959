//! How a key travels to a provider: the header that carries it and the form of its value.

use http::header::{HeaderMap, HeaderName, HeaderValue};

use super::grammar::bare_token;
use super::{HeaderKey, IdempotencyKey, InvalidKey, IDEMPOTENCY_KEY, MAX_KEY_LEN};

/// How a key is written in its header's value.
///
/// ```
/// use tower_idempotency::key::{KeyForm, KeyHeader};
///
/// let quoted = KeyHeader::ietf().spell("order-42").unwrap();
/// let bare = KeyHeader::stripe().spell("order-42").unwrap();
/// assert_eq!(quoted, "\"order-42\"");
/// assert_eq!(bare, "order-42");
/// assert_eq!(KeyHeader::ietf().form(), KeyForm::SfString);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyForm {
    /// An RFC 8941 sf-string, `"<key>"`, as the IETF draft
    /// (draft-ietf-httpapi-idempotency-key-header) defines the header.
    SfString,
    /// The key's characters alone, `<key>`: what Stripe, Adyen, Checkout.com and PayPal
    /// document. A provider that keeps the value as it arrives would keep the quotes of an
    /// sf-string as part of the key, and never match a lookup of the key without them.
    Token,
}

/// Where a provider reads an idempotency key: the header's name and the form of its value.
///
/// Providers name and spell the key differently. The client face sends a key derived from
/// an [`OperationId`](crate::OperationId) under this header in this form, reads a caller's
/// own key from this header, and everything that reads the key back follows the same
/// setting: the [`FrozenRetryLayer`](crate::FrozenRetryLayer) (a request carrying the key
/// is safe to resend to a provider that deduplicates) and the reconcilers
/// ([`InDoubtOperation::sent_key`](crate::idempotency::InDoubtOperation::sent_key) is the
/// value exactly as it was sent).
///
/// | preset | header | form |
/// |---|---|---|
/// | [`ietf`](Self::ietf) (the default) | `Idempotency-Key` | sf-string, `"<key>"` |
/// | [`stripe`](Self::stripe) | `Idempotency-Key` | token |
/// | [`adyen`](Self::adyen) | `Idempotency-Key` | token |
/// | [`checkout_com`](Self::checkout_com) | `Cko-Idempotency-Key` | token |
/// | [`paypal`](Self::paypal) | `PayPal-Request-Id` | token |
///
/// A key carried in the request body is not covered: put it there yourself, from
/// [`IdempotencyKey::to_hex`](crate::IdempotencyKey::to_hex).
///
/// ```
/// use http::HeaderName;
/// use tower_idempotency::key::{KeyForm, KeyHeader};
///
/// let paypal = KeyHeader::paypal();
/// assert_eq!(paypal.name(), "paypal-request-id");
/// assert_eq!(paypal.form(), KeyForm::Token);
///
/// let own = KeyHeader::new(HeaderName::from_static("x-request-key"), KeyForm::Token);
/// let mut headers = http::HeaderMap::new();
/// headers.insert("x-request-key", own.spell("order-42").unwrap());
/// assert_eq!(own.sent_value(&headers).unwrap(), "order-42");
/// assert_eq!(own.read(&headers).unwrap().unwrap().as_str(), "order-42");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KeyHeader {
    name: HeaderName,
    form: KeyForm,
}

impl Default for KeyHeader {
    /// [`KeyHeader::ietf`].
    fn default() -> Self {
        Self::ietf()
    }
}

impl KeyHeader {
    /// The key under `name`, written in `form`.
    pub fn new(name: HeaderName, form: KeyForm) -> Self {
        Self { name, form }
    }

    /// `Idempotency-Key: "<key>"`, the IETF draft's header and form (the default).
    pub fn ietf() -> Self {
        Self::new(IDEMPOTENCY_KEY.clone(), KeyForm::SfString)
    }

    /// `Idempotency-Key: <key>`, as Stripe documents it.
    pub fn stripe() -> Self {
        Self::new(IDEMPOTENCY_KEY.clone(), KeyForm::Token)
    }

    /// `Idempotency-Key: <key>`, as Adyen documents it.
    pub fn adyen() -> Self {
        Self::new(IDEMPOTENCY_KEY.clone(), KeyForm::Token)
    }

    /// `Cko-Idempotency-Key: <key>`, as Checkout.com documents it.
    pub fn checkout_com() -> Self {
        Self::new(
            HeaderName::from_static("cko-idempotency-key"),
            KeyForm::Token,
        )
    }

    /// `PayPal-Request-Id: <key>`, as PayPal documents it.
    pub fn paypal() -> Self {
        Self::new(HeaderName::from_static("paypal-request-id"), KeyForm::Token)
    }

    /// The header's name.
    pub fn name(&self) -> &HeaderName {
        &self.name
    }

    /// The form of the header's value.
    pub fn form(&self) -> KeyForm {
        self.form
    }

    /// The header value that carries a key made of `key`'s characters: quoted and escaped
    /// as an sf-string, or bare. A key the form cannot carry (empty, longer than
    /// [`MAX_KEY_LEN`], not visible ASCII, or, bare, holding a delimiter) is refused.
    ///
    /// ```
    /// # use tower_idempotency::key::KeyHeader;
    /// assert_eq!(KeyHeader::ietf().spell("a\"b").unwrap(), "\"a\\\"b\"");
    /// assert!(KeyHeader::stripe().spell("a,b").is_err());
    /// ```
    pub fn spell(&self, key: &str) -> Result<HeaderValue, InvalidKey> {
        if key.is_empty() {
            return Err(InvalidKey::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(InvalidKey::TooLong { len: key.len() });
        }
        if let Some(byte) = key.bytes().find(|byte| !(0x21..=0x7e).contains(byte)) {
            return Err(InvalidKey::InvalidCharacter { byte });
        }
        let spelled = match self.form {
            KeyForm::Token => {
                bare_token(key.as_bytes())?;
                key.to_owned()
            }
            KeyForm::SfString => {
                let mut quoted = String::with_capacity(key.len() + 2);
                quoted.push('"');
                for char in key.chars() {
                    if matches!(char, '"' | '\\') {
                        quoted.push('\\');
                    }
                    quoted.push(char);
                }
                quoted.push('"');
                quoted
            }
        };
        Ok(HeaderValue::from_str(&spelled).expect("visible ASCII, checked above"))
    }

    /// The value a derived key travels as: its 64 hex digits in this form. Hex digits are
    /// a token and need no escape, so nothing can be refused.
    pub(crate) fn derived_value(&self, key: &IdempotencyKey) -> HeaderValue {
        match self.form {
            KeyForm::SfString => key.header_value(),
            KeyForm::Token => {
                let quoted = key.quoted();
                let mut bare = [0; 64];
                bare.copy_from_slice(&quoted[1..65]);
                super::shared_header_value(bare)
            }
        }
    }

    /// The key a request carries under this header, whichever form it was written in (a
    /// caller's own key): `Ok(None)` when absent, an error when repeated or malformed.
    pub fn read(&self, headers: &HeaderMap) -> Result<Option<HeaderKey>, InvalidKey> {
        HeaderKey::from_values(headers.get_all(&self.name).iter())
    }

    /// The header's value exactly as the request carries it (quotes and all): what a
    /// provider that keeps the value as it arrives has stored.
    pub fn sent_value<'a>(&self, headers: &'a HeaderMap) -> Option<&'a HeaderValue> {
        headers.get(&self.name)
    }

    /// Whether the request carries a key under this header.
    pub(crate) fn is_carried_by(&self, headers: &HeaderMap) -> bool {
        headers.contains_key(&self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_derived_key_in_each_form() {
        let key = IdempotencyKey::derive("", "task", "step");
        assert_eq!(
            KeyHeader::ietf().derived_value(&key),
            format!("\"{}\"", key.to_hex()).as_str()
        );
        assert_eq!(
            KeyHeader::paypal().derived_value(&key),
            key.to_hex().as_str()
        );
    }

    #[test]
    fn spelled_keys_read_back_as_the_same_key() {
        for header in [KeyHeader::ietf(), KeyHeader::checkout_com()] {
            for key in ["order-42", "550e8400-e29b-41d4-a716-446655440000"] {
                let mut headers = HeaderMap::new();
                headers.insert(header.name().clone(), header.spell(key).unwrap());
                assert_eq!(header.read(&headers).unwrap().unwrap().as_str(), key);
            }
        }
        let mut headers = HeaderMap::new();
        headers.insert(
            IDEMPOTENCY_KEY.clone(),
            KeyHeader::ietf().spell("a\\b\"c").unwrap(),
        );
        assert_eq!(
            KeyHeader::ietf().read(&headers).unwrap().unwrap().as_str(),
            "a\\b\"c"
        );
    }

    #[test]
    fn keys_a_form_cannot_carry_are_refused() {
        assert_eq!(KeyHeader::ietf().spell(""), Err(InvalidKey::Empty));
        assert_eq!(
            KeyHeader::ietf().spell("a b"),
            Err(InvalidKey::InvalidCharacter { byte: b' ' })
        );
        assert_eq!(
            KeyHeader::stripe().spell("a\"b"),
            Err(InvalidKey::NotAToken { byte: b'"' })
        );
        assert!(matches!(
            KeyHeader::stripe().spell(&"k".repeat(MAX_KEY_LEN + 1)),
            Err(InvalidKey::TooLong { .. })
        ));
    }
}
