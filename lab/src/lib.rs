//! The lab: the original write-up's experiments reproduced with the real binaries, a fault
//! soak, and benchmarks beside baselines (dual write, NOTIFY relay, polling relay), each
//! printing a table and writing a JSON result to `target/lab/`.

pub mod auth_cost;
pub mod backlog;
pub mod baseline;
pub mod chaos;
pub mod clients;
pub mod conformance;
pub mod cpu;
pub mod knee;
pub mod latency;
pub mod rebuild;
pub mod report;
pub mod soak;
pub mod stats;
pub mod stuck;
pub mod system;
pub mod throughput;
