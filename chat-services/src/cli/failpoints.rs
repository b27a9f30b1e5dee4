//! Fault injection for tests and the lab (the `failpoints` feature, off in the images):
//! hidden flags that crash the process or slow and refuse answers at chosen points.

use std::time::Duration;

use crate::config::Failpoints;

/// The test hooks.
#[derive(Debug, Clone, clap::Args)]
pub struct FailpointArgs {
    /// Fault injection for tests and the lab: SIGKILL the process right after the n-th
    /// received message is committed to the inbox, before XACK. Only in builds with the
    /// `failpoints` feature.
    #[arg(long, env = "CHAT_CRASH_AFTER_INBOX_COMMIT", hide = true)]
    pub crash_after_inbox_commit: Option<u64>,
    /// Fault injection: SIGKILL the process when about to record a received message with
    /// exactly this body (a message that crashes its consumer). Only with `failpoints`.
    #[arg(long, env = "CHAT_CRASH_ON_BODY", hide = true)]
    pub crash_on_body: Option<String>,
    /// Fault injection: answer history requests of this chat this much later
    /// (`<chat>:<duration>`, e.g. `5:2s`), as a slow network or database would. Only with
    /// `failpoints`.
    #[arg(long, env = "CHAT_SLOW_HISTORY", hide = true, value_parser = parse_slow_history)]
    pub slow_history: Option<(i64, Duration)>,
    /// Fault injection: answer the first sends to this chat 503 (`<chat>:<count>`, e.g.
    /// `5:2`), as an unavailable database would. Only with `failpoints`.
    #[arg(long, env = "CHAT_REFUSE_SENDS", hide = true, value_parser = parse_refuse_sends)]
    pub refuse_sends: Option<(i64, u64)>,
}

impl FailpointArgs {
    pub(crate) fn settings(&self) -> Failpoints {
        Failpoints {
            inbox: crate::inbox::Failpoints {
                crash_after_inbox_commit: self.crash_after_inbox_commit,
                crash_on_body: self.crash_on_body.clone(),
            },
            slow_history: self.slow_history,
            refuse_sends: self.refuse_sends,
        }
    }
}

fn parse_slow_history(s: &str) -> Result<(i64, Duration), String> {
    let (chat, delay) = s
        .split_once(':')
        .ok_or_else(|| format!("'{s}' is not <chat>:<duration>"))?;
    let chat = chat
        .parse()
        .map_err(|_| format!("'{chat}' is not a chat id"))?;
    let delay = humantime::parse_duration(delay).map_err(|e| e.to_string())?;
    Ok((chat, delay))
}

fn parse_refuse_sends(s: &str) -> Result<(i64, u64), String> {
    let (chat, count) = s
        .split_once(':')
        .ok_or_else(|| format!("'{s}' is not <chat>:<count>"))?;
    let chat = chat
        .parse()
        .map_err(|_| format!("'{chat}' is not a chat id"))?;
    let count = count
        .parse()
        .map_err(|_| format!("'{count}' is not a count"))?;
    Ok((chat, count))
}
