//! The client face and the retry layer: operations, retries, reconciling doubt, the reqwest
//! adapters, randomized faults.
//!
//! One test binary per area; each file below is a module of it.

mod support;

mod client_side {
    mod client;
    mod fault_matrix;
    mod layer_order;
    mod outcome_hook;
    mod provider_keys;
    mod randomized;
    mod reconcile;
    mod redirects;
    mod reqwest;
    mod reqwest_middleware;
    mod retry;
}
