//! A whole chat system for tests, one file per concern: the [`Stack`] (database, Redis,
//! both relays in-process), its services in-process or as real processes (services), a
//! user's calls (clients), what users are shown (viewer), and the identity provider (idp).

mod clients;
mod idp;
mod services;
mod stack;
mod viewer;

pub(crate) use clients::*;
pub(crate) use idp::*;
pub(crate) use services::*;
pub(crate) use stack::*;
pub(crate) use viewer::*;
