//! The versioned, length-prefixed byte form of recorded requests and outcomes, for
//! stores that keep them outside the process.

use std::fmt;

use http::{HeaderMap, HeaderName, StatusCode, Version};

use super::headers::{self, HeaderBlock};
use super::StoreError;

/// The encoding version written today. Decoders accept every version up to this one, so a
/// later release reads today's records.
pub(super) const ENCODING_VERSION: u8 = 1;

pub(super) fn corrupt(err: impl fmt::Display) -> StoreError {
    StoreError::corrupt(err.to_string())
}

pub(super) fn version_code(version: Version) -> u8 {
    // The codes are in records written by earlier releases: never renumber them. A version
    // `http` adds later is recorded as HTTP/1.1 rather than refused at record time.
    match version {
        Version::HTTP_09 => 0,
        Version::HTTP_10 => 1,
        Version::HTTP_2 => 3,
        Version::HTTP_3 => 4,
        _ => 2,
    }
}

pub(super) fn version_from_code(code: u8) -> Result<Version, StoreError> {
    Ok(match code {
        0 => Version::HTTP_09,
        1 => Version::HTTP_10,
        2 => Version::HTTP_11,
        3 => Version::HTTP_2,
        4 => Version::HTTP_3,
        other => return Err(corrupt(format!("unknown HTTP version code {other}"))),
    })
}

/// Length-prefixed little writer: `u32` big-endian lengths before every variable field.
pub(super) struct Writer(pub(super) Vec<u8>);

impl Writer {
    pub(super) fn new(version: u8) -> Self {
        Self(vec![version])
    }
    pub(super) fn u8(&mut self, value: u8) {
        self.0.push(value);
    }
    pub(super) fn u16(&mut self, value: u16) {
        self.0.extend_from_slice(&value.to_be_bytes());
    }
    pub(super) fn u32(&mut self, value: u32) {
        self.0.extend_from_slice(&value.to_be_bytes());
    }
    pub(super) fn bytes(&mut self, bytes: &[u8]) {
        let len = u32::try_from(bytes.len()).expect("records are far below 4 GiB");
        self.u32(len);
        self.0.extend_from_slice(bytes);
    }
    pub(super) fn headers(&mut self, headers: &HeaderMap) {
        let pairs = headers.iter();
        self.pairs(
            headers.len(),
            pairs.map(|(name, value)| (name.as_str().as_bytes(), value.as_bytes())),
        );
    }
    pub(super) fn header_block(&mut self, block: &HeaderBlock) {
        // As `pairs` writes them, with each value as it is sent (a digest rendered).
        self.u32(block.len() as u32);
        for entry in block.entries() {
            self.bytes(entry.name);
            self.bytes(&block.value_bytes(&entry));
        }
    }
    /// `count` headers as name and value bytes, the one layout of a frozen request's and a
    /// recorded response's headers (sensitivity is not stored).
    pub(super) fn pairs<'h>(
        &mut self,
        count: usize,
        pairs: impl Iterator<Item = (&'h [u8], &'h [u8])>,
    ) {
        self.u32(count as u32);
        for (name, value) in pairs {
            self.bytes(name);
            self.bytes(value);
        }
    }
}

pub(super) struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    pub(super) fn new(bytes: &'a [u8]) -> Result<Self, StoreError> {
        let mut reader = Self(bytes);
        match reader.u8()? {
            1 => Ok(reader),
            other => Err(corrupt(format!(
                "record encoding version {other} is newer than this release understands"
            ))),
        }
    }
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], StoreError> {
        if self.0.len() < n {
            return Err(corrupt("record is truncated"));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    pub(super) fn u8(&mut self) -> Result<u8, StoreError> {
        Ok(self.take(1)?[0])
    }
    pub(super) fn u16(&mut self) -> Result<u16, StoreError> {
        Ok(u16::from_be_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    pub(super) fn u32(&mut self) -> Result<u32, StoreError> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    pub(super) fn bytes(&mut self) -> Result<&'a [u8], StoreError> {
        let len = self.u32()? as usize;
        self.take(len)
    }
    pub(super) fn status(&mut self) -> Result<StatusCode, StoreError> {
        StatusCode::from_u16(self.u16()?).map_err(corrupt)
    }
    /// A header map: read as a block, which checks names, values and how many distinct
    /// names there are (a forged record is refused, not a panic in its reader).
    pub(super) fn headers(&mut self) -> Result<HeaderMap, StoreError> {
        Ok(HeaderBlock::of_checked_pairs(&self.header_pairs()?, &[], &[]).to_map())
    }
    /// Headers as names and checked values, ready for [`HeaderBlock::of_checked_pairs`].
    pub(super) fn header_pairs(&mut self) -> Result<Vec<(HeaderName, &'a [u8])>, StoreError> {
        let count = self.u32()? as usize;
        let mut pairs = Vec::with_capacity(count.min(256));
        let mut names = headers::DistinctNames::default();
        for _ in 0..count {
            let name = HeaderName::from_bytes(self.bytes()?).map_err(corrupt)?;
            let value = self.bytes()?;
            if !headers::is_valid_value(value) {
                return Err(corrupt("record holds an invalid header value"));
            }
            if !names.admit(&name) {
                return Err(corrupt("record holds more header names than a HeaderMap"));
            }
            pairs.push((name, value));
        }
        Ok(pairs)
    }
    pub(super) fn finish(self) -> Result<(), StoreError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(corrupt("record has trailing bytes"))
        }
    }
}
