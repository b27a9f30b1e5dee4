//! The inbox consumer: which stream it reads (the other side's, by default), under which
//! name, and the receiving protocol's knobs (lease, claims, dead letters), validated into
//! `outbox_consumer`'s settings.

use std::time::Duration;

use outbox_consumer::ConsumerConfig;
use outbox_core::connect::RedisTarget;
use outbox_core::stream::{keys, validate_layout};
use outbox_core::ConfigError;

use crate::side::Side;

/// The stream consumed and the receiving protocol.
#[allow(rustdoc::invalid_html_tags)] // --help text: `<side>` is a placeholder, not a tag.
#[derive(Debug, Clone, clap::Args)]
pub struct InboxArgs {
    /// Stable consumer name of this instance in the consumer group (default: <side>-<hostname>).
    #[arg(long, env = "CONSUMER_NAME")]
    pub consumer_name: Option<String>,
    /// Stream to consume (default: the other side's outbox stream, outbox:<other side>).
    #[arg(long, env = "CHAT_INBOUND_STREAM")]
    pub inbound_stream: Option<String>,
    /// Shards of the stream consumed (the other side's; see cdc-relay's --stream-shards):
    /// one lease and one consumer per shard, shared fairly by this side's instances. Must
    /// match what the stream was set up with (its own variable, not the relay's
    /// CDC_STREAM_SHARDS, which counts this side's stream).
    #[arg(long, env = "CHAT_INBOUND_STREAM_SHARDS", default_value_t = 1)]
    pub stream_shards: u32,
    /// Where entries that cannot be recorded go, with the reason (default: deadletter:<side>).
    #[arg(long, env = "CHAT_DEAD_LETTER_STREAM")]
    pub dead_letter_stream: Option<String>,
    /// Dead letters kept at most; beyond it the oldest are trimmed (counted in
    /// chat_dead_letters_trimmed_total and logged): a flood of poison cannot fill Redis.
    #[arg(long, env = "CHAT_DEAD_LETTER_MAX_LEN", default_value_t = 100_000)]
    pub dead_letter_max_len: u64,
    /// Pending entries idle this long are claimed from the consumer holding them.
    #[arg(long, env = "CHAT_CLAIM_IDLE", value_parser = humantime::parse_duration, default_value = "30s")]
    pub claim_idle: Duration,
    /// Deliveries without acknowledgement after which an entry is dead-lettered.
    #[arg(long, env = "CHAT_MAX_DELIVERIES", default_value_t = 5)]
    pub max_deliveries: u64,
    /// TTL of the inbox consumer lease (one active consumer per side).
    #[arg(long, env = "CHAT_LEASE_TTL", value_parser = humantime::parse_duration, default_value = "10s")]
    pub lease_ttl: Duration,
}

impl InboxArgs {
    /// The receiving protocol's settings for `side`, or what to change.
    pub(crate) fn validate(
        &self,
        side: Side,
        redis: &RedisTarget,
        cluster: bool,
    ) -> Result<ConsumerConfig, ConfigError> {
        let refuse = |message: &str| Err(ConfigError::new(message));
        let consumer = self.consumer_name(side)?;
        let shards = self.stream_layout(cluster)?;
        if self.dead_letter_max_len == 0 {
            return refuse("--dead-letter-max-len must be at least 1");
        }
        if self.max_deliveries == 0 {
            return refuse("--max-deliveries must be at least 1");
        }
        if self.lease_ttl < Duration::from_secs(1) {
            return refuse("--lease-ttl must be at least 1s");
        }
        if self.claim_idle.is_zero() {
            return refuse("--claim-idle must be greater than zero");
        }
        let stream = self
            .inbound_stream
            .clone()
            .unwrap_or_else(|| side.other().outbox_stream());
        Ok(ConsumerConfig {
            redis: redis.clone(),
            // A stream named by --inbound-stream: its layout is the operator's.
            check_layout: stream.starts_with(&side.other().outbox_stream()),
            stream,
            shards,
            group: side.as_str().to_string(),
            consumer,
            dead_letter_stream: self
                .dead_letter_stream
                .clone()
                .unwrap_or_else(|| keys::dead_letter_base(side.as_str())),
            dead_letter_max_len: self.dead_letter_max_len,
            claim_idle: self.claim_idle,
            max_deliveries: self.max_deliveries,
            lease_ttl: self.lease_ttl,
            count_unsharded_dead_letters: true,
        })
    }

    /// This instance's stable consumer name.
    fn consumer_name(&self, side: Side) -> Result<String, ConfigError> {
        let consumer_name = self
            .consumer_name
            .clone()
            .unwrap_or_else(|| format!("{side}-{}", hostname()));
        if consumer_name.is_empty()
            || consumer_name.contains('/')
            || consumer_name.chars().any(char::is_whitespace)
        {
            return Err(ConfigError(format!(
                "--consumer-name '{consumer_name}' must be non-empty, without '/' or whitespace"
            )));
        }
        Ok(consumer_name)
    }

    /// The inbound stream's shard count, checked with the key names it splits.
    fn stream_layout(&self, cluster: bool) -> Result<u32, ConfigError> {
        let named: Vec<(&str, &str)> = [
            ("--inbound-stream", &self.inbound_stream),
            ("--dead-letter-stream", &self.dead_letter_stream),
        ]
        .into_iter()
        .filter_map(|(flag, name)| name.as_deref().map(|n| (flag, n)))
        .collect();
        validate_layout("--stream-shards", self.stream_shards, cluster, &named)
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "local".into())
}
