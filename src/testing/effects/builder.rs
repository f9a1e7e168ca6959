//! Configuring a [`SideEffectService`](super::SideEffectService).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::fault::Fault;
use super::service::SideEffectService;
use super::state::{Shared, State};
use crate::key::KeyHeader;

/// Configures a [`SideEffectService`].
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::testing::{Fault, SideEffectService};
///
/// let naive = SideEffectService::builder()
///     .honour_keys(false)
///     .latency(Duration::from_millis(20))
///     .faults([Fault::CommitThenTimeout])
///     .build();
/// assert_eq!(naive.pending_faults(), [Fault::CommitThenTimeout]);
/// ```
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct SideEffectServiceBuilder {
    honour_keys: bool,
    key_header: KeyHeader,
    latency: Duration,
    faults: Vec<Fault>,
}

impl Default for SideEffectServiceBuilder {
    fn default() -> Self {
        Self {
            honour_keys: true,
            key_header: KeyHeader::ietf(),
            latency: Duration::ZERO,
            faults: Vec::new(),
        }
    }
}

impl SideEffectServiceBuilder {
    /// Whether a repeated `Idempotency-Key` is deduplicated like a payment provider does
    /// (replay, `409`, `422`; the default, `true`) or ignored like a naive provider that
    /// commits every call (`false`). Turn it off to prove that *your* side, not the
    /// provider's, keeps effects to one.
    pub fn honour_keys(mut self, honour: bool) -> Self {
        self.honour_keys = honour;
        self
    }

    /// The header the provider reads the key from (default [`KeyHeader::ietf`],
    /// `Idempotency-Key`). It deduplicates on the key's characters (an sf-string and a
    /// bare token alike), and stores the header's value with the effect **as it was
    /// sent**, as real providers keep theirs: a lookup must name it so, quotes included.
    /// Effects are counted by the key's characters
    /// ([`effects_for_key`](SideEffectService::effects_for_key)).
    ///
    /// ```
    /// use tower_idempotency::key::KeyHeader;
    /// use tower_idempotency::testing::SideEffectService;
    ///
    /// let paypal = SideEffectService::builder().key_header(KeyHeader::paypal()).build();
    /// # let _ = paypal;
    /// ```
    pub fn key_header(mut self, header: KeyHeader) -> Self {
        self.key_header = header;
        self
    }

    /// How long every call (except a refused one) takes before it is answered; default
    /// none. Slept with [`tokio::time::sleep`], so a paused test clock works.
    pub fn latency(mut self, latency: Duration) -> Self {
        self.latency = latency;
        self
    }

    /// Queue `faults`, after any queued before.
    pub fn faults(mut self, faults: impl IntoIterator<Item = Fault>) -> Self {
        self.faults.extend(faults);
        self
    }

    /// Build the service.
    #[must_use]
    pub fn build(self) -> SideEffectService {
        SideEffectService {
            shared: Arc::new(Shared {
                honour_keys: self.honour_keys,
                key_header: self.key_header,
                latency: self.latency,
                state: Mutex::new(State {
                    faults: self.faults.into(),
                    ..State::default()
                }),
            }),
        }
    }
}

impl SideEffectService {
    /// Configure a provider: key honouring, base latency, faults.
    pub fn builder() -> SideEffectServiceBuilder {
        SideEffectServiceBuilder::default()
    }
}
