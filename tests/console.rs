//! The operator's console over real loopback HTTP, nested in a user's router: listing and
//! inspecting records, acting on them fenced by the look they were made from, and the
//! refusals that keep it closed (authorizer, roles, CSRF, hostile input).

#[path = "support/capture.rs"]
mod capture;

mod console {
    mod api;
    mod harness;
    mod metrics;
    mod pages;
    mod reconcile;
    mod scenario;
}
