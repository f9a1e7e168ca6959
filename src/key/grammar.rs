//! The `Idempotency-Key` header grammar: RFC 8941 sf-strings and bare tokens, scanned a
//! word at a time.

use std::borrow::Cow;

use super::InvalidKey;
use crate::swar::{bytes_below, bytes_equal, bytes_from_del};

pub(super) fn is_visible_ascii(byte: u8) -> bool {
    (0x21..=0x7e).contains(&byte)
}

/// The bytes an sf-string key holds as they are: visible ASCII but `"` and `\\`. A table,
/// because every keyed request scans its key byte by byte.
const SF_PLAIN: [bool; 256] = {
    let mut plain = [false; 256];
    let mut byte = 0x21;
    while byte <= 0x7e {
        plain[byte] = byte != b'"' as usize && byte != b'\\' as usize;
        byte += 1;
    }
    plain
};

/// The bytes a bare token key is made of: RFC 9110 `tchar` (letters, digits and
/// ``!#$%&'*+-.^_`|~``) and the `:` and `/` an RFC 8941 sf-token also allows. Every other
/// visible byte is a delimiter of some structured field or list syntax: `,` above all,
/// which joins two field lines into one value (RFC 9110 §5.3). A table, because every
/// keyed request scans its key byte by byte.
const TOKEN: [bool; 256] = {
    let mut token = [false; 256];
    let mut byte = 0;
    while byte < 256 {
        let b = byte as u8;
        token[byte] = b.is_ascii_alphanumeric()
            || matches!(
                b,
                b'!' | b'#'
                    | b'$'
                    | b'%'
                    | b'&'
                    | b'\''
                    | b'*'
                    | b'+'
                    | b'-'
                    | b'.'
                    | b'^'
                    | b'_'
                    | b'`'
                    | b'|'
                    | b'~'
                    | b':'
                    | b'/'
            );
        byte += 1;
    }
    token
};

/// A bare token: [`TOKEN`] bytes only. A byte that is not visible ASCII (a space, a
/// control, obs-text) is an invalid character; a visible delimiter says the value is not
/// one bare key.
pub(super) fn bare_token(bytes: &[u8]) -> Result<Cow<'_, [u8]>, InvalidKey> {
    if let Some(&byte) = bytes.iter().find(|&&b| !TOKEN[usize::from(b)]) {
        return Err(if is_visible_ascii(byte) {
            InvalidKey::NotAToken { byte }
        } else {
            InvalidKey::InvalidCharacter { byte }
        });
    }
    Ok(Cow::Borrowed(bytes))
}

/// Whether each of the eight bytes of `word` is one an sf-string key holds as it is
/// ([`SF_PLAIN`]), checked at once: no byte below `!` or above `~` (which takes in every
/// byte that is not ASCII), none equal to `"` or `\`. Each test is the classic
/// "has a byte less than / greater than / equal to" word trick; a borrow or carry can only
/// mark a byte next to one that is marked already, so the answer for the word is exact.
fn all_plain(word: u64) -> bool {
    let below_visible = bytes_below(word, b'!');
    let above_visible = bytes_from_del(word);
    below_visible | above_visible | bytes_equal(word, b'"') | bytes_equal(word, b'\\') == 0
}

/// Eight bytes as one word (any byte order: [`all_plain`] tests each byte alike).
fn word(eight: &[u8]) -> u64 {
    u64::from_ne_bytes(eight.try_into().expect("eight bytes"))
}

/// How many bytes `inner` starts with that an sf-string key holds as they are. A word at
/// a time (a key is tens of bytes); a plain key's last bytes as its last eight, which
/// overlap what was checked; byte by byte only from the first word that is not all plain.
fn plain_run(inner: &[u8]) -> usize {
    let whole = inner
        .chunks_exact(8)
        .take_while(|&eight| all_plain(word(eight)))
        .count()
        * 8;
    let rest = &inner[whole..];
    if rest.len() < 8 && inner.len() >= 8 && all_plain(word(&inner[inner.len() - 8..])) {
        return inner.len();
    }
    whole
        + rest
            .iter()
            .position(|&b| !SF_PLAIN[usize::from(b)])
            .unwrap_or(rest.len())
}

/// The inside of an RFC 8941 sf-string: `\"` and `\\` escapes, every other escape invalid.
/// The key itself must still be visible ASCII, so the space an sf-string permits is refused.
pub(super) fn unescape_sf_string(inner: &[u8]) -> Result<Cow<'_, [u8]>, InvalidKey> {
    // Keys seldom hold escapes: validate the run before the first one in a single scan, and
    // when it is the whole key, borrow it: a plain key costs one pass and no copy here.
    let plain = plain_run(inner);
    let (head, rest) = inner.split_at(plain);
    if rest.is_empty() {
        return Ok(Cow::Borrowed(head));
    }
    let mut out = Vec::with_capacity(inner.len());
    out.extend_from_slice(head);
    let mut bytes = rest.iter();
    while let Some(&byte) = bytes.next() {
        match byte {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => out.push(escaped),
                _ => return Err(InvalidKey::BadSfString),
            },
            b'"' => return Err(InvalidKey::BadSfString),
            byte if is_visible_ascii(byte) => out.push(byte),
            byte => return Err(InvalidKey::InvalidCharacter { byte }),
        }
    }
    Ok(Cow::Owned(out))
}

#[cfg(test)]
pub(in crate::key) mod tests {
    use super::*;

    #[test]
    fn the_plain_byte_table_is_visible_ascii_but_quote_and_backslash() {
        for byte in 0..=255u8 {
            let plain = is_visible_ascii(byte) && byte != b'"' && byte != b'\\';
            assert_eq!(SF_PLAIN[usize::from(byte)], plain, "byte {byte:#04x}");
        }
    }

    /// Words of bytes drawn mostly from the edges of the plain range (where the word
    /// tests' borrows and carries are), so that plain words and words with one odd byte
    /// both come often.
    fn edgy_bytes() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        let byte = prop_oneof![
            6 => proptest::sample::select(vec![0x20u8, 0x21, 0x22, 0x23, 0x5b, 0x5c, 0x5d, 0x7e, 0x7f, 0x80, 0xff, 0x00, 0x01]),
            10 => 0x21u8..=0x7e,
            1 => any::<u8>(),
        ];
        proptest::collection::vec(byte, 0..40)
    }

    proptest::proptest! {
        /// The word-at-a-time scan finds the first byte the table refuses, wherever it is
        /// and whatever is next to it.
        #[test]
        fn plain_run_agrees_with_the_table(inner in edgy_bytes()) {
            let expected = inner
                .iter()
                .position(|&b| !SF_PLAIN[usize::from(b)])
                .unwrap_or(inner.len());
            proptest::prop_assert_eq!(plain_run(&inner), expected);
            for eight in inner.windows(8) {
                let plain = eight.iter().all(|&b| SF_PLAIN[usize::from(b)]);
                proptest::prop_assert_eq!(all_plain(word(eight)), plain, "{:02x?}", eight);
            }
        }
    }

    /// RFC 9110 `tchar`, and the `:` and `/` of an RFC 8941 sf-token, as the RFCs list them.
    pub(in crate::key) fn is_token_byte(byte: u8) -> bool {
        byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(&byte)
    }

    #[test]
    fn the_token_table_is_the_grammar() {
        for byte in 0..=255u8 {
            assert_eq!(
                TOKEN[usize::from(byte)],
                is_token_byte(byte),
                "byte {byte:#04x}"
            );
        }
    }

    #[test]
    fn the_plain_run_ends_at_the_first_byte_that_is_not_plain_wherever_it_is() {
        for len in 0..40 {
            assert_eq!(plain_run(&vec![b'k'; len]), len, "all plain, {len} bytes");
            for at in 0..len {
                // Every byte the table refuses, next to plain ones on both sides.
                for stop in (0..=255u8).filter(|&b| !SF_PLAIN[usize::from(b)]) {
                    let mut bytes = vec![b'k'; len];
                    bytes[at] = stop;
                    assert_eq!(plain_run(&bytes), at, "{stop:#04x} at {at} of {len}");
                }
            }
        }
    }
}
