//! Object keys for the direct writer.

use serde::ser::{self, Serialize, Serializer};

use super::{GiveUp, Result};
use crate::fingerprint::canonical::needs_no_escape;

/// An object key, written quoted and followed by its colon: the kinds of key the `Value` path turns into a string
/// spelled the same whichever way (strings without escapes, integers, booleans, unit
/// variants); any other gives up.
pub(super) struct Key<'a>(pub(super) &'a mut Vec<u8>);

impl Key<'_> {
    fn text(self, text: &str) -> Result {
        if !needs_no_escape(text.as_bytes()) {
            return Err(GiveUp);
        }
        self.0.reserve(text.len() + 3);
        self.0.push(b'"');
        self.0.extend_from_slice(text.as_bytes());
        self.0.extend_from_slice(b"\":");
        Ok(())
    }

    fn integer(self, number: impl Serialize) -> Result {
        self.0.push(b'"');
        serde_json::to_writer(&mut *self.0, &number).expect("writing to a Vec never fails");
        self.0.extend_from_slice(b"\":");
        Ok(())
    }
}

type Impossible = ser::Impossible<(), GiveUp>;

impl Serializer for Key<'_> {
    type Ok = ();
    type Error = GiveUp;
    type SerializeSeq = Impossible;
    type SerializeTuple = Impossible;
    type SerializeTupleStruct = Impossible;
    type SerializeTupleVariant = Impossible;
    type SerializeMap = Impossible;
    type SerializeStruct = Impossible;
    type SerializeStructVariant = Impossible;

    fn serialize_str(self, v: &str) -> Result {
        self.text(v)
    }

    fn serialize_char(self, v: char) -> Result {
        self.text(v.encode_utf8(&mut [0; 4]))
    }

    fn serialize_bool(self, v: bool) -> Result {
        self.text(if v { "true" } else { "false" })
    }

    fn serialize_unit_variant(self, _: &'static str, _: u32, variant: &'static str) -> Result {
        self.text(variant)
    }

    fn serialize_newtype_struct<T: ?Sized + Serialize>(self, _: &'static str, value: &T) -> Result {
        value.serialize(self)
    }

    fn serialize_i8(self, v: i8) -> Result {
        self.integer(v)
    }

    fn serialize_i16(self, v: i16) -> Result {
        self.integer(v)
    }

    fn serialize_i32(self, v: i32) -> Result {
        self.integer(v)
    }

    fn serialize_i64(self, v: i64) -> Result {
        self.integer(v)
    }

    fn serialize_u8(self, v: u8) -> Result {
        self.integer(v)
    }

    fn serialize_u16(self, v: u16) -> Result {
        self.integer(v)
    }

    fn serialize_u32(self, v: u32) -> Result {
        self.integer(v)
    }

    fn serialize_u64(self, v: u64) -> Result {
        self.integer(v)
    }

    // The rest the `Value` path either refuses or spells in ways left to it.
    fn serialize_f32(self, _: f32) -> Result {
        Err(GiveUp)
    }

    fn serialize_f64(self, _: f64) -> Result {
        Err(GiveUp)
    }

    fn serialize_bytes(self, _: &[u8]) -> Result {
        Err(GiveUp)
    }

    fn serialize_none(self) -> Result {
        Err(GiveUp)
    }

    fn serialize_some<T: ?Sized + Serialize>(self, _: &T) -> Result {
        Err(GiveUp)
    }

    fn serialize_unit(self) -> Result {
        Err(GiveUp)
    }

    fn serialize_unit_struct(self, _: &'static str) -> Result {
        Err(GiveUp)
    }

    fn serialize_newtype_variant<T: ?Sized + Serialize>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result {
        Err(GiveUp)
    }

    fn serialize_seq(self, _: Option<usize>) -> Result<Impossible> {
        Err(GiveUp)
    }

    fn serialize_tuple(self, _: usize) -> Result<Impossible> {
        Err(GiveUp)
    }

    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Impossible> {
        Err(GiveUp)
    }

    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Impossible> {
        Err(GiveUp)
    }

    fn serialize_map(self, _: Option<usize>) -> Result<Impossible> {
        Err(GiveUp)
    }

    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Impossible> {
        Err(GiveUp)
    }

    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Impossible> {
        Err(GiveUp)
    }
}
