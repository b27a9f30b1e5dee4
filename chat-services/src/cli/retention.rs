//! Retention: how long the outbox keeps rows (the bound on what a relay can republish) and,
//! optionally, how long messages are kept at all.

use std::time::Duration;

use outbox_core::ConfigError;

use crate::config::Retention;

/// What is deleted, and when.
#[derive(Debug, Clone, clap::Args)]
pub struct RetentionArgs {
    /// Outbox rows older than this are deleted. It bounds recovery: a relay whose slot or
    /// Redis lost data can republish only rows still in the outbox.
    #[arg(long, env = "CHAT_OUTBOX_RETENTION", value_parser = humantime::parse_duration, default_value = "24h")]
    pub outbox_retention: Duration,
    /// Sent messages written, and received messages recorded, longer ago than this are
    /// deleted (off unless set): history, feeds and resuming streams show what remains. A
    /// received message's row is what keeps a redelivery from being recorded twice, so this
    /// must exceed how long after recording one can come again: the other side's
    /// --outbox-retention (a rebuild republishes from it) and how long dead letters wait
    /// before a replay. At least twice this side's --outbox-retention, and 2 days.
    #[arg(long, env = "CHAT_MESSAGE_RETENTION", value_parser = humantime::parse_duration)]
    pub message_retention: Option<Duration>,
    /// How often retention runs.
    #[arg(long, env = "CHAT_OUTBOX_RETENTION_INTERVAL", value_parser = humantime::parse_duration, default_value = "1m")]
    pub outbox_retention_interval: Duration,
}

impl RetentionArgs {
    /// The retention, or what to change.
    pub(crate) fn validate(&self) -> Result<Retention, ConfigError> {
        if self.outbox_retention < Duration::from_secs(60)
            || self.outbox_retention_interval.is_zero()
        {
            return Err(ConfigError::new("--outbox-retention must be at least 1m and --outbox-retention-interval greater than zero"));
        }
        if let Some(messages) = self.message_retention {
            let floor = (self.outbox_retention * 2).max(Duration::from_secs(2 * 24 * 3600));
            if messages < floor {
                return Err(ConfigError(format!(
                    "--message-retention {} is below {}: the inbox must remember a message for as long as the other side may deliver it again (twice --outbox-retention, and 2 days at least)",
                    humantime::format_duration(messages),
                    humantime::format_duration(floor)
                )));
            }
        }
        Ok(Retention {
            outbox: self.outbox_retention,
            messages: self.message_retention,
            every: self.outbox_retention_interval,
        })
    }
}
