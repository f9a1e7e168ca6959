//! Shared test support: private Redis servers and clusters, private PostgreSQL servers,
//! log capture, stores that are down, and the orders service the seams tests share.
//!
//! Every test binary declares `mod support;`; each uses only part of it.
#![allow(dead_code, unused_imports)]

/// The demonstration's payments service, tested as users run it.
#[path = "../../examples/axum_server.rs"]
pub mod axum_server;
pub mod capture;
pub mod down;
pub mod in_place;
pub mod orders;
pub mod postgres;
pub mod redis;
pub mod redis_cluster;
