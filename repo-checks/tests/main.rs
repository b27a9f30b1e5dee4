//! The repository's checks, one module per thing checked, in one binary: where the
//! dependencies come from (dependencies), the deploy files against the binaries
//! (deployment), the compose file run for real under podman (containers), and the README's
//! run command run for real (local_stack). They start real Postgres and Redis processes and
//! the workspace's binaries ([`repo_checks::binaries`]).

mod support;

mod containers;
mod dependencies;
mod deployment;
mod local_stack;
