//! Which Postgres cluster and history the relay reads from: the server's system id,
//! timeline and timeline history (`IDENTIFY_SYSTEM`, `TIMELINE_HISTORY` on a replication
//! session). The stream's record keeps them, and recovery compares whole histories with
//! them to tell a promoted standby, a restore and an old primary apart.

use std::time::Duration;

use pgwire_replication::Lsn;

use crate::error::RelayError;

/// The Postgres cluster and history the relay reads from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Origin {
    pub system_id: String,
    pub timeline: u32,
    /// The server's timeline history (empty on timeline 1).
    pub history: TimelineHistory,
}

impl Origin {
    /// IDENTIFY_SYSTEM and TIMELINE_HISTORY on a gated replication session: the server's
    /// origin, and its current WAL flush position.
    pub(crate) async fn identify(
        session: &mut pgwire_replication::ReplicationClient,
        timeout: Duration,
    ) -> Result<(Origin, u64), RelayError> {
        let within = |_| RelayError::ConnectTimeout(timeout);
        let identity = tokio::time::timeout(timeout, session.identify_system())
            .await
            .map_err(within)??;
        let history = if identity.timeline > 1 {
            let file = tokio::time::timeout(timeout, session.timeline_history(identity.timeline))
                .await
                .map_err(within)??;
            TimelineHistory::parse(&String::from_utf8_lossy(&file.content))
                .map_err(|e| RelayError::Protocol(format!("TIMELINE_HISTORY: {e}")))?
        } else {
            TimelineHistory::default()
        };
        let origin = Origin {
            system_id: identity.system_id,
            timeline: identity.timeline,
            history,
        };
        Ok((origin, identity.xlogpos.as_u64()))
    }
}

/// A line of a timeline history file that is not `<tli> <lsn> [reason]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("timeline history line {0:?}")]
pub(crate) struct BadHistoryLine(String);

/// A timeline history file: for each ancestor timeline, the LSN where it ended.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct TimelineHistory {
    pub switches: Vec<(u32, u64)>,
}

impl TimelineHistory {
    /// Parse a history file (`<tli>\t<X/Y>\t<reason>` lines; comments and blanks skipped).
    pub(crate) fn parse(text: &str) -> Result<Self, BadHistoryLine> {
        let mut switches = Vec::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut fields = line.split_whitespace();
            let tli = fields.next().and_then(|t| t.parse().ok());
            let lsn = fields.next().and_then(|l| Lsn::parse(l).ok());
            match (tli, lsn) {
                (Some(tli), Some(lsn)) => switches.push((tli, lsn.as_u64())),
                _ => return Err(BadHistoryLine(line.to_string())),
            }
        }
        Ok(Self { switches })
    }

    /// As stored in the record: `tli:lsn` pairs separated by commas.
    pub(crate) fn encode(&self) -> String {
        self.switches
            .iter()
            .map(|(tli, lsn)| format!("{tli}:{lsn}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub(crate) fn decode(text: &str) -> Option<Self> {
        let mut switches = Vec::new();
        for pair in text.split(',').filter(|p| !p.is_empty()) {
            let (tli, lsn) = pair.split_once(':')?;
            switches.push((tli.parse().ok()?, lsn.parse().ok()?));
        }
        Some(Self { switches })
    }

    /// Where a record's `timeline` (`None`: unknown) ended on the way to the current one: up
    /// to there both histories agree; 0 when it is not an ancestor.
    pub(crate) fn agrees_through(&self, timeline: Option<u32>) -> u64 {
        timeline.and_then(|t| self.switch_point(t)).unwrap_or(0)
    }

    /// Where `timeline` ended on the way to the current one (`None`: not an ancestor).
    pub(crate) fn switch_point(&self, timeline: u32) -> Option<u64> {
        self.switches
            .iter()
            .find(|(tli, _)| *tli == timeline)
            .map(|(_, lsn)| *lsn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_files_parse_and_round_trip() {
        let text =
            "1\t0/3000158\tno recovery target specified\n\n2\t0/5000000\tat restore point \"x\"\n";
        let h = TimelineHistory::parse(text).unwrap();
        assert_eq!(h.switches, vec![(1, 0x3000158), (2, 0x5000000)]);
        assert_eq!(TimelineHistory::decode(&h.encode()), Some(h.clone()));
        assert_eq!(h.switch_point(2), Some(0x5000000));
        assert_eq!(h.switch_point(3), None);
        assert_eq!(
            TimelineHistory::decode(""),
            Some(TimelineHistory::default())
        );
        assert!(TimelineHistory::parse("1 nonsense").is_err());
    }
}
