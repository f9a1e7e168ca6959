//! Just enough of the protobuf wire format to read the fields of a message: the key field
//! of a request, the digests of its top-level fields, and the methods and message types of a
//! descriptor set.

use bytes::{Buf, Bytes};

/// One field's value, by wire type.
#[derive(Debug)]
pub(super) enum Value {
    /// Wire type 0.
    Varint(u64),
    /// Wire type 2: a string, bytes, a message or a packed list.
    Delimited(Bytes),
    /// Wire types 1 (eight bytes) and 5 (four bytes), as they were written.
    Fixed(Bytes),
}

/// The message is not protobuf.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Malformed;

/// Every field of `message`, in order: `(number, value)`.
pub(super) fn fields(mut message: Bytes) -> Result<Vec<(u64, Value)>, Malformed> {
    let mut out = Vec::new();
    while message.has_remaining() {
        let tag = varint(&mut message).ok_or(Malformed)?;
        let value = match tag & 7 {
            0 => Value::Varint(varint(&mut message).ok_or(Malformed)?),
            wire_type @ (1 | 5) => {
                let width = if wire_type == 1 { 8 } else { 4 };
                if message.remaining() < width {
                    return Err(Malformed);
                }
                Value::Fixed(message.split_to(width))
            }
            2 => {
                let len = usize::try_from(varint(&mut message).ok_or(Malformed)?)
                    .map_err(|_| Malformed)?;
                if message.remaining() < len {
                    return Err(Malformed);
                }
                Value::Delimited(message.split_to(len))
            }
            // Groups (3, 4) are proto2's, in neither a request's key nor a descriptor.
            _ => return Err(Malformed),
        };
        out.push((tag >> 3, value));
    }
    Ok(out)
}

fn varint(bytes: &mut Bytes) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        if !bytes.has_remaining() {
            return None;
        }
        let byte = bytes.get_u8();
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}
