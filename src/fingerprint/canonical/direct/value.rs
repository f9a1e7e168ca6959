//! `Serializer` for the direct writer: each serde data model kind, written as the `Value`
//! path would write it.

use serde::ser::{self, Serialize, Serializer};
use serde_json::Value;

use super::{Array, GiveUp, Object, Result, Writer};
use crate::fingerprint::canonical::{f32_as_written, write, write_string};

/// The prefix of serde_json's own types (its raw values and arbitrary-precision numbers),
/// which its `Value` serializer treats specially.
const SERDE_JSON_PRIVATE: &str = "$serde_json::private::";

impl<'w> Serializer for &'w mut Writer {
    type Ok = ();
    type Error = GiveUp;
    type SerializeSeq = Array<'w>;
    type SerializeTuple = Array<'w>;
    type SerializeTupleStruct = Array<'w>;
    type SerializeTupleVariant = Array<'w>;
    type SerializeMap = Object<'w>;
    type SerializeStruct = Object<'w>;
    type SerializeStructVariant = Object<'w>;

    fn serialize_bool(self, v: bool) -> Result {
        self.out
            .extend_from_slice(if v { b"true" } else { b"false" });
        Ok(())
    }

    fn serialize_i8(self, v: i8) -> Result {
        self.serialize_i64(v.into())
    }

    fn serialize_i16(self, v: i16) -> Result {
        self.serialize_i64(v.into())
    }

    fn serialize_i32(self, v: i32) -> Result {
        self.serialize_i64(v.into())
    }

    fn serialize_i64(self, v: i64) -> Result {
        self.number(v);
        Ok(())
    }

    fn serialize_i128(self, v: i128) -> Result {
        if let Ok(v) = u64::try_from(v) {
            return self.serialize_u64(v);
        }
        self.serialize_i64(i64::try_from(v).map_err(|_| GiveUp)?)
    }

    fn serialize_u8(self, v: u8) -> Result {
        self.serialize_u64(v.into())
    }

    fn serialize_u16(self, v: u16) -> Result {
        self.serialize_u64(v.into())
    }

    fn serialize_u32(self, v: u32) -> Result {
        self.serialize_u64(v.into())
    }

    fn serialize_u64(self, v: u64) -> Result {
        self.number(v);
        Ok(())
    }

    fn serialize_u128(self, v: u128) -> Result {
        self.serialize_u64(u64::try_from(v).map_err(|_| GiveUp)?)
    }

    // Floats as the `Value` path spells them (`-0.0` as `0.0`, non-finite as `null`): the
    // same code, on a `Value` that costs no allocation. An `f32` as the number its JSON
    // holds (see `f32_as_written`), never the `f64` it widens to.
    fn serialize_f32(self, v: f32) -> Result {
        self.serialize_f64(f32_as_written(v))
    }

    fn serialize_f64(self, v: f64) -> Result {
        write(&Value::from(v), &mut self.out);
        Ok(())
    }

    fn serialize_char(self, v: char) -> Result {
        write_string(v.encode_utf8(&mut [0; 4]), &mut self.out);
        Ok(())
    }

    fn serialize_str(self, v: &str) -> Result {
        write_string(v, &mut self.out);
        Ok(())
    }

    fn serialize_bytes(self, v: &[u8]) -> Result {
        let mut array = self.serialize_seq(Some(v.len()))?;
        for byte in v {
            array.element(byte)?;
        }
        array.close()
    }

    fn serialize_none(self) -> Result {
        self.serialize_unit()
    }

    fn serialize_some<T: ?Sized + Serialize>(self, value: &T) -> Result {
        value.serialize(self)
    }

    fn serialize_unit(self) -> Result {
        self.out.extend_from_slice(b"null");
        Ok(())
    }

    fn serialize_unit_struct(self, _: &'static str) -> Result {
        self.serialize_unit()
    }

    fn serialize_unit_variant(self, _: &'static str, _: u32, variant: &'static str) -> Result {
        self.serialize_str(variant)
    }

    fn serialize_newtype_struct<T: ?Sized + Serialize>(self, _: &'static str, value: &T) -> Result {
        value.serialize(self)
    }

    fn serialize_newtype_variant<T: ?Sized + Serialize>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result {
        self.open_variant(variant);
        value.serialize(&mut *self)?;
        self.out.push(b'}');
        Ok(())
    }

    fn serialize_seq(self, _: Option<usize>) -> Result<Array<'w>> {
        self.out.push(b'[');
        Ok(Array {
            writer: self,
            first: true,
            closes: 0,
        })
    }

    fn serialize_tuple(self, len: usize) -> Result<Array<'w>> {
        self.serialize_seq(Some(len))
    }

    fn serialize_tuple_struct(self, _: &'static str, len: usize) -> Result<Array<'w>> {
        self.serialize_seq(Some(len))
    }

    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Array<'w>> {
        self.open_variant(variant);
        let mut array = self.serialize_seq(Some(len))?;
        array.closes = 1;
        Ok(array)
    }

    fn serialize_map(self, _: Option<usize>) -> Result<Object<'w>> {
        Ok(self.open_object())
    }

    fn serialize_struct(self, name: &'static str, _: usize) -> Result<Object<'w>> {
        if name.starts_with(SERDE_JSON_PRIVATE) {
            return Err(GiveUp);
        }
        Ok(self.open_object())
    }

    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Object<'w>> {
        self.open_variant(variant);
        let mut object = self.open_object();
        object.closes = 2;
        Ok(object)
    }
}

impl ser::SerializeSeq for Array<'_> {
    type Ok = ();
    type Error = GiveUp;

    fn serialize_element<T: ?Sized + Serialize>(&mut self, value: &T) -> Result {
        self.element(value)
    }

    fn end(self) -> Result {
        self.close()
    }
}

impl ser::SerializeTuple for Array<'_> {
    type Ok = ();
    type Error = GiveUp;

    fn serialize_element<T: ?Sized + Serialize>(&mut self, value: &T) -> Result {
        self.element(value)
    }

    fn end(self) -> Result {
        self.close()
    }
}

impl ser::SerializeTupleStruct for Array<'_> {
    type Ok = ();
    type Error = GiveUp;

    fn serialize_field<T: ?Sized + Serialize>(&mut self, value: &T) -> Result {
        self.element(value)
    }

    fn end(self) -> Result {
        self.close()
    }
}

impl ser::SerializeTupleVariant for Array<'_> {
    type Ok = ();
    type Error = GiveUp;

    fn serialize_field<T: ?Sized + Serialize>(&mut self, value: &T) -> Result {
        self.element(value)
    }

    fn end(self) -> Result {
        self.close()
    }
}

impl ser::SerializeMap for Object<'_> {
    type Ok = ();
    type Error = GiveUp;

    fn serialize_key<T: ?Sized + Serialize>(&mut self, key: &T) -> Result {
        self.key(key)
    }

    fn serialize_value<T: ?Sized + Serialize>(&mut self, value: &T) -> Result {
        self.value(value)
    }

    fn end(self) -> Result {
        self.close()
    }
}

impl ser::SerializeStruct for Object<'_> {
    type Ok = ();
    type Error = GiveUp;

    fn serialize_field<T: ?Sized + Serialize>(&mut self, key: &'static str, value: &T) -> Result {
        self.key(key)?;
        self.value(value)
    }

    fn end(self) -> Result {
        self.close()
    }
}

impl ser::SerializeStructVariant for Object<'_> {
    type Ok = ();
    type Error = GiveUp;

    fn serialize_field<T: ?Sized + Serialize>(&mut self, key: &'static str, value: &T) -> Result {
        self.key(key)?;
        self.value(value)
    }

    fn end(self) -> Result {
        self.close()
    }
}
