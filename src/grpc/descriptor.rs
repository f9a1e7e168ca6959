//! A method table read from a `FileDescriptorSet`: each method's streaming flags and its
//! `idempotency_level`, as its `.proto` declares them.

use bytes::Bytes;

use super::methods::{MethodEffect, MethodKind, Methods};
use super::protowire::{fields, Malformed, Value};

/// Field numbers of `google/protobuf/descriptor.proto`.
mod number {
    pub(super) const SET_FILE: u64 = 1;
    pub(super) const FILE_PACKAGE: u64 = 2;
    pub(super) const FILE_SERVICE: u64 = 6;
    pub(super) const SERVICE_NAME: u64 = 1;
    pub(super) const SERVICE_METHOD: u64 = 2;
    pub(super) const METHOD_NAME: u64 = 1;
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
        let mut methods = Self::new();
        for (field, value) in fields(Bytes::copy_from_slice(encoded))? {
            if let (number::SET_FILE, Value::Delimited(file)) = (field, value) {
                methods = methods.add_file(file)?;
            }
        }
        Ok(methods)
    }

    fn add_file(mut self, file: Bytes) -> Result<Self, InvalidDescriptorSet> {
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
        for (field, value) in fields {
            if let (number::FILE_SERVICE, Value::Delimited(service)) = (field, value) {
                self = self.add_service(&package, service)?;
            }
        }
        Ok(self)
    }

    fn add_service(mut self, package: &str, service: Bytes) -> Result<Self, InvalidDescriptorSet> {
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
                let (method, kind, effect) = read_method(method)?;
                self = self.method(&format!("/{service}/{method}"), kind, effect);
            }
        }
        Ok(self)
    }
}

fn read_method(method: Bytes) -> Result<(String, MethodKind, MethodEffect), InvalidDescriptorSet> {
    let (mut name, mut client_streaming, mut server_streaming) = (String::new(), false, false);
    let mut effect = MethodEffect::SideEffect;
    for (field, value) in fields(method)? {
        match (field, value) {
            (number::METHOD_NAME, Value::Delimited(bytes)) => name = text(&bytes)?,
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
    Ok((name, kind, effect))
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
