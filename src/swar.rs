//! Eight bytes at once: the word tricks that tell whether a `u64` holds a byte equal to a
//! given one, or below one. Subtracting one from every byte borrows only out of a byte that
//! matched, so a word's answer to "is there any such byte" is exact, and its lowest marked
//! byte (in memory order, for a word read little-endian) is always a match; bytes above it
//! may be marked falsely.

/// `0x01` in every byte.
const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
/// The high bit of every byte.
const HIGH: u64 = ONES * 0x80;

/// High bits set at the bytes of `word` equal to `byte` (see the module docs for which
/// marks are exact).
#[inline(always)]
pub(crate) fn bytes_equal(word: u64, byte: u8) -> u64 {
    let zeros = word ^ (ONES * u64::from(byte));
    zeros.wrapping_sub(ONES) & !zeros & HIGH
}

/// High bits set at the bytes of `word` below `bound` (at most `0x80`; see the module docs
/// for which marks are exact).
#[inline(always)]
pub(crate) fn bytes_below(word: u64, bound: u8) -> u64 {
    debug_assert!(bound <= 0x80);
    word.wrapping_sub(ONES * u64::from(bound)) & !word & HIGH
}

/// High bits set at the bytes of `word` of `0x7f` or above (every byte that is not
/// ASCII, and DEL).
#[inline(always)]
pub(crate) fn bytes_from_del(word: u64) -> u64 {
    (word.wrapping_add(ONES) | word) & HIGH
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Against the byte-at-a-time rule: any-answers exact, the first mark a match.
        #[test]
        fn marks_agree_with_each_byte(bytes in any::<[u8; 8]>(), byte in any::<u8>(), bound in 0_u8..=0x80) {
            let word = u64::from_le_bytes(bytes);
            let first = |marks: u64| (marks != 0).then(|| marks.trailing_zeros() as usize / 8);
            prop_assert_eq!(first(bytes_equal(word, byte)), bytes.iter().position(|&b| b == byte));
            prop_assert_eq!(first(bytes_below(word, bound)), bytes.iter().position(|&b| b < bound));
            prop_assert_eq!(bytes_from_del(word) != 0, bytes.iter().any(|&b| b >= 0x7f));
        }
    }
}
