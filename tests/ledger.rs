//! The ledger stores: the protocol's conformance suite and reference model over every store, each
//! store's own behaviour, pressure, and chaos (kill, restart, freeze).
//!
//! One test binary per area; each file below is a module of it.

mod support;

mod ledger {
    mod conformance;
    mod forget;
    mod ledger_pressure;
    mod memory_store;
    mod model_based;
    mod postgres_chaos;
    mod postgres_store;
    mod postgres_transactional;
    mod records_cli;
    mod redis_chaos;
    mod redis_cluster;
    mod redis_store;
}
