//! What the type of the service under a face says about how it was wired.

/// A retrying layer that is not this crate's, found in the type of the service a face
/// wraps: every send below a face is one attempt of an operation, and such a layer resends
/// an attempt that may have taken effect, blind to the provider's keys. Read once, when the
/// layer wraps the service, from the service's type name: a layer hidden behind a boxed
/// service (`BoxCloneService`) or one of your own cannot be seen this way, and is left to
/// the sends counted at run time ([`SendOnce`](crate::client::SendOnce)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Wiring {
    /// The retrying layer found inside, by the name the refusal gives it.
    pub(crate) retry_inside: Option<&'static str>,
}

/// The retrying layers recognised by their type's path, and the name a refusal gives each.
const FOREIGN_RETRIES: [(&str, &str); 2] = [
    ("tower::retry::Retry<", "tower::retry"),
    ("tower::hedge::Hedge<", "tower::hedge"),
];

impl Wiring {
    /// Nothing known about the service under the face (a `reqwest-middleware` chain).
    pub(crate) const UNKNOWN: Self = Self { retry_inside: None };

    /// What the type of `S` shows: `S` is the service a face wraps.
    pub(crate) fn of<S>() -> Self {
        let name = std::any::type_name::<S>();
        Self {
            retry_inside: FOREIGN_RETRIES
                .iter()
                .find(|(path, _)| name.contains(path))
                .map(|&(_, layer)| layer),
        }
    }

    /// Refuse a side effect under a foreign retrying layer, before anything is claimed or
    /// sent.
    pub(crate) fn check(self) -> Result<(), crate::Error> {
        match self.retry_inside {
            Some(layer) => Err(crate::Error::retry_layer_inside(layer)),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Wiring;

    #[derive(Clone)]
    struct Transport;

    #[derive(Clone)]
    struct Policy;

    #[test]
    fn a_tower_retry_anywhere_in_the_type_is_found() {
        type Inside = tower::retry::Retry<Policy, Transport>;
        assert_eq!(Wiring::of::<Inside>().retry_inside, Some("tower::retry"));
        type Deeper = tower::util::MapRequest<tower::retry::Retry<Policy, Transport>, fn(u8) -> u8>;
        assert_eq!(Wiring::of::<Deeper>().retry_inside, Some("tower::retry"));
        assert_eq!(Wiring::of::<Transport>(), Wiring::UNKNOWN);
        assert!(Wiring::UNKNOWN.check().is_ok());
        let refused = Wiring::of::<Inside>().check().unwrap_err();
        assert!(refused.is_retry_inside(), "{refused}");
    }
}
