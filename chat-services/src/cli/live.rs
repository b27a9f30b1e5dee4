//! Live delivery: event streams (their heartbeat, how much may queue for slow readers, how
//! many may be open) and how often the feed tips are checked for a lost live hint.

use std::time::Duration;

use outbox_core::ConfigError;

use crate::config::LiveSettings;

/// Event streams and the feed check.
#[derive(Debug, Clone, clap::Args)]
pub struct LiveArgs {
    /// Interval of SSE heartbeat events (`event: heartbeat`, an event a browser's
    /// EventSource sees): the chat page takes a stream silent for one and a half of them
    /// and half a second for dead (a frozen instance, a connection that forwards nothing)
    /// and opens another.
    #[arg(long, env = "CHAT_SSE_HEARTBEAT", value_parser = humantime::parse_duration, default_value = "2s")]
    pub sse_heartbeat: Duration,
    /// Bytes queued for all event-stream clients of the instance together at most: past
    /// it, a client with a backlog is dropped (it resumes with Last-Event-ID), so slow
    /// readers cannot add up to more memory than the container has.
    #[arg(long, env = "CHAT_SSE_BUFFER_TOTAL", default_value_t = 64 << 20)]
    pub sse_buffer_total: usize,
    /// Bytes queued for one event-stream client at most; a client that reads slower than
    /// its chat fills it is dropped (it resumes with Last-Event-ID, missing nothing).
    #[arg(long, env = "CHAT_SSE_CLIENT_BUFFER", default_value_t = 256 * 1024)]
    pub sse_client_buffer: usize,
    /// Open event streams (SSE) at most on this instance; beyond it 503 (clients retry).
    #[arg(long, env = "CHAT_MAX_EVENT_STREAMS", default_value_t = 5_000)]
    pub max_event_streams: usize,
    /// Event streams one user may hold open on this instance; past it 429.
    #[arg(long, env = "CHAT_MAX_EVENT_STREAMS_PER_USER", default_value_t = 16)]
    pub max_event_streams_per_user: usize,
    /// Messages a stream replays at most when it opens behind the chat's tip (its
    /// Last-Event-ID or ?after= older than that): it starts this many before the tip and says
    /// so first (`event: skipped`, with the positions left out), and the client pages back
    /// through history for older ones. A reconnect within this many messages misses nothing.
    #[arg(long, env = "CHAT_SSE_MAX_REPLAY", default_value_t = 2_000)]
    pub sse_max_replay: i64,
    /// How often each instance compares the newest position of every chat it streams with
    /// what its streams sent: the bound on how late a message whose live hint was lost (its
    /// writer killed between commit and hint) is shown. One small query per interval.
    #[arg(long, env = "CHAT_FEED_CHECK_INTERVAL", value_parser = humantime::parse_duration, default_value = "2s")]
    pub feed_check_interval: Duration,
}

impl LiveArgs {
    /// The settings, or what to change.
    pub(crate) fn validate(&self) -> Result<LiveSettings, ConfigError> {
        let refuse = |message: &str| Err(ConfigError::new(message));
        if self.sse_heartbeat.is_zero() {
            return refuse("--sse-heartbeat must be greater than zero");
        }
        if self.sse_client_buffer < 64 * 1024 {
            return refuse("--sse-client-buffer must be at least 65536 bytes (one message's frame can reach ~24 KiB)");
        }
        if self.sse_buffer_total < self.sse_client_buffer {
            return refuse("--sse-buffer-total must be at least --sse-client-buffer");
        }
        if self.feed_check_interval < Duration::from_millis(100) {
            return refuse("--feed-check-interval must be at least 100ms");
        }
        if self.sse_max_replay < 1 {
            return refuse("--sse-max-replay must be at least 1");
        }
        if self.max_event_streams == 0 || self.max_event_streams_per_user == 0 {
            return refuse(
                "--max-event-streams and --max-event-streams-per-user must be at least 1",
            );
        }
        Ok(LiveSettings {
            sse_heartbeat: self.sse_heartbeat,
            sse_buffer_total: self.sse_buffer_total,
            sse_client_buffer: self.sse_client_buffer,
            max_event_streams: self.max_event_streams,
            max_event_streams_per_user: self.max_event_streams_per_user,
            sse_max_replay: self.sse_max_replay,
            feed_check_interval: self.feed_check_interval,
        })
    }
}
