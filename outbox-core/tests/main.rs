//! outbox-core against real servers (testkit's throwaway Redis Cluster), one binary.

mod admin_listener;
mod cluster;
