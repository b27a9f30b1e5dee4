//! The Postgres side of the fence, for an application that records into Postgres: one row
//! per shard holding the epoch of the shard's current consumer.
//!
//! A consumer that took a shard's lease claims the shard here ([`FenceTable::claim`]: the
//! epoch goes up by one, after waiting for any write that holds the row). Every write that
//! records entries checks the epoch in its own transaction first ([`FenceTable::check`]:
//! the row locked `FOR SHARE`, so a claim waits for the write and the write for the
//! claim). A holder paused past its lease (a stall, SIGSTOP) thus finds a newer epoch when
//! it wakes and writes nothing, however long it slept: the lease alone cannot promise that.
//!
//! Set `lock_timeout`, `statement_timeout` and `idle_in_transaction_session_timeout` on the
//! connections that record and claim: a holder paused inside its transaction keeps the
//! row locked, and only those end the next holder's wait (and make a slow write `Busy`).
//!
//! ```sql
//! -- FenceTable::migration("billing.inbox_fence")
//! CREATE TABLE IF NOT EXISTS billing.inbox_fence (
//!   shard  integer PRIMARY KEY CHECK (shard >= 0),
//!   holder text    NOT NULL,
//!   epoch  bigint  NOT NULL
//! );
//! ```

use outbox_core::ConfigError;
use tokio_postgres::GenericClient;

use crate::inbox::{Fence, RecordError};

/// A fence table's name (optionally schema-qualified), checked to be a plain identifier:
/// it is written into statements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceTable(String);

impl FenceTable {
    /// `name`: `table` or `schema.table`, letters, digits and underscores.
    pub fn new(name: impl Into<String>) -> Result<Self, ConfigError> {
        let name = name.into();
        let plain = |part: &str| {
            !part.is_empty()
                && !part.starts_with(|c: char| c.is_ascii_digit())
                && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        };
        let parts: Vec<&str> = name.split('.').collect();
        if parts.len() > 2 || !parts.iter().all(|p| plain(p)) {
            return Err(ConfigError(format!(
                "fence table '{name}' must be `table` or `schema.table` of letters, digits and underscores"
            )));
        }
        Ok(Self(name))
    }

    /// The table's name as given.
    pub fn name(&self) -> &str {
        &self.0
    }

    /// The statement that creates the table if it is not there (for a migration).
    pub fn migration(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} (\n  shard  integer PRIMARY KEY CHECK (shard >= 0),\n  holder text    NOT NULL,\n  epoch  bigint  NOT NULL\n);\n",
            self.0
        )
    }

    /// Claim `shard` for `holder`: its epoch goes up by one (the first claim makes it 1).
    /// Waits for a previous holder's write in flight, whose epoch it then invalidates.
    pub async fn claim(
        &self,
        client: &impl GenericClient,
        holder: &str,
        shard: u32,
    ) -> Result<i64, tokio_postgres::Error> {
        let row = client
            .query_one(
                &format!(
                    "INSERT INTO {} AS f (shard, holder, epoch) VALUES ($2, $1, 1)
                     ON CONFLICT (shard) DO UPDATE SET holder = $1, epoch = f.epoch + 1
                     RETURNING epoch",
                    self.0
                ),
                &[&holder, &(shard as i32)],
            )
            .await?;
        Ok(row.get(0))
    }

    /// Inside the transaction that records a batch, first: lock the shard's row and check
    /// that `fence` is still its epoch. `Err(RecordError::Fenced)`: another consumer claimed
    /// the shard since; roll back (nothing may be written).
    pub async fn check(
        &self,
        transaction: &impl GenericClient,
        fence: Fence,
    ) -> Result<(), RecordError> {
        let row = transaction
            .query_opt(
                &format!("SELECT epoch FROM {} WHERE shard = $1 FOR SHARE", self.0),
                &[&(fence.shard as i32)],
            )
            .await
            .map_err(|e| classify(&e))?;
        // No row: nobody ever claimed the shard, so no epoch is current.
        let current: i64 = row.map_or(0, |r| r.get(0));
        if current == fence.epoch {
            Ok(())
        } else {
            Err(RecordError::Fenced {
                ours: fence.epoch,
                current,
            })
        }
    }
}

/// What a Postgres error means for recording (see [`RecordError`]): a statement or lock
/// wait that ran out is `Busy`; a connection, resource, shutdown or serialization failure
/// `Unavailable`; a data exception or constraint violation (SQLSTATE 22, 23; a unique
/// violation excepted: a write that can meet a duplicate says `ON CONFLICT`) `Refused`;
/// anything else the database's state.
pub fn classify(e: &tokio_postgres::Error) -> RecordError {
    let text = e.as_db_error().map_or_else(
        || e.to_string(),
        |db| format!("postgres {}: {}", db.code().code(), db.message()),
    );
    match e.code().map(|c| c.code()) {
        Some("57014" | "55P03") => RecordError::Busy(text),
        Some(code) if matches!(&code[..2], "08" | "53" | "57" | "58" | "40") => {
            RecordError::Unavailable(text)
        }
        Some(code) if matches!(&code[..2], "22" | "23") && code != "23505" => {
            RecordError::Refused(text)
        }
        Some(_) => RecordError::State(text),
        None => RecordError::Unavailable(text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_names_are_taken() {
        assert_eq!(
            FenceTable::new("billing.inbox_fence").unwrap().name(),
            "billing.inbox_fence"
        );
        assert!(FenceTable::new("inbox_fence").is_ok());
        for bad in ["", "a.b.c", "x; DROP TABLE y", "1abc", "a.", "\"quoted\""] {
            assert!(FenceTable::new(bad).is_err(), "{bad:?} was taken");
        }
        assert!(FenceTable::new("s.t")
            .unwrap()
            .migration()
            .starts_with("CREATE TABLE IF NOT EXISTS s.t ("));
    }
}
