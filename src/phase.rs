//! Failure phases: did the request leave before the call failed?
//!
//! The ledger needs one fact about a failed call: could its bytes have reached the server?
//! A failure proven to happen before the write (a refused connection, a DNS or TLS
//! failure) releases the operation so it can run again; any other failure leaves it
//! *in doubt*, and the next run resends the frozen bytes under the same key instead of
//! minting a new request.
//!
//! [`classify`] walks an error's `source()` chain and answers with the first phase it can
//! prove; an error it cannot place is [`FailurePhase::Unknown`] — in doubt, never
//! re-executed blindly. It knows:
//!
//! - this crate's [`Error`](crate::Error), which carries its phase;
//! - `hyper_util::client::legacy::Error` (feature `hyper-util`): `is_connect()` is pre-write;
//! - `std::io::Error` of kind `ConnectionRefused`, `AddrNotAvailable` or `NotFound` is
//!   pre-write (they come from `connect`);
//! - `reqwest::Error` (feature `reqwest`): `is_connect()` is pre-write, anything else may
//!   have been sent;
//! - `tower::timeout::error::Elapsed` is unknown: the request may have been sent.
//!
//! Teach it your own error types with a [`ClassifyPhase`] implementation, passed to the
//! layers' builders; it is asked first, for every error in the chain.
//!
//! # Example
//!
//! ```
//! use tower_idempotency::phase::{classify, FailurePhase};
//!
//! let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
//! assert_eq!(classify(&refused, None), FailurePhase::PreWrite);
//!
//! let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
//! assert_eq!(classify(&reset, None), FailurePhase::Unknown);
//! ```

use std::error::Error as StdError;
use std::fmt;

/// When, relative to writing the request, a call failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailurePhase {
    /// Before any byte of the request left: safe to run the operation again.
    PreWrite,
    /// After the request (or part of it) was written: the server may have acted on it.
    AfterWrite,
    /// Cannot tell (a timeout, a reset, an unknown error): treated like `AfterWrite`.
    Unknown,
}

impl FailurePhase {
    /// `true` when the request may have reached the server.
    ///
    /// ```
    /// # use tower_idempotency::phase::FailurePhase;
    /// assert!(!FailurePhase::PreWrite.may_have_been_sent());
    /// assert!(FailurePhase::Unknown.may_have_been_sent());
    /// ```
    pub fn may_have_been_sent(self) -> bool {
        !matches!(self, Self::PreWrite)
    }
}

impl FailurePhase {
    /// The phase of a call whose attempts failed in `self` and `other`: once one attempt may
    /// have been sent, the call may have been. `AfterWrite` beats `Unknown` beats `PreWrite`.
    pub(crate) fn strongest(self, other: Self) -> Self {
        fn rank(phase: FailurePhase) -> u8 {
            match phase {
                FailurePhase::PreWrite => 0,
                FailurePhase::Unknown => 1,
                FailurePhase::AfterWrite => 2,
            }
        }
        if rank(other) > rank(self) {
            other
        } else {
            self
        }
    }
}

impl fmt::Display for FailurePhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::PreWrite => "before the request was written",
            Self::AfterWrite => "after the request was written",
            Self::Unknown => "the request may have been written",
        })
    }
}

/// Places errors of your own transport in a [`FailurePhase`].
///
/// Return `None` for errors you do not recognise; the built-in rules then apply.
///
/// ```
/// use std::error::Error;
/// use tower_idempotency::phase::{classify, ClassifyPhase, FailurePhase};
///
/// #[derive(Debug)]
/// struct CircuitOpen;
/// impl std::fmt::Display for CircuitOpen {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         f.write_str("circuit open")
///     }
/// }
/// impl Error for CircuitOpen {}
///
/// #[derive(Clone, Debug)]
/// struct MyPhases;
/// impl ClassifyPhase for MyPhases {
///     fn classify(&self, error: &(dyn Error + 'static)) -> Option<FailurePhase> {
///         error.is::<CircuitOpen>().then_some(FailurePhase::PreWrite)
///     }
/// }
///
/// assert_eq!(classify(&CircuitOpen, Some(&MyPhases)), FailurePhase::PreWrite);
/// assert_eq!(classify(&CircuitOpen, None), FailurePhase::Unknown);
/// ```
pub trait ClassifyPhase: Send + Sync + 'static {
    /// The phase of `error` (one link of a `source()` chain), if this classifier knows it.
    fn classify(&self, error: &(dyn StdError + 'static)) -> Option<FailurePhase>;
}

impl<F> ClassifyPhase for F
where
    F: Fn(&(dyn StdError + 'static)) -> Option<FailurePhase> + Send + Sync + 'static,
{
    fn classify(&self, error: &(dyn StdError + 'static)) -> Option<FailurePhase> {
        self(error)
    }
}

/// The phase of `error`: the first link of its `source()` chain that `custom` or the
/// built-in rules can place, else [`FailurePhase::Unknown`].
pub fn classify(
    error: &(dyn StdError + 'static),
    custom: Option<&dyn ClassifyPhase>,
) -> FailurePhase {
    let mut link: Option<&(dyn StdError + 'static)> = Some(error);
    while let Some(err) = link {
        if let Some(phase) = custom
            .and_then(|c| c.classify(err))
            .or_else(|| builtin(err))
        {
            return phase;
        }
        link = err.source();
    }
    FailurePhase::Unknown
}

fn builtin(err: &(dyn StdError + 'static)) -> Option<FailurePhase> {
    if let Some(ours) = err.downcast_ref::<crate::Error>() {
        return ours.phase();
    }
    #[cfg(feature = "hyper-util")]
    if let Some(hyper) = err.downcast_ref::<hyper_util::client::legacy::Error>() {
        // The legacy client reports connect failures (refused, DNS, TLS handshake) apart
        // from everything that happens after a connection was handed a request.
        return hyper.is_connect().then_some(FailurePhase::PreWrite);
    }
    #[cfg(feature = "reqwest")]
    if let Some(reqwest) = err.downcast_ref::<::reqwest::Error>() {
        // As hyper-util's: a connect error (refused, DNS, TLS handshake) happened before
        // the request was written; anything else may have been sent.
        return Some(if reqwest.is_connect() {
            FailurePhase::PreWrite
        } else {
            FailurePhase::Unknown
        });
    }
    if let Some(io) = err.downcast_ref::<std::io::Error>() {
        use std::io::ErrorKind::*;
        return match io.kind() {
            ConnectionRefused | AddrNotAvailable | NotFound => Some(FailurePhase::PreWrite),
            _ => None,
        };
    }
    if err.is::<tower::timeout::error::Elapsed>() {
        return Some(FailurePhase::Unknown);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walks_the_source_chain() {
        #[derive(Debug)]
        struct Wrapper(std::io::Error);
        impl fmt::Display for Wrapper {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("wrapped")
            }
        }
        impl StdError for Wrapper {
            fn source(&self) -> Option<&(dyn StdError + 'static)> {
                Some(&self.0)
            }
        }
        let err = Wrapper(std::io::ErrorKind::ConnectionRefused.into());
        assert_eq!(classify(&err, None), FailurePhase::PreWrite);
    }

    #[test]
    fn tower_timeouts_are_unknown() {
        assert_eq!(
            classify(&tower::timeout::error::Elapsed::new(), None),
            FailurePhase::Unknown
        );
    }
}
