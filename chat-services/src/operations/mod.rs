//! What runs beside the message path for the operator: the dead-letter command
//! (`dead_letters`: list, replay, drop) and retention (`retention`: the outbox and, when
//! asked, old messages deleted in small batches).

pub(crate) mod dead_letters;
pub(crate) mod retention;
