//! The payments service of the gRPC tests: its generated messages, client and server.
#![allow(dead_code, unused_imports, clippy::all)]

include!("payments.v1.rs");

/// The service's full method names, as they travel in a request's path.
pub mod paths {
    /// The unary, side-effecting `Charge`.
    pub const CHARGE: &str = "/payments.v1.Payments/Charge";
    /// The unary read `GetCharge` (`NO_SIDE_EFFECTS`).
    pub const GET_CHARGE: &str = "/payments.v1.Payments/GetCharge";
    /// The server-streaming `ListCharges`.
    pub const LIST_CHARGES: &str = "/payments.v1.Payments/ListCharges";
}
