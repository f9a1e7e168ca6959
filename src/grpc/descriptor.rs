//! A method table read from a `FileDescriptorSet`: each method's streaming flags and its
//! `idempotency_level`, as its `.proto` declares them, and the top-level fields of each
//! unary method's input message (their names, and which are maps).

use std::collections::HashMap;

use bytes::Bytes;

use super::fields::MessageFields;
use super::methods::{MethodEffect, MethodKind, Methods};
use super::protowire::{fields, Malformed, Value};

/// Field numbers of `google/protobuf/descriptor.proto`.
mod number {
    pub(super) const SET_FILE: u64 = 1;
    pub(super) const FILE_PACKAGE: u64 = 2;
    pub(super) const FILE_MESSAGE_TYPE: u64 = 4;
    pub(super) const FILE_SERVICE: u64 = 6;
    pub(super) const MESSAGE_NAME: u64 = 1;
    pub(super) const MESSAGE_FIELD: u64 = 2;
    pub(super) const MESSAGE_NESTED_TYPE: u64 = 3;
    pub(super) const MESSAGE_OPTIONS: u64 = 7;
    pub(super) const MESSAGE_OPTIONS_MAP_ENTRY: u64 = 7;
    pub(super) const FIELD_NAME: u64 = 1;
    pub(super) const FIELD_NUMBER: u64 = 3;
    pub(super) const FIELD_TYPE_NAME: u64 = 6;
    pub(super) const SERVICE_NAME: u64 = 1;
    pub(super) const SERVICE_METHOD: u64 = 2;
    pub(super) const METHOD_NAME: u64 = 1;
    pub(super) const METHOD_INPUT_TYPE: u64 = 2;
    pub(super) const METHOD_OPTIONS: u64 = 4;
    pub(super) const METHOD_CLIENT_STREAMING: u64 = 5;
    pub(super) const METHOD_SERVER_STREAMING: u64 = 6;
    pub(super) const OPTIONS_IDEMPOTENCY_LEVEL: u64 = 34;
}

/// Why a descriptor set could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidDescriptorSet(&'static str);

impl std::fmt::Display for InvalidDescriptorSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "invalid FileDescriptorSet: {}", self.0)
    }
}

impl std::error::Error for InvalidDescriptorSet {}

impl From<Malformed> for InvalidDescriptorSet {
    fn from(Malformed: Malformed) -> Self {
        Self("not protobuf")
    }
}

impl Methods {
    /// A table of every method of every service in an encoded `FileDescriptorSet`:
    /// its kind from its streaming flags, its effect from its `idempotency_level`
    /// (`NO_SIDE_EFFECTS` a read, `IDEMPOTENT`, otherwise a side effect).
    ///
    /// The table also keeps the names of the top-level fields of each unary method's input
    /// message: a call that reuses a key with another message is then told which fields
    /// changed (see the [server layer](crate::grpc#the-server-layer)).
    ///
    /// The set is what `protoc --descriptor_set_out`, `protox` or
    /// `tonic_prost_build::configure().file_descriptor_set_path(..)` write (embed it with
    /// `include_bytes!`), or the `FILE_DESCRIPTOR_SET` a service publishes for reflection.
    ///
    /// ```
    /// use tower_idempotency::grpc::Methods;
    ///
    /// // An empty set names no method.
    /// let methods = Methods::from_descriptor_set(&[]).unwrap();
    /// assert!(methods.is_empty());
    /// assert!(Methods::from_descriptor_set(&[0x0a, 0x05]).is_err());
    /// ```
    pub fn from_descriptor_set(encoded: &[u8]) -> Result<Self, InvalidDescriptorSet> {
        let mut declared = Declared::default();
        for (field, value) in fields(Bytes::copy_from_slice(encoded))? {
            if let (number::SET_FILE, Value::Delimited(file)) = (field, value) {
                declared.file(file)?;
            }
        }
        // A method's input type may be declared in another file of the set: every file is
        // read before any input is looked up.
        let mut methods = Self::new();
        for method in &declared.methods {
            methods = methods.method(&method.path, method.kind, method.effect);
            if method.kind == MethodKind::Unary {
                if let Some(fields) = declared.fields_of(&method.input) {
                    methods = methods.with_input_fields(&method.path, fields);
                }
            }
        }
        Ok(methods)
    }
}

/// What a set declares: its methods, and its message types by full name (`.package.Name`,
/// a nested one `.package.Outer.Inner`).
#[derive(Default)]
struct Declared {
    methods: Vec<DeclaredMethod>,
    messages: HashMap<String, MessageType>,
}

struct DeclaredMethod {
    path: String,
    kind: MethodKind,
    effect: MethodEffect,
    /// The full name of its input message type.
    input: String,
}

#[derive(Default)]
struct MessageType {
    /// Each field's number, name and type name (empty for a scalar).
    fields: Vec<(u32, String, String)>,
    /// A `map` field's entry type, which protoc declares for it.
    map_entry: bool,
}

impl Declared {
    fn file(&mut self, file: Bytes) -> Result<(), InvalidDescriptorSet> {
        let fields = fields(file)?;
        let package = fields
            .iter()
            .rev()
            .find_map(|(field, value)| match (*field, value) {
                (number::FILE_PACKAGE, Value::Delimited(name)) => Some(text(name)),
                _ => None,
            })
            .transpose()?
            .unwrap_or_default();
        let scope = if package.is_empty() {
            String::new()
        } else {
            format!(".{package}")
        };
        for (field, value) in fields {
            match (field, value) {
                (number::FILE_SERVICE, Value::Delimited(service)) => {
                    self.service(&package, service)?;
                }
                (number::FILE_MESSAGE_TYPE, Value::Delimited(message)) => {
                    self.message(&scope, message)?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn service(&mut self, package: &str, service: Bytes) -> Result<(), InvalidDescriptorSet> {
        let fields = fields(service)?;
        let mut name = String::new();
        for (field, value) in &fields {
            if let (number::SERVICE_NAME, Value::Delimited(bytes)) = (*field, value) {
                name = text(bytes)?;
            }
        }
        let service = if package.is_empty() {
            name
        } else {
            format!("{package}.{name}")
        };
        for (field, value) in fields {
            if let (number::SERVICE_METHOD, Value::Delimited(method)) = (field, value) {
                let (name, kind, effect, input) = read_method(method)?;
                self.methods.push(DeclaredMethod {
                    path: format!("/{service}/{name}"),
                    kind,
                    effect,
                    input: qualified(package, input),
                });
            }
        }
        Ok(())
    }

    /// A message type declared in `scope` (`.package`, or an enclosing message's full
    /// name), and the types nested in it.
    fn message(&mut self, scope: &str, message: Bytes) -> Result<(), InvalidDescriptorSet> {
        let fields = fields(message)?;
        let mut name = String::new();
        for (field, value) in &fields {
            if let (number::MESSAGE_NAME, Value::Delimited(bytes)) = (*field, value) {
                name = text(bytes)?;
            }
        }
        let full = format!("{scope}.{name}");
        let mut declared = MessageType::default();
        for (field, value) in fields {
            match (field, value) {
                (number::MESSAGE_FIELD, Value::Delimited(field)) => {
                    if let Some(field) = read_field(field)? {
                        declared.fields.push(field);
                    }
                }
                (number::MESSAGE_NESTED_TYPE, Value::Delimited(nested)) => {
                    self.message(&full, nested)?;
                }
                (number::MESSAGE_OPTIONS, Value::Delimited(options)) => {
                    declared.map_entry = read_map_entry(options)?;
                }
                _ => {}
            }
        }
        self.messages.insert(full, declared);
        Ok(())
    }

    /// The top-level fields of the message type named `full`, if the set declares it.
    fn fields_of(&self, full: &str) -> Option<MessageFields> {
        let message = self.messages.get(full)?;
        Some(MessageFields::new(message.fields.iter().map(
            |(number, name, type_name)| {
                let map = !type_name.is_empty()
                    && [type_name.clone(), format!("{full}.{type_name}")]
                        .iter()
                        .any(|name| self.messages.get(name).is_some_and(|t| t.map_entry));
                (*number, name.clone(), map)
            },
        )))
    }
}

/// A type name as the set's index has it: protoc and protox write them fully qualified
/// (`.package.Name`); a bare one is taken as the package's.
fn qualified(package: &str, name: String) -> String {
    match (name.starts_with('.'), package.is_empty()) {
        (true, _) => name,
        (false, true) => format!(".{name}"),
        (false, false) => format!(".{package}.{name}"),
    }
}

fn read_method(
    method: Bytes,
) -> Result<(String, MethodKind, MethodEffect, String), InvalidDescriptorSet> {
    let (mut name, mut client_streaming, mut server_streaming) = (String::new(), false, false);
    let mut effect = MethodEffect::SideEffect;
    let mut input = String::new();
    for (field, value) in fields(method)? {
        match (field, value) {
            (number::METHOD_NAME, Value::Delimited(bytes)) => name = text(&bytes)?,
            (number::METHOD_INPUT_TYPE, Value::Delimited(bytes)) => input = text(&bytes)?,
            (number::METHOD_CLIENT_STREAMING, Value::Varint(flag)) => client_streaming = flag != 0,
            (number::METHOD_SERVER_STREAMING, Value::Varint(flag)) => server_streaming = flag != 0,
            (number::METHOD_OPTIONS, Value::Delimited(options)) => effect = read_effect(options)?,
            _ => {}
        }
    }
    let kind = match (client_streaming, server_streaming) {
        (false, false) => MethodKind::Unary,
        (false, true) => MethodKind::ServerStreaming,
        (true, false) => MethodKind::ClientStreaming,
        (true, true) => MethodKind::Bidirectional,
    };
    Ok((name, kind, effect, input))
}

/// A field's number, name and type name; `None` for one without a number or a name.
fn read_field(field: Bytes) -> Result<Option<(u32, String, String)>, InvalidDescriptorSet> {
    let (mut number, mut name, mut type_name) = (None, String::new(), String::new());
    for (field, value) in fields(field)? {
        match (field, value) {
            (number::FIELD_NAME, Value::Delimited(bytes)) => name = text(&bytes)?,
            (number::FIELD_NUMBER, Value::Varint(value)) => number = u32::try_from(value).ok(),
            (number::FIELD_TYPE_NAME, Value::Delimited(bytes)) => type_name = text(&bytes)?,
            _ => {}
        }
    }
    Ok(number
        .filter(|_| !name.is_empty())
        .map(|number| (number, name, type_name)))
}

fn read_map_entry(options: Bytes) -> Result<bool, InvalidDescriptorSet> {
    let mut map_entry = false;
    for (field, value) in fields(options)? {
        if let (number::MESSAGE_OPTIONS_MAP_ENTRY, Value::Varint(flag)) = (field, value) {
            map_entry = flag != 0;
        }
    }
    Ok(map_entry)
}

fn read_effect(options: Bytes) -> Result<MethodEffect, InvalidDescriptorSet> {
    let mut effect = MethodEffect::SideEffect;
    for (field, value) in fields(options)? {
        if let (number::OPTIONS_IDEMPOTENCY_LEVEL, Value::Varint(level)) = (field, value) {
            effect = match level {
                1 => MethodEffect::NoSideEffects,
                2 => MethodEffect::Idempotent,
                _ => MethodEffect::SideEffect,
            };
        }
    }
    Ok(effect)
}

fn text(bytes: &Bytes) -> Result<String, InvalidDescriptorSet> {
    String::from_utf8(bytes.to_vec()).map_err(|_| InvalidDescriptorSet("a name is not UTF-8"))
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::grpc::fields::MessageDigests;

    fn payments() -> Methods {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/grpc");
        let set = protox::compile(["payments.proto"], [dir]).expect("the .proto compiles");
        Methods::from_descriptor_set(&set.encode_to_vec()).unwrap()
    }

    #[test]
    fn a_unary_methods_input_fields_are_named_and_its_map_known_as_one() {
        let methods = payments();
        let names = methods
            .input_fields("/payments.v1.Payments/Charge")
            .expect("the input of a unary method is named");
        // `labels` (4) is a map: its entries in either order are one value.
        let entry = |key: &[u8]| {
            let mut inner = vec![0x0a, key.len() as u8];
            inner.extend_from_slice(key);
            inner.extend_from_slice(&[0x12, 0x01, b'v']);
            let mut out = vec![0x22, inner.len() as u8];
            out.extend(inner);
            out
        };
        let ab = Bytes::from([entry(b"a"), entry(b"b"), vec![0x18, 0x05]].concat());
        let ba = Bytes::from([entry(b"b"), entry(b"a"), vec![0x18, 0x06]].concat());
        let first = MessageDigests::of_message(ab, names).unwrap();
        let again = MessageDigests::of_message(ba, names).unwrap();

        assert_eq!(first.changed(&again, names), ["amount_cents"]);
        assert!(methods
            .input_fields("/payments.v1.Payments/GetCharge")
            .is_some());
        // Streaming methods are never guarded: their inputs are not kept.
        assert!(methods
            .input_fields("/payments.v1.Payments/ListCharges")
            .is_none());
    }

    #[test]
    fn a_method_added_by_hand_over_a_described_one_loses_its_field_names() {
        let methods = payments().unary("/payments.v1.Payments/Charge");

        assert!(methods
            .input_fields("/payments.v1.Payments/Charge")
            .is_none());
    }
}
