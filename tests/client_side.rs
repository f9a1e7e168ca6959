//! The client face and the retry layer: operations, retries, reconciling doubt, the reqwest
//! adapters, randomized faults.
//!
//! One test binary per area; each file below is a module of it.

mod support;

mod client_side {
    mod client;
    mod drift;
    mod fault_matrix;
    mod key_header;
    mod key_in_use;
    mod layer_order;
    mod outcome_hook;
    mod provider_keys;
    mod randomized;
    mod reconcile;
    mod redirects;
    mod reqwest;
    mod reqwest_middleware;
    mod retry;
    mod retry_inside;
    mod store_parity;
}
