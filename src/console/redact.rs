//! A record's frozen request as the console shows it: its secrets redacted.
//!
//! The frozen request is what may have reached the provider, credentials included. An
//! operator needs its method, target and payload to check with the provider; nobody needs
//! its bearer token. So the values of the credential headers, of the headers the console
//! names, and of the JSON body fields it names are shown as [`REDACTED`], and a body that is
//! not text as its size and the hex of its first bytes.

use std::fmt::Write as _;

use serde_json::{json, Value};

use super::html::escape;
use crate::FrozenRequest;

use crate::frozen::request::{CREDENTIAL_HEADERS, REDACTED};

/// How many leading bytes of a body that is not text are shown, in hex.
const HEX_PREFIX: usize = 32;

/// What the console hides of a frozen request.
#[derive(Clone, Debug, Default)]
pub(crate) struct Redaction {
    /// Header names (lower case) redacted besides the credential headers.
    headers: Vec<String>,
    /// JSON pointers (RFC 6901) into the body, redacted.
    fields: Vec<String>,
}

/// A request's body as shown: its text, redacted, or its size and first bytes.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ShownBody {
    /// UTF-8 text: a JSON body with its named fields redacted, any other as it is.
    Text(String),
    /// Not UTF-8: how long it is, and the hex of its first [`HEX_PREFIX`] bytes.
    Bytes { size: usize, hex_prefix: String },
}

impl Redaction {
    /// Redact the values of the headers `names` (any case) too.
    pub(crate) fn add_headers(&mut self, names: impl IntoIterator<Item = String>) {
        self.headers.extend(
            names
                .into_iter()
                .map(|name| name.trim().to_ascii_lowercase()),
        );
    }

    /// Redact the JSON body fields at `pointers` too.
    ///
    /// # Panics
    ///
    /// If a pointer is neither empty (the whole body) nor starts with `/`: it would name
    /// nothing, and leave the field it was meant to hide in sight.
    pub(crate) fn add_fields(&mut self, pointers: impl IntoIterator<Item = String>) {
        for pointer in pointers {
            assert!(
                pointer.is_empty() || pointer.starts_with('/'),
                "{pointer:?} is not a JSON pointer (RFC 6901): `/card/number`, `/items/0/cvc`"
            );
            self.fields.push(pointer);
        }
    }

    fn hides_header(&self, name: &str) -> bool {
        CREDENTIAL_HEADERS.contains(&name) || self.headers.iter().any(|hidden| hidden == name)
    }

    /// The request's headers in order, each value redacted if its name is hidden (a value
    /// that is not text is shown with its bytes replaced).
    pub(crate) fn headers(&self, request: &FrozenRequest) -> Vec<(String, String)> {
        request
            .headers()
            .iter()
            .map(|(name, value)| {
                let shown = if self.hides_header(name.as_str()) {
                    REDACTED.to_owned()
                } else {
                    String::from_utf8_lossy(value.as_bytes()).into_owned()
                };
                (name.as_str().to_owned(), shown)
            })
            .collect()
    }

    /// The request's body: redacted JSON, text, or the size and first bytes of one that is
    /// not UTF-8.
    pub(crate) fn body(&self, request: &FrozenRequest) -> ShownBody {
        let bytes = request.body();
        let Ok(text) = std::str::from_utf8(bytes) else {
            let mut hex_prefix = String::with_capacity(2 * HEX_PREFIX);
            for byte in bytes.iter().take(HEX_PREFIX) {
                let _ = write!(hex_prefix, "{byte:02x}");
            }
            return ShownBody::Bytes {
                size: bytes.len(),
                hex_prefix,
            };
        };
        if self.fields.is_empty() {
            return ShownBody::Text(text.to_owned());
        }
        match serde_json::from_str::<Value>(text) {
            Ok(mut value) => {
                for pointer in &self.fields {
                    if let Some(field) = value.pointer_mut(pointer) {
                        *field = Value::String(REDACTED.to_owned());
                    }
                }
                ShownBody::Text(value.to_string())
            }
            // Not JSON: no field to name, the text as it is.
            Err(_) => ShownBody::Text(text.to_owned()),
        }
    }

    /// The request as the API shows it: `{method, uri, version, headers: [[name, value]],
    /// body: {size, text} | {size, hex_prefix}}`.
    pub(crate) fn request_json(&self, request: &FrozenRequest) -> Value {
        let body = match self.body(request) {
            ShownBody::Text(text) => json!({ "size": request.body().len(), "text": text }),
            ShownBody::Bytes { size, hex_prefix } => {
                json!({ "size": size, "hex_prefix": hex_prefix })
            }
        };
        json!({
            "method": request.method().as_str(),
            "uri": request.uri().to_string(),
            "version": format!("{:?}", request.version()),
            "headers": self.headers(request),
            "body": body,
        })
    }

    /// The request as the record page shows it, every value escaped.
    pub(crate) fn request_html(&self, request: &FrozenRequest) -> String {
        let mut out = format!(
            "<h2>Request (as frozen; secrets redacted)</h2><table>\
             <tr><th>Method</th><td class=\"mono\">{}</td></tr>\
             <tr><th>URI</th><td class=\"mono\">{}</td></tr></table><h3>Headers</h3><table>",
            escape(request.method().as_str()),
            escape(&request.uri().to_string()),
        );
        for (name, value) in self.headers(request) {
            let _ = write!(
                out,
                "<tr><th class=\"mono\">{}</th><td class=\"mono\">{}</td></tr>",
                escape(&name),
                escape(&value)
            );
        }
        out.push_str("</table><h3>Body</h3>");
        match self.body(request) {
            ShownBody::Text(text) => {
                let _ = write!(out, "<pre class=\"mono\">{}</pre>", escape(&text));
            }
            ShownBody::Bytes { size, hex_prefix } => {
                let _ = write!(
                    out,
                    "<p>{size} bytes, not text; the first in hex: \
                     <span class=\"mono\">{}</span></p>",
                    escape(&hex_prefix)
                );
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frozen(headers: &[(&'static str, &'static str)], body: &'static [u8]) -> FrozenRequest {
        let mut map = http::HeaderMap::new();
        for (name, value) in headers {
            map.append(*name, http::HeaderValue::from_static(value));
        }
        FrozenRequest::from_parts(
            http::Method::POST,
            "http://pay.local/charges".parse().unwrap(),
            http::Version::HTTP_11,
            map,
            bytes::Bytes::from_static(body),
        )
    }

    #[test]
    fn credentials_and_named_headers_are_redacted_in_order() {
        let mut redaction = Redaction::default();
        redaction.add_headers(["X-Api-Key".to_owned()]);
        let request = frozen(
            &[
                ("authorization", "Bearer sk_live"),
                ("cookie", "session=1"),
                ("proxy-authorization", "Basic x"),
                ("x-api-key", "k1"),
                ("content-type", "application/json"),
            ],
            b"{}",
        );
        let shown = redaction.headers(&request);
        let values: Vec<_> = shown.iter().map(|(_, value)| value.as_str()).collect();
        assert_eq!(
            values,
            [REDACTED, REDACTED, REDACTED, REDACTED, "application/json"]
        );
    }

    #[test]
    fn named_json_fields_are_redacted_and_others_kept() {
        let mut redaction = Redaction::default();
        redaction.add_fields(["/card/number".to_owned(), "/absent".to_owned()]);
        let request = frozen(
            &[],
            br#"{"amount":42,"card":{"number":"4242424242424242","exp":"12/30"}}"#,
        );
        let ShownBody::Text(text) = redaction.body(&request) else {
            panic!("a JSON body is text");
        };
        let value: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(value["card"]["number"], REDACTED);
        assert_eq!(value["card"]["exp"], "12/30");
        assert_eq!(value["amount"], 42);
        assert!(!text.contains("4242424242424242"));
    }

    #[test]
    fn a_body_that_is_not_text_shows_its_size_and_first_bytes() {
        let request = frozen(&[], &[0xff, 0x00, 0x10]);
        assert_eq!(
            Redaction::default().body(&request),
            ShownBody::Bytes {
                size: 3,
                hex_prefix: "ff0010".to_owned()
            }
        );
    }

    #[test]
    #[should_panic(expected = "not a JSON pointer")]
    fn a_field_that_is_no_pointer_is_refused() {
        Redaction::default().add_fields(["card.number".to_owned()]);
    }

    #[test]
    fn the_page_escapes_what_it_shows() {
        let request = frozen(&[("x-note", "<script>")], b"<b>hi</b>");
        let html = Redaction::default().request_html(&request);
        assert!(html.contains("&lt;script&gt;") && html.contains("&lt;b&gt;hi&lt;/b&gt;"));
        assert!(!html.contains("<script>") && !html.contains("<b>hi"));
    }
}
